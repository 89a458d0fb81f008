"""Draft worker (Serve deployment): a light replica leading one ``DraftActor`` that holds the drafter.

The actor runs inside the replica's placement group (its bundle carries the draft device, e.g. an L4 GPU
or the local ``draft_device`` resource) and is called directly by routers, one call per round: ``propose``
first applies what the target accepted last round (``observed``), then drafts. A restarted worker has
empty caches and re-prefills sequences lazily, so losing one costs speed, never correctness.
"""

from __future__ import annotations

import logging
import os
import uuid

import ray
import torch

from raysd.drafting import DraftProposal, ModelDrafter, NgramDrafter
from raysd.models import load_causal_lm
from raysd.sequence import Sequence, origin_of
from raysd.serve.cluster import WorkerInfo, replica_tag
from raysd.serve.config import DraftWorkerConfig
from raysd.serve.placement import actor_options
from raysd.telemetry import remote_span

logger = logging.getLogger("raysd.draft_worker")


@ray.remote(concurrency_groups={"health": 1})
class DraftActor:
    def __init__(self, config: DraftWorkerConfig, vocab_size: int):
        torch.set_num_threads(config.threads)
        if config.drafter.kind.value == "ngram":
            self.drafter = NgramDrafter(config.drafter, vocab_size)
        else:
            model = load_causal_lm(config.model_dir)
            self.drafter = ModelDrafter(model, config.max_num_seqs, config.max_model_len, config.k_max)

    def propose(self, sequences: list[Sequence], ks: list[int],
                observed: tuple[list[str], list[int]] | None = None,
                trace_carrier: dict[str, str] | None = None, orphan_origins: list[str] | None = None) -> DraftProposal:
        """Apply last round's acceptance (``observed``), then draft ``ks[i]`` tokens for ``sequences[i]``.
        ``trace_carrier``: the round's span context; the draft work is recorded as its child span.
        ``orphan_origins``: tags of routers gone for good; their sequences' caches are freed first."""
        table = getattr(self.drafter, "table", None)
        if orphan_origins and table is not None:
            origins = set(orphan_origins)
            self.drafter.release([s for s in list(table.row_of) if origin_of(s) in origins])
        attributes = {"raysd.draft.rows": len(sequences), "raysd.draft.max_k": max(ks, default=0),
                      "raysd.draft.tokens": sum(ks), "raysd.worker.pid": os.getpid()}
        with remote_span("raysd.draft", trace_carrier, attributes):
            if observed is not None:
                self.drafter.observe(*observed)
            return self.drafter.propose(sequences, ks)

    def release(self, seq_ids: list[str]) -> None:
        self.drafter.release(seq_ids)

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return os.getpid()


class DraftWorker:
    def __init__(self, config: DraftWorkerConfig, vocab_size: int, monitor_handle=None):
        self.config = config
        self.monitor = monitor_handle
        self.worker_id = f"draft-{replica_tag()}-{uuid.uuid4().hex[:6]}"
        self.actor = DraftActor.options(**actor_options(config.placement, 0)).remote(config, vocab_size)
        ray.get(self.actor.ping.remote())

    async def check_health(self) -> None:
        await self.actor.ping.remote()
        if self.monitor is not None:
            await self.monitor.heartbeat.remote(WorkerInfo("draft", self.worker_id, [self.actor],
                                                           self.config.max_num_seqs))
