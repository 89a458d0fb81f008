"""Triton kernels for speculative verification, beside their torch reference (``raysd.sampling``).

- ``greedy_verify``: per row, argmax of the target logits at each slot, the accepted prefix length and
  the bonus token: the same result as ``greedy_accept(draft, logits.argmax(-1), num_draft)``.
- ``rejection_verify``: per row, the accept/reject walk and the inverse-CDF draw of the bonus or
  recovered token: the same result as ``rejection_sample`` given the same uniforms.

One program per row; the vocabulary is walked in blocks of ``BLOCK_V``. On CPU these run under
``TRITON_INTERPRET=1`` (how the tests validate them); on CUDA they run compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_verify_kernel(logits_ptr, draft_ptr, num_draft_ptr, accepted_ptr, bonus_ptr,
                          max_k, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    num_draft = tl.load(num_draft_ptr + row)
    accepted = 0
    still_accepting = 1
    bonus = 0
    for slot in range(0, max_k + 1):
        best_value = -float("inf")
        best_index = 0
        base = logits_ptr + (row * (max_k + 1) + slot) * vocab
        for start in range(0, vocab, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            values = tl.load(base + offsets, mask=offsets < vocab, other=-float("inf"))
            block_max = tl.max(values, axis=0)
            block_index = tl.min(tl.where(values == block_max, offsets, vocab), axis=0)
            better = block_max > best_value
            best_index = tl.where(better, block_index, best_index)
            best_value = tl.where(better, block_max, best_value)
        if still_accepting == 1:
            bonus = best_index
            if slot < num_draft:
                drafted = tl.load(draft_ptr + row * max_k + slot)
                if drafted == best_index:
                    accepted += 1
                else:
                    still_accepting = 0
            else:
                still_accepting = 0
    tl.store(accepted_ptr + row, accepted)
    tl.store(bonus_ptr + row, bonus)


@triton.jit
def _rejection_verify_kernel(draft_ptr, draft_probs_ptr, target_probs_ptr, num_draft_ptr, uniform_ptr,
                             recovery_ptr, accepted_ptr, bonus_ptr, max_k, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    num_draft = tl.load(num_draft_ptr + row)
    accepted = 0
    still_accepting = 1
    for slot in range(0, max_k):
        if still_accepting == 1:
            if slot < num_draft:
                drafted = tl.load(draft_ptr + row * max_k + slot)
                draft_prob = tl.load(draft_probs_ptr + (row * max_k + slot) * vocab + drafted)
                target_prob = tl.load(target_probs_ptr + (row * (max_k + 1) + slot) * vocab + drafted)
                u = tl.load(uniform_ptr + row * max_k + slot)
                if u * draft_prob < target_prob:
                    accepted += 1
                else:
                    still_accepting = 0
            else:
                still_accepting = 0
    rejected = accepted < num_draft
    target_base = target_probs_ptr + (row * (max_k + 1) + accepted) * vocab
    draft_slot = tl.minimum(accepted, tl.maximum(max_k - 1, 0))
    draft_base = draft_probs_ptr + (row * max_k + draft_slot) * vocab
    use_draft = tl.where(rejected & (max_k > 0), 1.0, 0.0)  # multiplies the draft probs: 0 = ignore them
    # pass 1: mass of the residual max(0, target − draft) (equal to the target's when nothing was rejected)
    residual_mass = 0.0
    target_mass = 0.0
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        inside = offsets < vocab
        target = tl.load(target_base + offsets, mask=inside, other=0.0)
        draft = tl.load(draft_base + offsets, mask=inside, other=0.0) * use_draft
        residual_mass += tl.sum(tl.maximum(target - draft, 0.0), axis=0)
        target_mass += tl.sum(target, axis=0)
    # float round-off can leave no residual after a rejection: then fall back to the target itself
    use_residual = tl.where(residual_mass > 0, use_draft, 0.0)
    total = tl.where(residual_mass > 0, residual_mass, target_mass)
    threshold = tl.load(recovery_ptr + row) * total
    # pass 2: first index whose running CDF exceeds u · total
    running = 0.0
    chosen = vocab - 1
    found = 0
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        inside = offsets < vocab
        target = tl.load(target_base + offsets, mask=inside, other=0.0)
        draft = tl.load(draft_base + offsets, mask=inside, other=0.0) * use_residual
        cdf = running + tl.cumsum(tl.maximum(target - draft, 0.0), axis=0)
        candidate = tl.min(tl.where((cdf > threshold) & inside, offsets, vocab), axis=0)
        take = (found == 0) & (candidate < vocab)
        chosen = tl.where(take, candidate, chosen)
        found = tl.where(take, 1, found)
        running = running + tl.sum(tl.maximum(target - draft, 0.0), axis=0)
    tl.store(accepted_ptr + row, accepted)
    tl.store(bonus_ptr + row, chosen)


def greedy_verify(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor,
                  block_v: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_logits`` [num_seqs, max_k + 1, vocab], ``draft_token_ids`` [num_seqs, max_k],
    ``num_draft`` [num_seqs] → ``(num_accepted, bonus_token_ids)``, each [num_seqs] long."""
    num_seqs, slots, vocab = target_logits.shape
    logits = target_logits.float().contiguous()
    draft = draft_token_ids.to(torch.int64).contiguous()
    accepted = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
    bonus = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
    _greedy_verify_kernel[(num_seqs,)](logits, draft, num_draft.to(torch.int64).contiguous(), accepted, bonus,
                                       slots - 1, vocab, BLOCK_V=block_v)
    return accepted, bonus


def rejection_verify(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     num_draft: torch.Tensor, uniform_samples: torch.Tensor, recovery_samples: torch.Tensor,
                     block_v: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and shapes as ``raysd.sampling.rejection_sample``."""
    num_seqs, max_k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    if max_k == 0:  # nothing drafted: a valid (never read) draft buffer keeps the pointer arithmetic simple
        draft_probs = torch.zeros(num_seqs, 1, vocab, device=target_probs.device)
    accepted = torch.empty(num_seqs, dtype=torch.int64, device=target_probs.device)
    bonus = torch.empty(num_seqs, dtype=torch.int64, device=target_probs.device)
    _rejection_verify_kernel[(num_seqs,)](
        draft_token_ids.to(torch.int64).contiguous(), draft_probs.float().contiguous(),
        target_probs.float().contiguous(), num_draft.to(torch.int64).contiguous(),
        uniform_samples.float().contiguous() if max_k else torch.zeros(num_seqs, 1, device=target_probs.device),
        recovery_samples.float().contiguous(), accepted, bonus, max_k, vocab, BLOCK_V=block_v)
    return accepted, bonus
