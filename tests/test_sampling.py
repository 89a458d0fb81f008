"""The verification math: exact greedy and rejection tables, determinism, distribution preservation."""

import torch
from scipy.stats import chisquare

from raysd.sampling import greedy_accept, processed_probs, rejection_sample, sample_inverse_cdf


def test_greedy_accept_exact_table():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 4, 4]])
    target_argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [0, 2, 3, 4], [4, 4, 9, 9]])
    num_draft = torch.tensor([3, 3, 3, 1])  # last row: only its first slot is a real draft
    accepted, bonus = greedy_accept(draft, target_argmax, num_draft)
    assert accepted.tolist() == [3, 1, 0, 1]  # all, first rejected at slot 1, at slot 0, capped by k
    assert bonus.tolist() == [8, 6, 0, 4]  # the target's own token after the accepted prefix


def test_greedy_accept_k_zero_is_plain_decoding():
    accepted, bonus = greedy_accept(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[3], [7]]),
                                    torch.tensor([0, 0]))
    assert accepted.tolist() == [0, 0] and bonus.tolist() == [3, 7]


def _one_hot_rows(rows, vocab=4):
    return torch.tensor([[1.0 if i == r else 0.0 for i in range(vocab)] for r in rows])


def test_rejection_sample_exact_tables():
    vocab = 4
    draft_tokens = torch.tensor([[1, 2], [1, 2], [1, 2]])
    draft_probs = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]]] * 3)
    target_probs = torch.tensor([[[0.0, 0.25, 0.25, 0.5], [0.0, 0.0, 0.5, 0.5], [0.1, 0.2, 0.3, 0.4]]] * 3)
    num_draft = torch.tensor([2, 2, 2])
    # row 0: u·0.5 < 0.25 and u·1 < 0.5 → both accepted, bonus from target slot 2 (cdf 0.1,0.3,0.6,1.0)
    # row 1: slot 0 rejected (0.6·0.5 ≥ 0.25) → residual max(0, t−d) = [0,0,0,0.5] → token 3
    # row 2: slot 0 accepted, slot 1 rejected (0.9 ≥ 0.5) → residual [0,0,0,0.5] → token 3
    uniform = torch.tensor([[0.4, 0.3], [0.6, 0.0], [0.1, 0.9]])
    recovery = torch.tensor([0.5, 0.0, 0.99])
    accepted, bonus = rejection_sample(draft_tokens, draft_probs, target_probs, num_draft, uniform, recovery)
    assert accepted.tolist() == [2, 0, 1]
    assert bonus.tolist() == [2, 3, 3]
    assert vocab == draft_probs.shape[-1]


def test_rejection_sample_ragged_k_uses_target_at_stop():
    draft_tokens = torch.tensor([[1, 0]])
    draft_probs = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
    target_probs = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    accepted, bonus = rejection_sample(draft_tokens, draft_probs, target_probs, torch.tensor([1]),
                                       torch.tensor([[0.5, 0.5]]), torch.tensor([0.5]))
    assert accepted.tolist() == [1] and bonus.tolist() == [2]  # slot 1 is padding: bonus from target[1]


def test_sample_inverse_cdf_and_determinism():
    probs = torch.tensor([[0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    assert sample_inverse_cdf(probs, torch.tensor([0.1, 0.0])).tolist() == [0, 2]
    assert sample_inverse_cdf(probs, torch.tensor([0.25, 0.7])).tolist() == [1, 2]
    generator_a, generator_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    draws_a = sample_inverse_cdf(probs.repeat(50, 1), torch.rand(100, generator=generator_a))
    draws_b = sample_inverse_cdf(probs.repeat(50, 1), torch.rand(100, generator=generator_b))
    assert torch.equal(draws_a, draws_b)


def test_processed_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    full = processed_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]))
    assert torch.allclose(full, torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]), atol=1e-6)
    top2 = processed_probs(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.allclose(top2, torch.tensor([[[0.625, 0.375, 0.0, 0.0]]]), atol=1e-6)
    nucleus = processed_probs(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.7]))
    assert torch.allclose(nucleus, torch.tensor([[[0.625, 0.375, 0.0, 0.0]]]), atol=1e-6)


def _chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected >= 5  # pool the rare tokens into one bin
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    expected = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
    expected = expected * observed.sum() / expected.sum()
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def test_rejection_sampling_preserves_target_distribution(tiny_pair):
    """Tokens emitted at the first slot follow the target's processed distribution exactly (χ², 20k)."""
    target, draft = tiny_pair
    context = torch.tensor([[3, 17, 42, 8, 61]])
    with torch.no_grad():
        target_logits = target(input_ids=context).logits[:, -1:]
        draft_logits = draft(input_ids=context).logits[:, -1:]
    samples = 20_000
    generator = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.7):
        temp = torch.tensor([temperature])
        target_probs = processed_probs(target_logits, temp, torch.tensor([0]), torch.tensor([1.0]))[0, 0]
        draft_probs = processed_probs(draft_logits, temp, torch.tensor([0]), torch.tensor([1.0]))[0, 0]
        # a deliberately wrong-ish draft: mix in uniform mass so that rejections happen often
        draft_probs = 0.5 * draft_probs + 0.5 / draft_probs.numel()
        draft_tokens = torch.multinomial(draft_probs, samples, replacement=True, generator=generator)[:, None]
        accepted, bonus = rejection_sample(
            draft_tokens, draft_probs.expand(samples, 1, -1), target_probs.expand(samples, 2, -1),
            torch.ones(samples, dtype=torch.long), torch.rand(samples, 1, generator=generator),
            torch.rand(samples, generator=generator))
        first_token = torch.where(accepted == 1, draft_tokens[:, 0], bonus)
        assert 0.05 < (accepted == 1).float().mean() < 0.95  # both paths exercised
        p_value = _chi_square_p(first_token, target_probs)
        assert p_value > 0.01, f"temperature {temperature}: χ² p={p_value:.4f}"
        # the draft's own distribution is rejected by the same test: it has the power to fail
        assert _chi_square_p(draft_tokens[:, 0], target_probs) < 0.01
