"""Verification and drafting cost on a GPU: v(k, b) and c(b), the ratios ``raysd probe`` times, for model shapes
that matter there, on two clocks (wall time of an eager forward, and the GPU kernels' own time).

The policy's claims rest on two ratios (see ``raysd/probe.py``): ``v(k, b)`` = one target forward of k + 1
tokens per row / one decode forward, at batch b, and ``c(b)`` = one draft decode forward / one target decode
forward. On 2 CPU cores v(4, 32) ≈ 4.5 (``bench/results/probe_heldout.json``); this script measures the same
ratios on a CUDA device, through the same ragged-cache forward the workers run (transformers, eager
PyTorch, bf16), for:

- ``demo``: the shipped demo pair (6-layer 384-wide target, its draft), weights from ``models/demo``;
- ``llama-8b-shape``: a Llama-3-8B-shaped target with a Llama-3.2-1B-shaped draft, random weights (timing
  does not depend on the values; no weights are downloaded).

    python bench/gpu_costs.py --out bench/results/gpu_costs.json   # needs a CUDA device; ~2 min on an H200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZES = (1, 4, 16, 64, 256)
SHAPES = {
    "llama-8b-shape": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                       "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama-1b-shape": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                       "num_attention_heads": 32, "num_key_value_heads": 8},
}


def random_llama(shape: str, dtype: torch.dtype, device: str):
    """A Llama of the named shape with random weights, built directly on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, max_position_embeddings=4096, **SHAPES[shape])
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def pairs(dtype: torch.dtype, device: str):
    """(name, target, draft) for each measured pair; built one at a time to keep memory bounded."""
    from raysd.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm

    yield "demo", load_causal_lm(DEMO_TARGET, dtype, device), load_causal_lm(DEMO_DRAFT, dtype, device)
    yield "llama-8b-shape", random_llama("llama-8b-shape", dtype, device), random_llama("llama-1b-shape", dtype,
                                                                                        device)


def _forward_function():
    """Our ragged-cache forward; transformers before 5.2x names the cache keyword ``past_key_values`` (ours:
    ``cache``, pinned in constraints.txt) and a GPU image may carry an older one."""
    import inspect

    from transformers import LlamaForCausalLM

    from raysd.kv_cache import ragged_forward

    if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters:
        return ragged_forward

    def older_ragged_forward(model, cache, rows, input_ids, positions):
        cache.bind(rows, positions)
        mask = cache.attention_mask(rows, positions, next(model.parameters()).dtype)
        with torch.inference_mode():
            return model(input_ids=input_ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                         use_cache=True).logits

    return older_ragged_forward


def time_forward(forward, model, num_rows: int, width: int, context: int, repeats: int) -> tuple[float, float]:
    """(median wall seconds, GPU kernel seconds) of one forward of ``width`` tokens per row after ``context``.

    Wall time is what an eager transformers worker waits for (on small models it is mostly Python and kernel
    launches); kernel time is the sum of the CUDA kernels' own durations (PyTorch profiler), the cost a
    server that replays CUDA graphs approaches.
    """
    from torch.profiler import ProfilerActivity, profile

    from raysd.kv_cache import RaggedKVCache

    cache = RaggedKVCache.for_model(model, num_rows, context + width + 1)
    cache.lengths[:] = context
    inputs = torch.randint(0, model.config.vocab_size, (num_rows, width), device="cuda")
    positions = context + torch.arange(width, device="cuda")[None, :].expand(num_rows, width)
    rows = slice(0, num_rows)
    for _ in range(3):
        forward(model, cache, rows, inputs, positions)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        forward(model, cache, rows, inputs, positions)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    profiled = 3
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(profiled):
            forward(model, cache, rows, inputs, positions)
        torch.cuda.synchronize()
    kernel_us = sum(getattr(event, "self_device_time_total", 0) for event in profiler.key_averages())
    return sorted(times)[len(times) // 2], kernel_us / 1e6 / profiled


def measure_pair(target, draft, context: int, repeats: int, k_values=(1, 2, 4, 8)) -> dict:
    """Per batch size: target decode (wall and kernel ms), c(b) and v(k, b) on both clocks."""
    forward = _forward_function()
    figures = {}
    for batch in BATCH_SIZES:
        decode = time_forward(forward, target, batch, 1, context, repeats)
        draft_step = time_forward(forward, draft, batch, 1, context, repeats)
        verify = {k: time_forward(forward, target, batch, k + 1, context, repeats) for k in k_values}
        figures[batch] = {clock: {"decode_ms": decode[i] * 1e3, "c": draft_step[i] / decode[i],
                                  "v": {k: verify[k][i] / decode[i] for k in k_values}}
                          for i, clock in enumerate(("wall", "kernel"))}
        print(f"  b={batch}: decode {decode[0] * 1e3:.2f} ms wall / {decode[1] * 1e3:.2f} ms kernels", flush=True)
    return figures


def markdown(results: dict) -> str:
    lines = ["| pair | clock | b | decode ms | c(b) | v(1, b) | v(2, b) | v(4, b) | v(8, b) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, figures in results["pairs"].items():
        for clock in ("kernel", "wall"):
            for batch, cost in figures["costs"].items():
                row = cost[clock]
                lines.append(f"| {name} | {clock} | {batch} | {row['decode_ms']:.2f} | {row['c']:.2f} | "
                             + " | ".join(f"{value:.2f}" for value in row["v"].values()) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_costs.json")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per row before the timed forward")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_costs: no CUDA device here; this benchmark measures GPU costs (use `raysd probe` on CPU)",
              file=sys.stderr)
        return 2
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
               "context": args.context, "repeats": args.repeats, "pairs": {}}
    for name, target, draft in pairs(torch.bfloat16, "cuda"):
        print(name, flush=True)
        started = time.perf_counter()
        costs = measure_pair(target, draft, args.context, args.repeats)
        results["pairs"][name] = {
            "target_params": sum(p.numel() for p in target.parameters()),
            "draft_params": sum(p.numel() for p in draft.parameters()),
            "costs": costs, "seconds": time.perf_counter() - started}
        del target, draft
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
