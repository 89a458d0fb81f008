"""Tiny random Llama models built by the tests themselves (no downloads), and reference decoders."""

from __future__ import annotations

import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96


def tiny_llama(seed: int, hidden: int = 48, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               vocab: int = VOCAB) -> LlamaForCausalLM:
    """A randomly initialised Llama in fp32 eval mode; same seed, same weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits so greedy decisions are not near-ties everywhere
        model.lm_head.weight.mul_(2.0)
    return model


def perturbed_copy(model: LlamaForCausalLM, seed: int, scale: float) -> LlamaForCausalLM:
    """A draft that agrees with ``model`` often but not always: its weights plus seeded noise."""
    draft = LlamaForCausalLM(model.config).eval()
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return draft


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Target-only greedy decoding by full recomputation; returns tokens and each step's logits."""
    tokens, all_logits = list(prompt), []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], all_logits


def assert_greedy_equal_or_tie(got: list[int], expected: list[int], step_logits: list[torch.Tensor],
                               what: str, margin: float = 1e-4) -> None:
    """Token-identical, or the first divergence is a numerical tie of the target (top-2 gap < margin)."""
    for position, (got_id, expected_id) in enumerate(zip(got, expected)):
        if got_id != expected_id:
            top2 = step_logits[position].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < margin, (f"{what}: diverged at generated position {position} ({got_id} vs "
                                  f"{expected_id}) where the target's top-2 logit gap is {gap:.2e} ≥ {margin}")
            warnings.warn(f"{what}: numerical tie at position {position} (top-2 gap {gap:.2e}); rest not compared",
                          stacklevel=2)
            return
    assert len(got) == len(expected), f"{what}: {len(got)} tokens vs {len(expected)}"
