"""One tensor-parallel rank of a target group: a shard of the target model and its KV caches.

A plain Ray actor (not a Serve replica) so the router can call it directly — one actor hop per round
instead of a Serve handle hop. Every rank of a group receives the same calls in the same order from the
router (Ray runs a caller's calls to a one-thread actor in order), so the ranks' caches stay identical in
bookkeeping and the collectives inside each forward line up. All ranks compute the same result; the
router reads rank 0's.

``ping`` runs in its own concurrency group, so a health check answers while a long forward runs — and
fails when a rank is gone or stuck in a collective with a dead peer.
"""

from __future__ import annotations

import os

import ray
import torch

from raysd.drafting import DraftProposal
from raysd.models import load_causal_lm
from raysd.sequence import Sequence, origin_of
from raysd.serve.config import TargetWorkerConfig
from raysd.telemetry import remote_span
from raysd.tensor_parallel import free_port, join_group, shard
from raysd.verify import TargetVerifier, VerifyResult


@ray.remote(concurrency_groups={"health": 1})
class TargetRank:
    def __init__(self, config: TargetWorkerConfig, rank: int):
        torch.set_num_threads(config.threads)
        self.config = config
        self.rank = rank
        self.verifier: TargetVerifier | None = None

    def node_address(self) -> tuple[str, int]:
        """Address and a free port for the group's rendezvous (asked of rank 0)."""
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str | None = None, master_port: int | None = None) -> dict:
        """Load the model (and, for tp_size > 1, join the group and take this rank's shard).

        For tp_size > 1 all ranks must be set up concurrently: the rendezvous waits for every rank.
        """
        model = load_causal_lm(self.config.model_dir)
        backend = None
        if self.config.tp_size > 1:
            backend = join_group(self.rank, self.config.tp_size, master_addr, master_port,
                                 self.config.rendezvous_timeout_s, self.config.shm_allreduce)
            model = shard(model, self.config.tp_size)
        self.verifier = TargetVerifier(model, self.config.max_num_seqs, self.config.max_model_len,
                                       self.config.k_max)
        parameters = sum(p.numel() for p in model.parameters())
        return {"rank": self.rank, "backend": backend, "parameters": parameters, "pid": os.getpid(),
                "kv_heads": self.verifier.cache.layers[0].keys.shape[1]}

    def verify(self, sequences: list[Sequence], proposal: DraftProposal,
               trace_carrier: dict[str, str] | None = None, orphan_origins: list[str] | None = None) -> VerifyResult:
        """Verify ``proposal`` for ``sequences`` (rows in order); ``trace_carrier``: the round's span
        context — this rank's verify work is recorded as its child span. ``orphan_origins``: tags of routers
        gone for good; their sequences' cache rows are freed first (inside this call, so every rank of the
        group changes its rows at the same point of the same call sequence)."""
        if orphan_origins:
            origins = set(orphan_origins)
            self.verifier.release([s for s in list(self.verifier.table.row_of) if origin_of(s) in origins])
        attributes = {"raysd.verify.rows": len(sequences), "raysd.verify.max_k": int(proposal.token_ids.shape[1]),
                      "raysd.tp.rank": self.rank, "raysd.tp.size": self.config.tp_size,
                      "raysd.worker.pid": os.getpid()}
        with remote_span("raysd.verify", trace_carrier, attributes) as span:
            result = self.verifier.verify(sequences, proposal)
            if span is not None:
                span.set_attribute("raysd.verify.accepted", sum(result.num_accepted))
                span.set_attribute("raysd.verify.prefill_seconds", result.prefill_seconds)
            return result

    def release(self, seq_ids: list[str]) -> None:
        self.verifier.release(seq_ids)

    @ray.method(concurrency_group="health")
    def num_sequences(self) -> int:
        return len(self.verifier.table) if self.verifier is not None else 0

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return os.getpid()
