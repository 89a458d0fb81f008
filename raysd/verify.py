"""Target-side verification: one batched forward over each sequence's last token + its drafts.

The target's ragged KV cache holds every token of a sequence but the last (``len(token_ids) - 1``); a
round feeds ``[last token, d_1 … d_k]`` per row (ragged k, padded to ``max_k + 1``), compares or
rejection-samples, and advances the row by ``accepted + 1``: rejected slots are dropped by length
bookkeeping alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from raysd import kernels
from raysd.drafting import DraftProposal, sampling_tensors
from raysd.kv_cache import RaggedKVCache, RowTable, prefill_row, ragged_forward
from raysd.sampling import processed_probs
from raysd.sequence import Sequence


@dataclass
class VerifyResult:
    num_accepted: list[int]
    bonus_token_ids: list[int]
    failed: list[bool]  # the target produced non-finite logits for this row
    seconds: float
    prefill_seconds: float
    batch_tokens: int  # tokens in the verify forward (rows × (max_k + 1))


def merge_results(num_seqs: int, parts: list[tuple[list[int], VerifyResult]]) -> VerifyResult:
    """One result for a batch of ``num_seqs`` from per-target-group ``(rows, result)`` parts.

    Rows no part covers are marked failed with nothing accepted. The groups ran concurrently: time is
    the slowest group's, verified tokens add up.
    """
    accepted, bonus, failed = [0] * num_seqs, [0] * num_seqs, [True] * num_seqs
    seconds = prefill_seconds = 0.0
    batch_tokens = 0
    for rows, part in parts:
        for position, row in enumerate(rows):
            accepted[row], bonus[row] = part.num_accepted[position], part.bonus_token_ids[position]
            failed[row] = part.failed[position]
        seconds, prefill_seconds = max(seconds, part.seconds), max(prefill_seconds, part.prefill_seconds)
        batch_tokens += part.batch_tokens
    return VerifyResult(accepted, bonus, failed, seconds, prefill_seconds, batch_tokens)


class TargetVerifier:
    """Holds the target model and its per-sequence cache; verifies proposals for a batch."""

    def __init__(self, model, max_num_seqs: int, max_model_len: int, max_k: int = 16):
        self.model = model
        self.cache = RaggedKVCache.for_model(model, max_num_seqs, max_model_len + max_k + 2)
        self.table = RowTable(self.cache)

    def prefill(self, sequence: Sequence) -> None:
        """Admit a sequence: run all of its tokens but the last through the target."""
        prefill_row(self.model, self.table, sequence.seq_id, sequence.token_ids[:-1])

    def logits_for(self, sequences: list[Sequence], proposal: DraftProposal) -> torch.Tensor:
        """Target logits ``[num_seqs, max_k + 1, vocab]`` at each row's last token and its drafts."""
        max_k = proposal.token_ids.shape[1]
        num_rows = len(self.table)
        request_rows = self.table.rows_for([s.seq_id for s in sequences])
        inputs = torch.zeros(num_rows, max_k + 1, dtype=torch.long)
        inputs[request_rows, 0] = torch.tensor([s.token_ids[-1] for s in sequences])
        inputs[request_rows, 1:] = proposal.token_ids
        lengths = self.cache.lengths[:num_rows]
        positions = (lengths[:, None] + torch.arange(max_k + 1)[None, :]).clamp(max=self.cache.max_len - 1)
        logits = ragged_forward(self.model, self.cache, slice(0, num_rows), inputs, positions)
        return logits[request_rows]

    def verify(self, sequences: list[Sequence], proposal: DraftProposal) -> VerifyResult:
        started = time.perf_counter()
        for sequence in sequences:
            if sequence.seq_id not in self.table:
                self.prefill(sequence)
        prefill_seconds = time.perf_counter() - started
        logits = self.logits_for(sequences, proposal)  # [num_seqs, max_k + 1, vocab]
        failed = ~torch.isfinite(logits).all(dim=2).all(dim=1)
        for index in failed.nonzero().flatten().tolist():  # that request fails; its row must not poison the next
            self.cache.clear_row(self.table.row_of[sequences[index].seq_id])
        logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=0.0)
        num_accepted, bonus = kernels.greedy_accept_logits(logits, proposal.token_ids, proposal.num_draft)
        sampled = [i for i, s in enumerate(sequences) if not s.params.greedy]
        if sampled:
            index = torch.tensor(sampled)
            subset = [sequences[i] for i in sampled]
            temperature, top_k, top_p = sampling_tensors(subset)
            target_probs = processed_probs(logits[index], temperature, top_k, top_p)
            max_k = proposal.token_ids.shape[1]
            # each sequence draws num_draft + 1 uniforms of its own: its stream does not depend on the batch
            uniform = torch.zeros(len(sampled), max_k + 1)
            recovery = torch.zeros(len(sampled))
            for row, (sequence, drafted) in enumerate(zip(subset, proposal.num_draft[index].tolist())):
                draws = torch.rand(drafted + 1, generator=sequence.round_generator("verify"))
                uniform[row, :drafted], recovery[row] = draws[:drafted], draws[drafted]
            draft_probs = proposal.draft_probs[index] if proposal.draft_probs is not None else \
                torch.zeros(len(sampled), max_k, logits.shape[-1])
            sampled_accepted, sampled_bonus = kernels.rejection_sample(
                proposal.token_ids[index], draft_probs, target_probs, proposal.num_draft[index],
                uniform[:, :max_k], recovery)
            num_accepted[index], bonus[index] = sampled_accepted, sampled_bonus
        for sequence, accepted in zip(sequences, num_accepted.tolist()):
            row = self.table.row_of[sequence.seq_id]
            self.cache.lengths[row] += accepted + 1
        return VerifyResult(num_accepted.tolist(), bonus.tolist(), failed.tolist(),
                            time.perf_counter() - started - prefill_seconds, prefill_seconds,
                            len(self.table) * (proposal.token_ids.shape[1] + 1))

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            if seq_id in self.table:
                self.table.remove(seq_id)
