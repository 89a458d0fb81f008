"""Engine benchmark on the demo pair: tokens/s per workload at batch 1 and 16 concurrent sequences.

Configurations: target-only (transformers `generate`, and raysd with speculation off), transformers
assisted generation (`generate(assistant_model=draft)`, its defaults; batch 1 only, so the 16 are run one
by one), raysd with fixed k, raysd adaptive. Each configuration runs in its own process so its peak RSS
is its own. Also records the measured α, c, v(k) and the Leviathan bound E/(k·c + v).

    python bench/bench_engine.py                 # writes bench/results/engine.json + docs/bench_engine.md
    python bench/bench_engine.py --quick         # fewer prompts/tokens (smoke run)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("hf_target", "raysd_off", "hf_assisted", "raysd_k", "raysd_adaptive")
WORKLOADS = ("code", "json", "prose")


def _prompts(workload: str, count: int) -> list[str]:
    records = [json.loads(line) for line in (REPO / "bench/prompts/heldout.jsonl").read_text().splitlines()]
    return [r["prompt"] for r in records if r["workload"] == workload][:count]


def run_one(config: str, workload: str, batch: int, count: int, max_tokens: int, k: int, threads: int) -> dict:
    """Child process: load the pair, warm up, time ``count`` prompts in batches of ``batch``."""
    import torch

    from raysd.config import EngineConfig, PolicyConfig, SamplingParams, SpeculationMode
    from raysd.drafting import ModelDrafter
    from raysd.engine import SpecEngine
    from raysd.models import DEMO_DRAFT, DEMO_TARGET, ModelPair

    torch.set_num_threads(threads)
    pair = ModelPair(DEMO_TARGET, DEMO_DRAFT)
    tokenizer = pair.tokenizer
    prompts = [tokenizer.encode(p) for p in _prompts(workload, count)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    stats: dict = {}

    def hf_generate(prompt_ids: list[int], assistant) -> list[int]:
        inputs = torch.tensor([prompt_ids])
        kwargs = {"assistant_model": assistant} if assistant is not None else {}
        with torch.no_grad():
            out = pair.target.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                       max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                       pad_token_id=tokenizer.pad_token_id, **kwargs)
        return out[0, len(prompt_ids):].tolist()

    def run_engine(mode: SpeculationMode, group: list[list[int]]) -> list[list[int]]:
        engine_config = EngineConfig(max_num_seqs=len(group), max_model_len=1024)
        drafter = None if mode == SpeculationMode.off else ModelDrafter(pair.draft, len(group), 1024)
        policy = PolicyConfig(mode=mode, k=k)
        engine = SpecEngine(pair.target, drafter, tokenizer.eos_token_id, engine_config, policy)
        sequences = engine.generate(group, params, [workload] * len(group))
        totals = engine.aggregator.segments.get(workload)
        if totals is not None:
            stats["drafted"] = stats.get("drafted", 0) + totals.num_draft_tokens
            stats["accepted"] = stats.get("accepted", 0) + totals.num_accepted_tokens
            stats["spec_rounds"] = stats.get("spec_rounds", 0) + totals.num_drafts
        return [s.output_token_ids for s in sequences]

    def run_group(group):
        if config == "hf_target":
            return [hf_generate(p, None) for p in group]
        if config == "hf_assisted":
            return [hf_generate(p, pair.draft) for p in group]
        mode = {"raysd_off": SpeculationMode.off, "raysd_k": SpeculationMode.on,
                "raysd_adaptive": SpeculationMode.adaptive}[config]
        return run_engine(mode, group)

    run_group(prompts[:1])  # warm-up (first forwards allocate)
    stats.clear()
    started = time.perf_counter()
    outputs = []
    for start in range(0, len(prompts), batch):
        outputs.extend(run_group(prompts[start:start + batch]))
    seconds = time.perf_counter() - started
    return {"config": config, "workload": workload, "batch": batch, "prompts": len(prompts),
            "tokens": sum(len(o) for o in outputs), "seconds": seconds,
            "tokens_per_second": sum(len(o) for o in outputs) / seconds, "outputs": outputs,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **stats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/engine.json")
    parser.add_argument("--child", nargs=3, metavar=("CONFIG", "WORKLOAD", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    count_b1, count_b16, max_tokens = (2, 4, 16) if args.quick else (4, 16, 64)
    if args.child:
        config, workload, batch = args.child[0], args.child[1], int(args.child[2])
        count = count_b1 if batch == 1 else count_b16
        print(json.dumps(run_one(config, workload, batch, count, max_tokens, args.k, args.threads)))
        return 0

    from tqdm import tqdm

    from raysd.models import DEMO_DRAFT, DEMO_TARGET, ModelPair
    from raysd.policy import expected_tokens
    from raysd.probe import alpha_from_acceptance, measure_costs

    runs = [(c, w, b) for w in WORKLOADS for b in (1, 16) for c in CONFIGS]
    results = []
    for config, workload, batch in tqdm(runs, desc="bench"):
        child = subprocess.run([sys.executable, __file__, "--child", config, workload, str(batch), "--k",
                                str(args.k), "--threads", str(args.threads)] + (["--quick"] if args.quick else []),
                               capture_output=True, text=True, check=True)
        results.append(json.loads(child.stdout.splitlines()[-1]))

    import torch

    torch.set_num_threads(args.threads)
    pair = ModelPair(DEMO_TARGET, DEMO_DRAFT)
    costs = measure_costs(pair.target, pair.draft, args.k, batch_sizes=(1, 16), progress=False)
    summary = {}
    for workload in WORKLOADS:
        for batch in (1, 16):
            rows = {r["config"]: r for r in results if r["workload"] == workload and r["batch"] == batch}
            fixed = rows["raysd_k"]
            rate = fixed["accepted"] / fixed["drafted"] if fixed.get("drafted") else 0.0
            alpha = alpha_from_acceptance(rate, args.k)
            cost = costs[batch]
            bound = expected_tokens(alpha, args.k) / (args.k * cost["c"] + cost["v"][args.k])
            off = rows["raysd_off"]["tokens_per_second"]
            summary[f"{workload}@{batch}"] = {
                "tokens_per_second": {c: rows[c]["tokens_per_second"] for c in CONFIGS},
                "peak_rss_mb": {c: rows[c]["peak_rss_mb"] for c in CONFIGS},
                "acceptance_rate_k": rate, "alpha": alpha, "c": cost["c"], "v_k": cost["v"][args.k],
                "bound": bound, "raysd_k_speedup": fixed["tokens_per_second"] / off,
                "raysd_k_vs_bound": fixed["tokens_per_second"] / off / bound,
                "raysd_k_vs_hf_assisted": fixed["tokens_per_second"] / rows["hf_assisted"]["tokens_per_second"],
                "adaptive_vs_off": rows["raysd_adaptive"]["tokens_per_second"] / off,
                "identical_outputs": all(rows[c]["outputs"] == rows["hf_target"]["outputs"] for c in CONFIGS),
            }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"k": args.k, "max_tokens": max_tokens, "quick": args.quick, "summary": summary,
                                    "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in results]},
                                   indent=2))
    print(markdown_table(summary, args.k))
    return 0


def markdown_table(summary: dict, k: int) -> str:
    lines = [f"| workload@batch | HF target | raysd off | HF assisted | raysd k={k} | raysd adaptive | α | c | v({k}) "
             f"| bound | k / bound | k / HF assisted | adaptive / off | identical |",
             "|---" * 14 + "|"]
    for key, row in summary.items():
        tps = row["tokens_per_second"]
        lines.append(
            f"| {key} | {tps['hf_target']:.0f} | {tps['raysd_off']:.0f} | {tps['hf_assisted']:.0f} | "
            f"{tps['raysd_k']:.0f} | {tps['raysd_adaptive']:.0f} | {row['alpha']:.2f} | {row['c']:.2f} | "
            f"{row['v_k']:.2f} | {row['bound']:.2f} | {row['raysd_k_vs_bound']:.2f} | "
            f"{row['raysd_k_vs_hf_assisted']:.2f} | {row['adaptive_vs_off']:.2f} | "
            f"{'yes' if row['identical_outputs'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
