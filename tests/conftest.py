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
