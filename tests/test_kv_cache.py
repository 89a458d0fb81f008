"""Our ragged batched forward equals transformers' own forward on the same inputs (fp32, 1e-4)."""

import torch
from tiny_models import VOCAB, tiny_llama

from raysd.kv_cache import RaggedKVCache, RowTable, ragged_forward


def _full_logits(model, token_ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0]


def test_ragged_rows_match_unbatched_forward_and_roll_back():
    model = tiny_llama(3)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (5, 11, 2)]
    cache = RaggedKVCache.for_model(model, num_rows=4, max_len=64)
    table = RowTable(cache)
    for index, tokens in enumerate(sequences):  # prefill each row on its own
        row = table.add(f"s{index}")
        ragged_forward(model, cache, slice(row, row + 1), torch.tensor([tokens[:-1]]),
                       torch.arange(len(tokens) - 1)[None])
        cache.lengths[row] = len(tokens) - 1
    # one ragged step: last token + 3 "draft" tokens per row, different lengths per row
    drafts = torch.randint(0, VOCAB, (3, 3), generator=generator)
    inputs = torch.cat([torch.tensor([[s[-1]] for s in sequences]), drafts], dim=1)
    positions = cache.lengths[:3, None] + torch.arange(4)[None]
    logits = ragged_forward(model, cache, slice(0, 3), inputs, positions)
    for row, tokens in enumerate(sequences):
        expected = _full_logits(model, tokens + drafts[row].tolist())[-4:]
        assert torch.allclose(logits[row], expected, atol=1e-4), (row, (logits[row] - expected).abs().max())
    # roll back: row 0 keeps 1 draft, row 1 none, row 2 all three; continue with new tokens
    kept = [1, 0, 3]
    for row, count in enumerate(kept):
        cache.lengths[row] += count + 1
        sequences[row] = sequences[row] + drafts[row, :count].tolist() + [int(drafts[row, count - 1]) if count
                                                                            else 7]
    # (the "bonus" token above is arbitrary; it is fed next, as the engine would)
    table.remove("s0")  # s2 moves into row 0: continuous batching without per-round copies
    order = [table.seq_at[0], table.seq_at[1]]
    assert order == ["s2", "s1"]
    current = {"s1": sequences[1], "s2": sequences[2]}
    step_inputs = torch.tensor([[current[name][-1]] for name in order])
    positions = cache.lengths[:2, None].clone()
    logits = ragged_forward(model, cache, slice(0, 2), step_inputs, positions)
    for row, name in enumerate(order):
        expected = _full_logits(model, current[name])[-1]
        assert torch.allclose(logits[row, 0], expected, atol=1e-4), name


def test_cache_sizes_kv_heads_from_weights():
    model = tiny_llama(0, hidden=48, heads=4, kv_heads=2)
    cache = RaggedKVCache.for_model(model, num_rows=2, max_len=16)
    assert cache.layers[0].keys.shape == (2, 2, 16, 12)
