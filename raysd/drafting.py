"""Drafters: what proposes tokens for the target to verify.

A drafter has three methods:
- ``propose(sequences, ks)`` → ``DraftProposal`` with up to ``ks[i]`` tokens for ``sequences[i]``;
- ``observe(seq_ids, num_accepted)`` → how many of the last proposal the target kept (cache roll-back);
- ``release(seq_ids)`` → forget finished or aborted sequences.

``ModelDrafter`` runs a small LM with its own ragged KV cache; ``NgramDrafter`` (prompt lookup) copies
the continuation of the latest earlier occurrence of the sequence's last n tokens. For sampled requests a
drafter also returns the probabilities it drew from, which rejection sampling needs (one-hot for n-gram).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from raysd.config import DrafterConfig
from raysd.kv_cache import RaggedKVCache, RowTable, prefill_row, ragged_forward
from raysd.sampling import processed_probs
from raysd.sequence import Sequence


@dataclass
class DraftProposal:
    """Draft tokens for a batch, row i for ``sequences[i]`` of the ``propose`` call."""

    token_ids: torch.Tensor  # [num_seqs, max_k] long, trailing slots past num_draft are 0
    num_draft: torch.Tensor  # [num_seqs] long, ≤ the k asked for
    draft_probs: torch.Tensor | None  # [num_seqs, max_k, vocab] for sampled rows (greedy rows: unused)
    seconds: float = 0.0
    forward_steps: int = 0
    # part of ``seconds`` that is not per-step drafting (prefilling new sequences, catching up on tokens
    # emitted while the sequence was not drafted) and the catch-up forward steps it took
    catchup_seconds: float = 0.0
    catchup_steps: int = 0


class Drafter(Protocol):
    def propose(self, sequences: list[Sequence], ks: list[int]) -> DraftProposal: ...

    def observe(self, seq_ids: list[str], num_accepted: list[int]) -> None: ...

    def release(self, seq_ids: list[str]) -> None: ...


def sampling_tensors(sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature (1.0 for greedy rows, unused there), top_k and top_p tensors."""
    temperature = torch.tensor([s.params.temperature if not s.params.greedy else 1.0 for s in sequences])
    top_k = torch.tensor([s.params.top_k for s in sequences], dtype=torch.long)
    top_p = torch.tensor([s.params.top_p for s in sequences])
    return temperature, top_k, top_p


def select_rows(proposal: DraftProposal, rows: list[int]) -> DraftProposal:
    """The proposal for ``rows`` of the batch only, trimmed to the longest draft among them."""
    index = torch.tensor(rows, dtype=torch.long)
    num_draft = proposal.num_draft[index]
    width = int(num_draft.max()) if len(rows) else 0
    probs = proposal.draft_probs[index, :width] if proposal.draft_probs is not None else None
    return DraftProposal(proposal.token_ids[index, :width], num_draft, probs, proposal.seconds,
                         proposal.forward_steps, catchup_seconds=proposal.catchup_seconds,
                         catchup_steps=proposal.catchup_steps)


def merge_proposals(num_seqs: int, parts: list[tuple[list[int], DraftProposal]]) -> DraftProposal:
    """One proposal for a batch of ``num_seqs`` from per-worker ``(rows, proposal)`` parts.

    Rows no part covers get no drafts. Widths are padded to the longest part; ``draft_probs`` exists when
    any part has it (zeros elsewhere, which rejection sampling never reads for undrafted slots). Timing is
    the slowest part's (the parts ran concurrently).
    """
    width = max((p.token_ids.shape[1] for _, p in parts), default=0)
    token_ids = torch.zeros(num_seqs, width, dtype=torch.long)
    num_draft = torch.zeros(num_seqs, dtype=torch.long)
    vocab = next((p.draft_probs.shape[2] for _, p in parts if p.draft_probs is not None), None)
    draft_probs = torch.zeros(num_seqs, width, vocab) if vocab is not None else None
    for rows, part in parts:
        index = torch.tensor(rows, dtype=torch.long)
        part_width = part.token_ids.shape[1]
        token_ids[index, :part_width] = part.token_ids
        num_draft[index] = part.num_draft
        if part.draft_probs is not None:
            draft_probs[index, :part_width] = part.draft_probs
    slowest = max(parts, key=lambda item: item[1].seconds, default=(None, empty_proposal(0)))[1]
    return DraftProposal(token_ids, num_draft, draft_probs, slowest.seconds, slowest.forward_steps,
                         catchup_seconds=slowest.catchup_seconds, catchup_steps=slowest.catchup_steps)


