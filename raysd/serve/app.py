"""Build the Serve application from a ``ServerConfig``; start a local Ray + Serve for ``raysd serve``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ray import serve
from ray.serve import Application

from raysd.models import load_tokenizer
from raysd.serve.cluster import ClusterMonitor
from raysd.serve.config import ServerConfig
from raysd.serve.draft_worker import DraftWorker
from raysd.serve.ingress import Router
from raysd.serve.placement import deployment_options, resolve_deployments
from raysd.serve.target_worker import TargetWorker
from raysd.telemetry import otel_env

logger = logging.getLogger("raysd.serve")
APP_NAME = "raysd"
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
              "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Workers heartbeat to the monitor from Serve's health check; the monitor forgets one silent for STALE_AFTER_S
# (well above the period, so a busy controller does not make a live worker vanish).
HEALTH_CHECK_PERIOD_S = 1.0
# Per-call access logs of the monitor and workers (several a second) would drown everything else.
QUIET = {"enable_access_log": False}
STALE_AFTER_S = 15.0


def _worker_deployment(cls, name: str, placement, num_actors: int, runtime_env: dict, drain_s: float = 20.0):
    """A worker deployment: a light replica (no model) with a placement group for its model actors."""
    options = deployment_options(placement, num_actors)
    options["ray_actor_options"] = {**options["ray_actor_options"], "runtime_env": runtime_env}
    return serve.deployment(cls, name=name, max_ongoing_requests=1000, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                            health_check_timeout_s=30, logging_config=QUIET, graceful_shutdown_timeout_s=drain_s,
                            **options)


def build_app(config: ServerConfig, telemetry_env: dict[str, str] | None = None) -> Application:
    """Router ← (ClusterMonitor ← TargetWorker, DraftWorker), handles passed through ``.bind()``.

    Workers register their model actors with the monitor; routers learn them from it and call the actors
    directly each round. The worker handles are bound into the router only so Serve deploys them.
    ``telemetry_env``: the ``OTEL_*`` variables every replica and model actor gets (default: this process's).
    """
    runtime_env = {"env_vars": {**WORKER_ENV, **(otel_env() if telemetry_env is None else telemetry_env)}}
    target_cfg = config.target
    monitor = serve.deployment(ClusterMonitor, name="ClusterMonitor", max_ongoing_requests=1000, logging_config=QUIET,
                               ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env}).bind(STALE_AFTER_S)
    target = _worker_deployment(TargetWorker, "TargetWorker", target_cfg.placement, target_cfg.tp_size,
                                runtime_env, target_cfg.drain_timeout_s + 10).bind(target_cfg, monitor)
    draft = None
    if config.draft is not None:
        vocab_size = len(load_tokenizer(target_cfg.model_dir))
        draft = _worker_deployment(DraftWorker, "DraftWorker", config.draft.placement, 1,
                                   runtime_env).bind(config.draft, vocab_size, monitor)
    router_cfg = config.router
    return serve.deployment(
        Router, name="Router", num_replicas=router_cfg.placement.num_replicas,
        max_ongoing_requests=router_cfg.max_ongoing_requests, max_queued_requests=router_cfg.max_queued_requests,
        graceful_shutdown_timeout_s=router_cfg.drain_timeout_s,
        ray_actor_options={**router_cfg.placement.actor_options(), "runtime_env": runtime_env},
    ).bind(router_cfg, str(target_cfg.model_dir), monitor, [target, draft] if draft is not None else [target],
           draft is not None)


def app_builder(args: dict) -> Application:
    """Serve application builder: ``args`` is a ``ServerConfig`` mapping (``import_path:
    raysd.serve.app:app_builder`` in a Serve config file, as in deployments/*.yaml)."""
    return build_app(ServerConfig.model_validate(args or {}))


def start_local(config: ServerConfig, num_cpus: int | None = None, blocking: bool = False):
    """Start an embedded local Ray (loopback only) and deploy; returns the base URL."""
    import ray

    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    resources = {"draft_device": 4.0, "target_device": 4.0}
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, resources=resources,
                 _node_ip_address="127.0.0.1", runtime_env={"env_vars": WORKER_ENV},
                 configure_logging=True, logging_level=logging.WARNING)
    check_resources(config, ray.cluster_resources())
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=blocking)
    return f"http://{config.host}:{config.port}"


def resource_demand(config: ServerConfig) -> dict[str, float]:
    """Total resources the app reserves (all replicas, all placement bundles and replica options)."""
    demand: dict[str, float] = {}
    for spec in resolve_deployments(config).values():
        replicas = spec.get("num_replicas", 1)
        bundles = spec.get("placement_group_bundles")
        if bundles:
            for one in bundles:
                for name, amount in one.items():
                    demand[name] = demand.get(name, 0.0) + replicas * amount
            continue
        options = spec.get("ray_actor_options", {})
        for name, amount in {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0),
                             **options.get("resources", {})}.items():
            if amount:
                demand[name] = demand.get(name, 0.0) + replicas * amount
    return demand


def check_resources(config: ServerConfig, available: dict[str, float]) -> None:
    """Refuse at start a config this cluster cannot place (Serve would otherwise wait forever)."""
    short = {name: (amount, available.get(name, 0.0)) for name, amount in resource_demand(config).items()
             if not name.startswith("accelerator_type:") and amount > available.get(name, 0.0) + 1e-9}
    if short:
        detail = ", ".join(f"{name}: needs {need:g}, cluster has {have:g}" for name, (need, have) in short.items())
        raise ValueError(f"the config asks for more than this Ray cluster has ({detail}); lower num_replicas / "
                         "tp_size or the per-replica resources in the config's placement sections")


def default_local_config_path() -> Path:
    return Path(__file__).resolve().parents[2] / "deployments" / "local.yaml"
