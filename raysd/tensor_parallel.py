"""DeepSpeed AutoTP sharding of a transformers model across the ranks of one process group.

Each rank is its own process (a Ray actor). ``join_group`` must run on every rank at the same time (the
rendezvous blocks until all have arrived); then ``shard`` replaces the model's linear layers with
DeepSpeed's tensor-parallel ones. Every rank runs the same forward on the same inputs and ends with the
same full logits (AutoTP all-reduces the row-parallel outputs and gathers the vocabulary head).

On CPU the group uses gloo. DeepSpeed's optional shared-memory all-reduce compiles a C++ op on first use
(~80 s here); it is off unless ``shm_allreduce`` is set, so a fresh machine starts without a compiler.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta


def free_port() -> int:
    """A TCP port free on this host right now (for the group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def join_group(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 120.0,
               shm_allreduce: bool = False) -> str:
    """Join the ``world_size``-rank process group as ``rank``; returns the backend used (gloo / nccl).

    Sets the variables DeepSpeed reads (RANK, WORLD_SIZE, LOCAL_SIZE, MASTER_*); without LOCAL_SIZE the
    CPU accelerator's shared-memory all-reduce crashes.
    """
    import torch

    on_gpu = torch.cuda.is_available()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    # Ray gives each GPU rank exactly one visible device, so its local index is 0.
    os.environ["LOCAL_RANK"] = "0" if on_gpu else str(rank)
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    if not shm_allreduce:
        from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False  # plain gloo all-reduce
    backend = "nccl" if on_gpu else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s),
                               auto_mpi_discovery=False)
    return backend


def shard(model, tp_size: int):
    """Shard ``model`` across the group with AutoTP; returns the sharded transformers module.

    The returned module keeps the transformers forward signature. AutoTP leaves ``config`` untouched
    (e.g. ``num_key_value_heads`` still names the full count): size caches from the weights
    (``RaggedKVCache.for_model`` does).
    """
    import deepspeed
    import torch

    dtype = next(model.parameters()).dtype
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": tp_size}, dtype=dtype,
                                      replace_with_kernel_inject=False)
    module = engine.module
    if torch.cuda.is_available():
        module = module.to("cuda")
    return module.eval()