def empty_proposal(num_seqs: int) -> DraftProposal:
    """No drafts for any row (a round of plain decoding)."""
    return DraftProposal(torch.zeros(num_seqs, 0, dtype=torch.long), torch.zeros(num_seqs, dtype=torch.long),
                         None)


class ModelDrafter:
    """A small causal LM proposing ``k`` tokens per sequence with ``k`` batched forwards.

    Its cache holds a prefix of each sequence; tokens the target emitted since are fed first
    ("catch-up"), then one token per step. ``observe`` keeps only the drafts the target accepted.
    """

    def __init__(self, model, max_num_seqs: int, max_model_len: int, max_k: int = 16):
        self.model = model
        self.cache = RaggedKVCache.for_model(model, max_num_seqs, max_model_len + max_k + 2)
        self.table = RowTable(self.cache)
        self._last_k: dict[str, tuple[int, int]] = {}  # seq_id → (tokens before drafts, k proposed)

    def _prefill(self, sequence: Sequence) -> None:
        prefill_row(self.model, self.table, sequence.seq_id, sequence.token_ids[:-1])

    def _positions(self, start: torch.Tensor, width: int) -> torch.Tensor:
        return (start[:, None] + torch.arange(width)[None, :]).clamp(max=self.cache.max_len - 1)

    def propose(self, sequences: list[Sequence], ks: list[int]) -> DraftProposal:
        started = time.perf_counter()
        max_k = max(ks, default=0)
        if max_k == 0:
            return empty_proposal(len(sequences))
        for sequence in sequences:
            if sequence.seq_id not in self.table:
                self._prefill(sequence)
            elif sequence.seq_id in self._last_k:  # last proposal never observed (lost reply): keep only
                base, _ = self._last_k.pop(sequence.seq_id)  # the verified prefix
                row = self.table.row_of[sequence.seq_id]
                self.cache.lengths[row] = min(int(self.cache.lengths[row]), base)
        num_rows = len(self.table)
        rows = slice(0, num_rows)
        request_rows = self.table.rows_for([s.seq_id for s in sequences])  # [num_seqs]
        catchup_steps = self._catch_up(sequences, request_rows.tolist(), rows)
        first_started = time.perf_counter()
        lengths = self.cache.lengths[:num_rows].clone()
        pending = [s.token_ids[int(lengths[row]):] for s, row in zip(sequences, request_rows.tolist())]
        inputs, last_index = self._ragged_inputs(pending, request_rows.tolist(), num_rows)
        logits = ragged_forward(self.model, self.cache, rows, inputs, self._positions(lengths, inputs.shape[1]))
        # prefilling new sequences and catching up are not per-step drafting, and the cost model learns the
        # round without them: a steady state never catches up, and a new sequence's draft prefill is paid once
        # per request (charged to one round, it made every k = 0 probe of a fresh row look as dear as 3× a
        # plain round at batch 1)
        catchup = first_started - started
        next_logits = logits[torch.arange(num_rows), last_index][request_rows]  # [num_seqs, vocab]
        position = lengths + last_index + 1  # [num_rows]: where the next fed token goes

        greedy = [s.params.greedy for s in sequences]
        any_sampled = not all(greedy)
        temperature, top_k, top_p = sampling_tensors(sequences)
        token_ids = torch.zeros(len(sequences), max_k, dtype=torch.long)
        draft_probs = torch.zeros(len(sequences), max_k, logits.shape[-1]) if any_sampled else None
        generators = {i: s.round_generator("draft") for i, s in enumerate(sequences) if not greedy[i]}
        for step in range(max_k):
            chosen = next_logits.argmax(dim=-1)
            if any_sampled:
                probs = processed_probs(next_logits[:, None], temperature, top_k, top_p)[:, 0]
                draft_probs[:, step] = probs
                for i in generators:
                    if step < ks[i]:  # draw exactly k per sequence: batch-independent
                        chosen[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
            token_ids[:, step] = chosen
            if step + 1 == max_k:
                break
            step_inputs = torch.zeros(num_rows, 1, dtype=torch.long)
            step_inputs[request_rows, 0] = chosen
            logits = ragged_forward(self.model, self.cache, rows, step_inputs, self._positions(position, 1))
            next_logits = logits[request_rows, 0]
            position = position + 1

        for sequence, k, row in zip(sequences, ks, request_rows.tolist()):
            self._last_k[sequence.seq_id] = (len(sequence.token_ids), k)
            self.cache.lengths[row] = len(sequence.token_ids) + max(k - 1, 0)
        num_draft = torch.tensor(ks, dtype=torch.long)
        token_ids = token_ids * (torch.arange(max_k)[None, :] < num_draft[:, None])
        return DraftProposal(token_ids, num_draft, draft_probs, time.perf_counter() - started, max_k,
                             catchup_seconds=catchup, catchup_steps=catchup_steps)

    @staticmethod
    def _ragged_inputs(pending: list[list[int]], request_rows: list[int], num_rows: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pending[i]`` laid out on cache row ``request_rows[i]``: inputs ``[num_rows, longest]`` (zeros
        elsewhere) and each row's last real column ``[num_rows]``."""
        width = max(len(tokens) for tokens in pending)
        inputs = torch.zeros(num_rows, width, dtype=torch.long)
        last_index = torch.zeros(num_rows, dtype=torch.long)
        for tokens, row in zip(pending, request_rows):
            inputs[row, : len(tokens)] = torch.tensor(tokens)
            last_index[row] = len(tokens) - 1
        return inputs, last_index

    def _catch_up(self, sequences: list[Sequence], request_rows: list[int], rows: slice) -> int:
        """Feed every token but the last that the target emitted while these sequences were not drafted, in
        one forward, so the round's first draft step is as narrow as a steady state's (≤ 2 tokens a row).
        Returns the forward steps spent (0 when nothing was behind)."""
        lengths = self.cache.lengths[:rows.stop].clone()
        behind = [s.token_ids[int(lengths[row]):-1] for s, row in zip(sequences, request_rows)]
        if max(len(tokens) for tokens in behind) < 2:
            return 0
        inputs, _ = self._ragged_inputs([tokens or [0] for tokens in behind], request_rows, rows.stop)
        ragged_forward(self.model, self.cache, rows, inputs, self._positions(lengths, inputs.shape[1]))
        for tokens, row in zip(behind, request_rows):
            self.cache.lengths[row] = int(lengths[row]) + len(tokens)
        return 1

    def observe(self, seq_ids: list[str], num_accepted: list[int]) -> None:
        for seq_id, accepted in zip(seq_ids, num_accepted):
            base, k = self._last_k.pop(seq_id, (None, 0))
            if base is not None and seq_id in self.table:
                self.cache.lengths[self.table.row_of[seq_id]] = base + min(accepted, max(k - 1, 0))

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._last_k.pop(seq_id, None)
            if seq_id in self.table:
                self.table.remove(seq_id)


class NgramDrafter:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

    Tries n from ``ngram_max`` down to ``ngram_min``; proposes fewer than k tokens (or none) when the
    match is near the end or absent. Stateless between rounds; no second model.
    """

    def __init__(self, config: DrafterConfig, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The continuation (≤ k tokens) of the latest earlier match of the longest matching suffix."""
        length = len(token_ids)
        for n in range(min(self.config.ngram_max, length - 1), self.config.ngram_min - 1, -1):
            suffix = token_ids[length - n:]
            for start in range(length - n - 1, -1, -1):
                if token_ids[start:start + n] == suffix:
                    return token_ids[start + n: start + n + k]
        return []

    def propose(self, sequences: list[Sequence], ks: list[int]) -> DraftProposal:
        started = time.perf_counter()
        max_k = max(ks, default=0)
        if max_k == 0:
            return empty_proposal(len(sequences))
        token_ids = torch.zeros(len(sequences), max_k, dtype=torch.long)
        num_draft = torch.zeros(len(sequences), dtype=torch.long)
        for i, (sequence, k) in enumerate(zip(sequences, ks)):
            proposal = self.lookup(sequence.token_ids, k) if k > 0 else []
            token_ids[i, : len(proposal)] = torch.tensor(proposal, dtype=torch.long)
            num_draft[i] = len(proposal)
        draft_probs = None
        if not all(s.params.greedy for s in sequences):
            draft_probs = torch.zeros(len(sequences), max_k, self.vocab_size)
            draft_probs.scatter_(2, token_ids[:, :, None], 1.0)  # deterministic proposal: one-hot
        return DraftProposal(token_ids, num_draft, draft_probs, time.perf_counter() - started, 0)

    def observe(self, seq_ids: list[str], num_accepted: list[int]) -> None:
        return None

    def release(self, seq_ids: list[str]) -> None:
        return None
