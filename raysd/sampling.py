"""Pure tensor math of speculative verification: greedy acceptance and rejection sampling.

Imports only torch. Shapes use ``num_seqs`` rows and ``max_k`` draft slots; a row with ``num_draft[b] < max_k``
ignores its trailing slots (their contents are arbitrary). Every function returns per row the number of
accepted draft tokens and the bonus token (the target's own next token after the accepted prefix, or
the recovered token at the first rejection), so each round emits ``accepted + 1`` tokens per row.

This module is the reference implementation for the Triton kernels in ``kernels/``.
"""

from __future__ import annotations

import torch


def _valid_slots(num_draft: torch.Tensor, max_k: int) -> torch.Tensor:
    """``[num_seqs, max_k]`` bool: slot j of row b holds a real draft token."""
    return torch.arange(max_k, device=num_draft.device)[None, :] < num_draft[:, None]


def accepted_prefix_length(accepted_mask: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row: ``[num_seqs, max_k]`` bool → ``[num_seqs]`` long."""
    return accepted_mask.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k]
    target_argmax_ids: torch.Tensor,  # [num_seqs, max_k + 1]
    num_draft: torch.Tensor,  # [num_seqs]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest prefix equal to the target's argmax; bonus = next argmax.

    Returns ``(num_accepted [num_seqs], bonus_token_ids [num_seqs])``.
    """
    max_k = draft_token_ids.shape[1]
    matches = (draft_token_ids == target_argmax_ids[:, :max_k]) & _valid_slots(num_draft, max_k)
    num_accepted = accepted_prefix_length(matches)
    bonus_token_ids = target_argmax_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, bonus_token_ids


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_seqs, max_k]
    draft_probs: torch.Tensor,  # [num_seqs, max_k, vocab]
    target_probs: torch.Tensor,  # [num_seqs, max_k + 1, vocab]
    num_draft: torch.Tensor,  # [num_seqs]
    uniform_samples: torch.Tensor,  # [num_seqs, max_k], U[0, 1)
    recovery_samples: torch.Tensor,  # [num_seqs], U[0, 1): inverse-CDF draw of the bonus/recovered token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft token j of row b is accepted iff ``u < target_prob / draft_prob`` (probability
    ``min(1, target/draft)``) and every earlier one was. At the first rejection the bonus token is drawn
    from ``normalise(max(0, target_probs − draft_probs))`` at that slot; when all ``num_draft`` tokens are
    accepted it is drawn from ``target_probs`` at slot ``num_draft``. The emitted tokens are then
    distributed exactly as the target's own samples. Randomness comes in as arguments, so the function
    is deterministic and testable with exact tables.

    Returns ``(num_accepted [num_seqs], bonus_token_ids [num_seqs])``.
    """
    num_seqs, max_k = draft_token_ids.shape
    drafted_ids = draft_token_ids.clamp(min=0)[:, :, None]
    draft_prob_of_token = draft_probs.gather(2, drafted_ids).squeeze(2)  # [num_seqs, max_k]
    target_prob_of_token = target_probs[:, :max_k].gather(2, drafted_ids).squeeze(2)  # [num_seqs, max_k]
    accepted = uniform_samples * draft_prob_of_token < target_prob_of_token
    num_accepted = accepted_prefix_length(accepted & _valid_slots(num_draft, max_k))

    rows = torch.arange(num_seqs, device=draft_token_ids.device)
    target_at_stop = target_probs[rows, num_accepted]  # [num_seqs, vocab]
    rejected = num_accepted < num_draft  # [num_seqs]
    draft_at_stop = draft_probs[rows, num_accepted.clamp(max=max(max_k - 1, 0))] if max_k else target_at_stop
    residual = (target_at_stop - draft_at_stop).clamp(min=0)
    residual_mass = residual.sum(dim=1, keepdim=True)
    # A rejection implies target < draft somewhere, hence residual mass > 0; guard float round-off anyway.
    use_residual = rejected[:, None] & (residual_mass > 0)
    bonus_dist = torch.where(use_residual, residual / residual_mass.clamp(min=1e-30), target_at_stop)
    bonus_token_ids = sample_inverse_cdf(bonus_dist, recovery_samples)
    return num_accepted, bonus_token_ids


def sample_inverse_cdf(probs: torch.Tensor, uniform_samples: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[num_seqs, vocab]`` (need not be normalised) given U[0,1)
    ``uniform_samples`` ``[num_seqs]``. Returns ``[num_seqs]`` long."""
    cdf = probs.cumsum(dim=1)
    thresholds = uniform_samples[:, None] * cdf[:, -1:]
    token_ids = torch.searchsorted(cdf, thresholds, right=True).squeeze(1)
    return token_ids.clamp(max=probs.shape[1] - 1)


def processed_probs(
    logits: torch.Tensor,  # [num_seqs, positions, vocab]
    temperature: torch.Tensor,  # [num_seqs], > 0
    top_k: torch.Tensor,  # [num_seqs], 0 = off
    top_p: torch.Tensor,  # [num_seqs], 1.0 = off
) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-k tokens and the top-p nucleus, per row.

    Returns ``[num_seqs, positions, vocab]`` probabilities (each position sums to 1). The same function
    must be applied to draft and target logits so both sides sample from the processed distributions.
    """
    scaled = logits.float() / temperature[:, None, None]
    vocab = scaled.shape[-1]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, None, :]
    k_limit = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))[:, None, None]
    in_top_k = ranks < k_limit  # [num_seqs, 1, vocab]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~in_top_k, float("-inf")), dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = in_top_k & (mass_before < top_p[:, None, None])  # [num_seqs, positions, vocab]
    keep[..., 0] = True
    sorted_probs = sorted_probs * keep
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, sorted_ids, sorted_probs)
