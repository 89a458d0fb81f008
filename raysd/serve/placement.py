"""Turn a ``Placement`` into Ray options: the Serve replica's own (tiny) options, the placement-group
bundles its model actors need, and the options that put an actor into bundle ``i`` of its replica's group.

A worker replica is a light leader (no model, ``num_cpus: 0``); the model lives in actors it starts
inside the placement group Serve reserved for the replica, one bundle per actor (per TP rank for targets,
packed on one node with STRICT_PACK). When the replica dies, Serve frees the group and the actors go with it.
"""

from __future__ import annotations

from typing import Any

from raysd.serve.config import Placement, ServerConfig


def bundle(placement: Placement) -> dict[str, float]:
    """Resources of one model actor (zeros dropped; Ray rejects empty bundles)."""
    resources = {"CPU": placement.num_cpus, "GPU": placement.num_gpus, **placement.resources}
    if placement.accelerator_type:
        resources[f"accelerator_type:{placement.accelerator_type}"] = 0.001
    return {name: float(amount) for name, amount in resources.items() if amount > 0}


def deployment_options(placement: Placement, num_actors: int) -> dict[str, Any]:
    """``serve.deployment`` options for a worker whose replica leads ``num_actors`` model actors."""
    options: dict[str, Any] = {"num_replicas": placement.num_replicas, "ray_actor_options": {"num_cpus": 0}}
    one = bundle(placement)
    if one:
        options["placement_group_bundles"] = [dict(one) for _ in range(num_actors)]
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def model_actor_options(placement: Placement) -> dict[str, Any]:
    """Resource options of one model actor (no restarts: its replica is replaced instead)."""
    options: dict[str, Any] = {"num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus,
                               "max_restarts": 0}
    if placement.resources:
        options["resources"] = dict(placement.resources)
    if placement.accelerator_type:
        options["accelerator_type"] = placement.accelerator_type
    return options


def actor_options(placement: Placement, bundle_index: int) -> dict[str, Any]:
    """Options for model actor ``bundle_index`` of the calling replica (inside its group when it has one)."""
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = model_actor_options(placement)
    group = get_current_placement_group()
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle_index)
    return options


def resolve_deployments(config: ServerConfig) -> dict[str, dict[str, Any]]:
    """What ``build_app`` asks Ray for, per deployment: replicas, replica options, placement-group bundles
    and the options of each model actor. Pure (no Ray needed): ``raysd serve --dry-run`` prints it."""
    target = config.target
    resolved: dict[str, dict[str, Any]] = {
        "Router": {"num_replicas": config.router.placement.num_replicas,
                   "ray_actor_options": config.router.placement.actor_options(),
                   "max_ongoing_requests": config.router.max_ongoing_requests,
                   "max_queued_requests": config.router.max_queued_requests},
        "ClusterMonitor": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
        "TargetWorker": {**deployment_options(target.placement, target.tp_size), "tp_size": target.tp_size,
                         "model_actors": [model_actor_options(target.placement) for _ in range(target.tp_size)]},
    }
    if config.draft is not None:
        resolved["DraftWorker"] = {**deployment_options(config.draft.placement, 1),
                                   "model_actors": [model_actor_options(config.draft.placement)]}
    return resolved
