"""Triton kernels against the torch reference, across sizes, under TRITON_INTERPRET=1 on CPU."""

import os

import pytest
import torch

from raysd.sampling import greedy_accept, rejection_sample

pytest.importorskip("triton", reason="kernel tests need the 'kernels' extra (triton)")
if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    pytest.skip("set TRITON_INTERPRET=1 to run the kernels on CPU", allow_module_level=True)

from raysd.kernels import greedy_accept_logits  # noqa: E402
from raysd.kernels import rejection_sample as dispatched_rejection  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [(1, 0, 7), (3, 1, 50), (5, 4, 300), (4, 8, 1100)]  # (num_seqs, max_k, vocab); vocab > block size


def _case(num_seqs, max_k, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_seqs, max_k + 1, vocab, generator=generator)
    num_draft = torch.randint(0, max_k + 1, (num_seqs,), generator=generator)
    argmax = logits.argmax(-1)
    draft = argmax[:, :max_k].clone()  # mostly agreeing drafts, with planted disagreements
    flip = torch.rand(num_seqs, max_k, generator=generator) < 0.3
    draft[flip] = (draft[flip] + 1) % vocab
    return logits, draft, num_draft, generator


@pytest.mark.parametrize("num_seqs,max_k,vocab", SIZES)
def test_greedy_kernel_matches_reference(num_seqs, max_k, vocab):
    logits, draft, num_draft, _ = _case(num_seqs, max_k, vocab, seed=vocab)
    expected = greedy_accept(draft, logits.argmax(-1), num_draft)
    got = greedy_accept_logits(logits.to(DEVICE), draft.to(DEVICE), num_draft.to(DEVICE), force_triton=True)
    assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


@pytest.mark.parametrize("num_seqs,max_k,vocab", SIZES)
def test_rejection_kernel_matches_reference(num_seqs, max_k, vocab):
    logits, draft, num_draft, generator = _case(num_seqs, max_k, vocab, seed=vocab + 1)
    target_probs = torch.softmax(logits, -1)
    draft_probs = torch.softmax(logits[:, :max_k] + torch.randn(num_seqs, max_k, vocab, generator=generator), -1)
    uniform = torch.rand(num_seqs, max_k, generator=generator)
    recovery = torch.rand(num_seqs, generator=generator)
    expected = rejection_sample(draft, draft_probs, target_probs, num_draft, uniform, recovery)
    got = dispatched_rejection(*(t.to(DEVICE) for t in (draft, draft_probs, target_probs, num_draft, uniform,
                                                        recovery)), force_triton=True)
    assert torch.equal(got[0].cpu(), expected[0]), (got[0], expected[0])
    assert torch.equal(got[1].cpu(), expected[1]), (got[1], expected[1])
