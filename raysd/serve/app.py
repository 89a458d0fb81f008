"""Build the Serve application from a ``ServerConfig``; start a local Ray + Serve for ``raysd serve``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ray import serve
from ray.serve import Application

from raysd.models import load_tokenizer
from raysd.serve.config import ServerConfig
from raysd.serve.draft_worker import DraftWorker
from raysd.serve.ingress import Router
from raysd.serve.pressure import PressureMonitor
from raysd.serve.target_worker import TargetWorker

logger = logging.getLogger("raysd.serve")
APP_NAME = "raysd"
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
              "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def build_app(config: ServerConfig) -> Application:
    """Router ← (DraftWorker, TargetWorker, PressureMonitor), handles passed through ``.bind()``."""
    runtime_env = {"env_vars": WORKER_ENV}
    target_cfg = config.target
    monitor = serve.deployment(PressureMonitor, name="PressureMonitor",
                               ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env}).bind()
    target = serve.deployment(
        TargetWorker, name="TargetWorker", num_replicas=target_cfg.placement.num_replicas,
        max_ongoing_requests=1000,
        ray_actor_options={**target_cfg.placement.actor_options(), "runtime_env": runtime_env}).bind(target_cfg)
    draft = None
    if config.draft is not None:
        vocab_size = len(load_tokenizer(target_cfg.model_dir))
        draft = serve.deployment(
            DraftWorker, name="DraftWorker", num_replicas=config.draft.placement.num_replicas,
            max_ongoing_requests=1000,
            ray_actor_options={**config.draft.placement.actor_options(), "runtime_env": runtime_env},
        ).bind(config.draft, vocab_size)
    router_cfg = config.router
    return serve.deployment(
        Router, name="Router", num_replicas=router_cfg.placement.num_replicas,
        max_ongoing_requests=router_cfg.max_ongoing_requests, max_queued_requests=router_cfg.max_queued_requests,
        ray_actor_options={**router_cfg.placement.actor_options(), "runtime_env": runtime_env},
    ).bind(router_cfg, str(target_cfg.model_dir), draft, target, monitor)


def start_local(config: ServerConfig, num_cpus: int | None = None, blocking: bool = False):
    """Start an embedded local Ray (loopback only) and deploy; returns the base URL."""
    import ray

    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    resources = {"draft_device": 4.0, "target_device": 4.0}
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, resources=resources,
                 _node_ip_address="127.0.0.1", runtime_env={"env_vars": WORKER_ENV},
                 configure_logging=True, logging_level=logging.WARNING)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=blocking)
    return f"http://{config.host}:{config.port}"


def default_local_config_path() -> Path:
    return Path(__file__).resolve().parents[2] / "deployments" / "local.yaml"
