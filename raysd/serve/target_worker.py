"""Target worker: the target model (tensor-parallel ranks when tp_size > 1) and per-sequence KV caches.

``verify`` admits unknown sequences (prefill) and verifies a round's drafts in one forward.
"""

from __future__ import annotations

import torch

from raysd.drafting import DraftProposal
from raysd.models import load_causal_lm
from raysd.sequence import Sequence
from raysd.serve.config import TargetWorkerConfig
from raysd.verify import TargetVerifier, VerifyResult


class TargetWorker:
    def __init__(self, config: TargetWorkerConfig):
        torch.set_num_threads(config.threads)
        self.config = config
        if config.tp_size != 1:
            raise NotImplementedError("tensor parallelism (tp_size > 1) is not implemented yet; use tp_size: 1")
        model = load_causal_lm(config.model_dir)
        self.verifier = TargetVerifier(model, config.max_num_seqs, config.max_model_len, config.k_max)

    def verify(self, sequences: list[Sequence], proposal: DraftProposal) -> VerifyResult:
        return self.verifier.verify(sequences, proposal)

    def release(self, seq_ids: list[str]) -> None:
        self.verifier.release(seq_ids)

    def load(self) -> dict:
        """Sequences held and rows per verify step (what the pressure monitor aggregates)."""
        return {"sequences": len(self.verifier.table)}

    def check_health(self) -> None:
        return None
