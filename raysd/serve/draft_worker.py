"""Draft worker: hosts a drafter and its per-sequence KV caches (placeable on cheaper accelerators).

One remote call per round: ``propose`` first applies what the target accepted last round (``observed``),
then drafts. A restarted worker has empty caches and re-prefills sequences lazily, so losing one costs
speed, never correctness.
"""

from __future__ import annotations

import logging

import torch

from raysd.drafting import DraftProposal, ModelDrafter, NgramDrafter
from raysd.models import load_causal_lm
from raysd.sequence import Sequence
from raysd.serve.config import DraftWorkerConfig

logger = logging.getLogger(__name__)


class DraftWorker:
    def __init__(self, config: DraftWorkerConfig, vocab_size: int):
        torch.set_num_threads(config.threads)
        self.config = config
        if config.drafter.kind.value == "ngram":
            self.drafter = NgramDrafter(config.drafter, vocab_size)
        else:
            model = load_causal_lm(config.model_dir)
            self.drafter = ModelDrafter(model, config.max_num_seqs, config.max_model_len, config.k_max)

    def propose(self, sequences: list[Sequence], ks: list[int],
                observed: tuple[list[str], list[int]] | None = None) -> DraftProposal:
        if observed is not None:
            self.drafter.observe(*observed)
        return self.drafter.propose(sequences, ks)

    def observe(self, seq_ids: list[str], num_accepted: list[int]) -> None:
        self.drafter.observe(seq_ids, num_accepted)

    def release(self, seq_ids: list[str]) -> None:
        self.drafter.release(seq_ids)

    def check_health(self) -> None:
        return None
