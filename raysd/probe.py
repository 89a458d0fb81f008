"""Measure whether speculation pays on your own traffic: acceptance per workload and k, costs, bound.

For each workload in a prompt file and each k in 1..k_max, the prompts are decoded greedily with a fixed
k (all of a workload's prompts batched together) and acceptance is counted. The cost ratios are timed
directly: c(b) = one draft forward / one target decode forward at batch b, and v(k, b) = one target
forward of k + 1 tokens per row / one decode forward. The predicted speedup is the Leviathan bound
E(α, k) / (k·c + v) with α fitted from the measured acceptance.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from tqdm import tqdm

from raysd.config import EngineConfig, PolicyConfig, SamplingParams, SpeculationMode
from raysd.drafting import ModelDrafter
from raysd.engine import SpecEngine
from raysd.kv_cache import RaggedKVCache, ragged_forward
from raysd.policy import expected_tokens

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def alpha_from_acceptance(acceptance_rate: float, k: int) -> float:
    """Per-token α whose prefix-rule acceptance at k equals ``acceptance_rate`` (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        if (expected_tokens(mid, k) - 1) / k < acceptance_rate:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _time_forward(model, num_rows: int, width: int, context: int, repeats: int) -> float:
    """Median seconds of one ragged forward of ``width`` tokens per row after ``context`` cached ones, on the
    model's own device (CUDA work is synchronised before the clock is read)."""
    device = next(model.parameters()).device
    cache = RaggedKVCache.for_model(model, num_rows, context + width + 1)
    cache.lengths[:] = context
    inputs = torch.randint(0, model.config.vocab_size, (num_rows, width), device=device)
    positions = context + torch.arange(width, device=device)[None, :].expand(num_rows, width)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        synchronize()
        started = time.perf_counter()
        ragged_forward(model, cache, slice(0, num_rows), inputs, positions)
        synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times[1:])[len(times[1:]) // 2]


def measure_costs(target, draft, k_max: int, batch_sizes=BATCH_SIZES, context: int = 128,
                  repeats: int = 3, progress: bool = True) -> dict:
    """Timed c(b) and v(k, b) for each batch size b (ratios to one target decode step at b)."""
    costs = {}
    for batch in tqdm(batch_sizes, desc="timing forwards", disable=not progress):
        decode = _time_forward(target, batch, 1, context, repeats)
        draft_step = _time_forward(draft, batch, 1, context, repeats) if draft is not None else None
        costs[batch] = {
            "target_decode_ms": decode * 1e3,
            "c": draft_step / decode if draft_step is not None else None,
            "v": {k: _time_forward(target, batch, k + 1, context, repeats) / decode for k in range(1, k_max + 1)},
        }
    return costs


@torch.no_grad()
def teacher_forced_agreement(target, draft, token_ids: list[list[int]]) -> float:
    """Share of positions of real text where the draft's argmax equals the target's."""
    agree = total = 0
    for ids in token_ids:
        inputs = torch.tensor([ids])
        target_argmax = target(input_ids=inputs).logits.argmax(-1)
        draft_argmax = draft(input_ids=inputs).logits.argmax(-1)
        agree += int((target_argmax == draft_argmax).sum())
        total += target_argmax.numel()
    return agree / max(total, 1)


def probe(pair, prompts: list[dict], k_max: int = 8, max_tokens: int = 64,
          batch_sizes=BATCH_SIZES, progress: bool = True) -> dict:
    """Run the measurements; ``prompts`` are ``{"prompt": str, "workload": str}`` records."""
    tokenizer = pair.tokenizer
    by_workload: dict[str, list[list[int]]] = defaultdict(list)
    for record in prompts:
        by_workload[record.get("workload") or "default"].append(tokenizer.encode(record["prompt"]))
    max_prompt = max(len(ids) for ids in sum(by_workload.values(), []))
    engine_config = EngineConfig(max_num_seqs=max(len(v) for v in by_workload.values()),
                                 max_model_len=max_prompt + max_tokens + 1)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    report: dict = {"k_max": k_max, "max_tokens": max_tokens, "workloads": {}}
    runs = [(workload, k) for workload in sorted(by_workload) for k in range(1, k_max + 1)]
    for workload, k in tqdm(runs, desc="acceptance", disable=not progress):
        drafter = ModelDrafter(pair.draft, engine_config.max_num_seqs, engine_config.max_model_len, k_max)
        engine = SpecEngine(pair.target, drafter, tokenizer.eos_token_id, engine_config,
                            PolicyConfig(mode=SpeculationMode.on, k=k, k_max=k_max))
        engine.generate(by_workload[workload], params)
        totals = engine.aggregator.segments["default"]
        rate = totals.acceptance_rate or 0.0
        entry = report["workloads"].setdefault(workload, {"prompts": len(by_workload[workload]), "by_k": {}})
        entry["by_k"][k] = {"acceptance_rate": rate, "mean_accepted_length": totals.mean_acceptance_length,
                            "alpha": alpha_from_acceptance(rate, k)}
    for workload, entry in report["workloads"].items():
        entry["teacher_forced_agreement"] = teacher_forced_agreement(pair.target, pair.draft,
                                                                     by_workload[workload])
    costs = measure_costs(pair.target, pair.draft, k_max, batch_sizes, progress=progress)
    report["costs"] = costs
    for entry in report["workloads"].values():
        alpha = entry["by_k"][min(4, k_max)]["alpha"]
        entry["alpha"] = alpha
        entry["predicted"] = {}
        for batch, cost in costs.items():
            best_k, best = 0, 1.0
            for k in range(1, k_max + 1):
                bound = expected_tokens(alpha, k) / (k * cost["c"] + cost["v"][k])
                if bound > best:
                    best_k, best = k, bound
            entry["predicted"][batch] = {"recommended_k": best_k, "speedup": best}
        entry["recommended_k"] = entry["predicted"][batch_sizes[0]]["recommended_k"]
    return report


def format_report(report: dict) -> str:
    """A plain-text table of a ``probe`` report."""
    lines = []
    k_values = sorted({k for e in report["workloads"].values() for k in e["by_k"]})
    header = "workload  " + " ".join(f"  k={k:<5}" for k in k_values) + "  agree  rec.k"
    lines += ["acceptance rate (mean accepted length) per k", header]
    for workload, entry in sorted(report["workloads"].items()):
        cells = " ".join(f"{entry['by_k'][k]['acceptance_rate']:.2f}({entry['by_k'][k]['mean_accepted_length']:.1f})"
                         for k in k_values)
        lines.append(f"{workload:<9} {cells}  {entry['teacher_forced_agreement']:.2f}   {entry['recommended_k']}")
    lines += ["", "measured costs: c = draft step / target step, v(k) = verify k+1 tokens / target step"]
    for batch, cost in report["costs"].items():
        v = " ".join(f"v({k})={value:.2f}" for k, value in cost["v"].items())
        lines.append(f"batch {batch:>3}: target step {cost['target_decode_ms']:.1f} ms  c={cost['c']:.2f}  {v}")
    lines += ["", "predicted speedup (Leviathan bound, best k) by batch size"]
    batches = list(report["costs"])
    lines.append("workload  " + " ".join(f"{b:>9}" for b in batches))
    for workload, entry in sorted(report["workloads"].items()):
        cells = " ".join(f"{entry['predicted'][b]['speedup']:.2f}x k={entry['predicted'][b]['recommended_k']}"
                         for b in batches)
        lines.append(f"{workload:<9} {cells}")
    return "\n".join(lines)
