"""The shipped deployment files validate, resolve to the placement they promise, and agree with each other."""

import json
from pathlib import Path

import pytest
import yaml

from raysd.cli import main
from raysd.serve.app import check_resources, resource_demand
from raysd.serve.config import ServerConfig
from raysd.serve.placement import resolve_deployments

DEPLOYMENTS = Path(__file__).resolve().parents[1] / "deployments"


def test_local_config_places_models_on_device_classes():
    config = ServerConfig.from_file(DEPLOYMENTS / "local.yaml")
    resolved = resolve_deployments(config)
    assert resolved["TargetWorker"]["placement_group_bundles"] == [{"target_device": 1.0}]
    assert resolved["DraftWorker"]["placement_group_bundles"] == [{"draft_device": 1.0}]
    assert resolved["TargetWorker"]["ray_actor_options"] == {"num_cpus": 0}  # the replica itself is light
    assert resource_demand(config) == {"target_device": 1.0, "draft_device": 1.0}


def test_gpu_cluster_dry_run_resolves_tp_groups_and_draft_gpus(capsys):
    assert main(["serve", "--config", str(DEPLOYMENTS / "gpu-cluster.yaml"), "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    target = printed["deployments"]["TargetWorker"]
    assert target["tp_size"] == 4 and target["placement_group_strategy"] == "STRICT_PACK"
    assert target["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0, "accelerator_type:H100": 0.001}] * 4
    assert all(actor["accelerator_type"] == "H100" and actor["num_gpus"] == 1 for actor in target["model_actors"])
    draft = printed["deployments"]["DraftWorker"]
    assert draft["num_replicas"] == 2 and draft["model_actors"][0]["accelerator_type"] == "L4"
    assert printed["total_resources"]["GPU"] == 2 * 4 + 2  # two TP=4 groups and two drafts


def test_kuberay_manifest_carries_the_gpu_cluster_config():
    manifest = yaml.safe_load((DEPLOYMENTS / "kuberay-rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    embedded = ServerConfig.from_serve_config(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    assert embedded == ServerConfig.from_file(DEPLOYMENTS / "gpu-cluster.yaml")
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    gpus = {name: g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
            for name, g in groups.items()}
    assert gpus == {"draft-l4": 1, "target-h100": 8}  # a TP=4 group fits on one target node (STRICT_PACK)


def test_a_config_the_cluster_cannot_place_is_refused_with_the_fix():
    config = ServerConfig.model_validate({"target": {"tp_size": 3, "placement": {"resources": {"target_device": 1}}}})
    with pytest.raises(ValueError, match=r"target_device: needs 3, cluster has 2.*tp_size"):
        check_resources(config, {"CPU": 2.0, "target_device": 2.0, "draft_device": 2.0})
    check_resources(config, {"CPU": 2.0, "target_device": 4.0})  # fits: no error
