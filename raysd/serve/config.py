"""Serving configs: one pydantic model per deployment, all inside ``ServerConfig`` (validated at start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from raysd.config import DrafterConfig, EngineConfig, PolicyConfig
from raysd.models import DEMO_DRAFT, DEMO_TARGET, REPO_ROOT


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _repo_relative(path: Path) -> Path:
    """Relative model paths mean relative to the repository, whatever the worker's working directory."""
    return path if path.is_absolute() else REPO_ROOT / path


class Placement(_Strict):
    """Where a deployment's replicas run; passed to Ray as ``ray_actor_options``."""

    num_replicas: int = Field(default=1, ge=1, description="Replicas of this deployment.")
    num_cpus: float = Field(default=0, ge=0, description="CPUs reserved per replica (0 on a laptop).")
    num_gpus: float = Field(default=0, ge=0, description="GPUs per replica (per TP rank for targets).")
    accelerator_type: str | None = Field(default=None, description="e.g. L4, H100 (Ray accelerator type).")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom resources, e.g. draft_device.")

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class DraftWorkerConfig(_Strict):
    model_dir: Path = Field(default=DEMO_DRAFT, description="Draft model directory (model drafter).")
    drafter: DrafterConfig = DrafterConfig()
    max_num_seqs: int = Field(default=64, gt=0)
    max_model_len: int = Field(default=1024, gt=1)
    k_max: int = Field(default=8, ge=1)
    threads: int = Field(default=1, gt=0, description="torch threads in the worker.")
    placement: Placement = Placement(resources={})

    _resolve_model_dir = field_validator("model_dir")(classmethod(lambda cls, value: _repo_relative(value)))


class TargetWorkerConfig(_Strict):
    model_dir: Path = Field(default=DEMO_TARGET, description="Target model directory.")
    tp_size: int = Field(default=1, ge=1, le=64, description="Tensor-parallel ranks (DeepSpeed AutoTP); 1 runs "
                                                               "without any distributed set-up.")
    rendezvous_timeout_s: float = Field(default=120.0, gt=0, description="How long ranks wait for each other "
                                                                         "(and for a collective) before failing.")
    shm_allreduce: bool = Field(default=False, description="CPU only: DeepSpeed's shared-memory all-reduce "
                                                           "(compiles a C++ op on first use, ~80 s; needs a "
                                                           "compiler). Off: plain gloo.")
    max_num_seqs: int = Field(default=64, gt=0)
    max_model_len: int = Field(default=1024, gt=1)
    k_max: int = Field(default=8, ge=1)
    threads: int = Field(default=1, gt=0)
    drain_timeout_s: float = Field(default=60.0, gt=0, description="When Serve replaces this replica (redeploy, "
                                                                    "scale-down) its sequences may finish this long.")
    placement: Placement = Field(default_factory=Placement, description="Resources of each rank (a replica "
                                                                        "reserves tp_size bundles of it).")

    _resolve_model_dir = field_validator("model_dir")(classmethod(lambda cls, value: _repo_relative(value)))


class RouterConfig(_Strict):
    model_alias: str = Field(default="raysd-demo", description="Name clients pass as `model`.")
    engine: EngineConfig = EngineConfig()
    policy: PolicyConfig = PolicyConfig()
    draft_timeout_s: float = Field(default=2.0, gt=0, description="A draft call slower than this → k=0 round.")
    target_timeout_s: float = Field(default=30.0, gt=0, description="A verify call slower than this fails the "
                                                                     "round's requests (retryable).")
    draft_retry_s: float = Field(default=2.0, gt=0, description="After a draft failure, try drafting again "
                                                                 "after this long.")
    max_ongoing_requests: int = Field(default=256, gt=0)
    max_queued_requests: int = Field(default=64, ge=-1)
    max_body_bytes: int = Field(default=1_000_000, gt=0, description="Larger request bodies get 413.")
    drain_timeout_s: float = Field(default=60.0, gt=0, description="On shutdown or redeploy a router replica "
                                                                    "keeps serving its in-flight requests this long.")
    max_waiting: int = Field(default=128, ge=0, description="Requests queued for a batch slot beyond this get a fast "
                                                            "503 with Retry-After (admission control).")
    api_key: SecretStr | None = Field(default=None, description="When set, every route but /health needs "
                                                                 "'Authorization: Bearer <key>' (else 401). "
                                                                 "`raysd serve` reads --api-key / RAYSD_API_KEY.")
    placement: Placement = Placement()


class ServerConfig(_Strict):
    """Everything ``raysd serve`` deploys."""

    host: str = Field(default="127.0.0.1", description="HTTP bind address (loopback by default).")
    port: int = Field(default=8000, gt=0, lt=65536)
    router: RouterConfig = RouterConfig()
    draft: DraftWorkerConfig | None = DraftWorkerConfig()
    target: TargetWorkerConfig = TargetWorkerConfig()

    @classmethod
    def from_file(cls, path: Path) -> ServerConfig:
        """Load YAML or JSON; a bad field fails here with its path in the message.

        Two layouts are accepted: a plain ``ServerConfig`` mapping, or a Ray Serve config file (what
        ``serve run`` / ``serve deploy`` / KubeRay's ``serveConfigV2`` take) whose first application is built
        by ``raysd.serve.app:app_builder``: its ``args`` are the ``ServerConfig`` and ``http_options`` give the
        host and port.
        """
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of ServerConfig fields or a Serve config file")
        if "applications" in data:
            return cls.from_serve_config(data)
        return cls.model_validate(data)

    @classmethod
    def from_serve_config(cls, data: dict) -> ServerConfig:
        """The ``ServerConfig`` inside a Serve config file (see ``from_file``)."""
        apps = [app for app in data.get("applications") or [] if str(app.get("import_path", "")).startswith("raysd.")]
        if len(apps) != 1:
            raise ValueError("the Serve config must hold exactly one application with import_path "
                             "raysd.serve.app:app_builder")
        http = data.get("http_options") or {}
        fields = {**(apps[0].get("args") or {})}
        for key in ("host", "port"):
            if key in http:
                fields.setdefault(key, http[key])
        return cls.model_validate(fields)
