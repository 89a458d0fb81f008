import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU (see tests/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(int(os.environ.get("RAYSD_TEST_THREADS", "2")))

from raysd.models import DEMO_DRAFT, DEMO_TARGET  # noqa: E402


@pytest.fixture(scope="session")
def demo_pair():
    from raysd.models import ModelPair

    return ModelPair(DEMO_TARGET, DEMO_DRAFT)


@pytest.fixture(scope="session")
def tiny_pair():
    from tiny_models import perturbed_copy, tiny_llama

    target = tiny_llama(0)
    return target, perturbed_copy(target, seed=1, scale=0.05)


SERVE_PORT = 8123


@pytest.fixture(scope="session")
def serve_url():
    """One real local Ray + Serve app on the demo pair for the whole session (Ray starts once)."""
    import ray
    from ray import serve

    from raysd.serve.app import start_local
    from raysd.serve.config import ServerConfig

    config = ServerConfig.model_validate({
        "port": SERVE_PORT,
        "target": {"model_dir": str(DEMO_TARGET), "max_model_len": 512},
        "draft": {"model_dir": str(DEMO_DRAFT), "max_model_len": 512},
        "router": {"engine": {"max_model_len": 512, "max_num_seqs": 16},
                   "policy": {"mode": "adaptive", "warmup_rounds": 2, "pressure_high": 40, "pressure_low": 20},
                   "draft_timeout_s": 5.0, "draft_retry_s": 1.0},
    })
    url = start_local(config, num_cpus=2)
    yield url
    serve.shutdown()
    ray.shutdown()


@contextlib.contextmanager
def extra_app(serve_url: str, name: str, config: dict, telemetry_env: dict | None = None):
    """Deploy another raysd app (``config``: ServerConfig fields) on the session's Ray at ``/<name>``;
    yields its base URL and deletes it afterwards."""
    from ray import serve

    from raysd.serve.app import build_app
    from raysd.serve.config import ServerConfig

    serve.run(build_app(ServerConfig.model_validate(config), telemetry_env=telemetry_env), name=f"raysd-{name}",
              route_prefix=f"/{name}")
    try:
        yield f"{serve_url}/{name}"
    finally:
        serve.delete(f"raysd-{name}")


def small_target_app(max_model_len: int = 512, max_num_seqs: int = 2, **router) -> dict:
    """Target alone (no draft, speculation off): quick to start, for tests about the HTTP surface."""
    return {"draft": None,
            "target": {"model_dir": str(DEMO_TARGET), "max_model_len": max_model_len, "max_num_seqs": 8,
                       "placement": {"resources": {"target_device": 1}}},
            "router": {"engine": {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs},
                       "policy": {"mode": "off"}, **router}}
