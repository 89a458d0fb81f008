"""Verification kernels, importable as ``raysd.kernels`` (the folder is mapped in pyproject.toml so it never
shadows the unrelated PyPI package named ``kernels``).

``greedy_accept_logits`` and ``rejection_sample`` pick the Triton kernel when the tensors live on CUDA and
Triton imports (or when ``TRITON_INTERPRET=1`` is set and ``force_triton`` is asked for), else the torch
reference in ``raysd.sampling``. Results are identical either way.
"""

from __future__ import annotations

import functools
import os

import torch

from raysd import sampling


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(tensor: torch.Tensor, force_triton: bool) -> bool:
    if not triton_available():
        return False
    return tensor.is_cuda or (force_triton and os.environ.get("TRITON_INTERPRET") == "1")


def greedy_accept_logits(target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor,
                         force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification from raw target logits ``[num_seqs, max_k + 1, vocab]``."""
    if _use_triton(target_logits, force_triton):
        from raysd.kernels.spec_verify import greedy_verify

        return greedy_verify(target_logits, draft_token_ids, num_draft)
    return sampling.greedy_accept(draft_token_ids, target_logits.argmax(dim=-1), num_draft)


def rejection_sample(draft_token_ids, draft_probs, target_probs, num_draft, uniform_samples, recovery_samples,
                     force_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling (see ``raysd.sampling.rejection_sample`` for the contract)."""
    if _use_triton(target_probs, force_triton):
        from raysd.kernels.spec_verify import rejection_verify

        return rejection_verify(draft_token_ids, draft_probs, target_probs, num_draft, uniform_samples,
                                recovery_samples)
    return sampling.rejection_sample(draft_token_ids, draft_probs, target_probs, num_draft, uniform_samples,
                                     recovery_samples)
