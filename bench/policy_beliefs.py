"""What the adaptive policy believes at a load point, beside what the fixed policies deliver there.

One ``raysd serve`` (deployments/local.yaml); per workload the policies take turns in closed-loop Locust windows
(off, on, adaptive, then again), as the sweep does. After each adaptive window it reads the router's ``/health``:
the segment's acceptance α̂ and the fitted round cost of each k at the current batch, from which the model's
expected gain E(α̂, k) / cost(k) follows. Always-on's tokens per chunk are E(α, 4) at the acceptance the text
really has, so comparing the two says whether a k = 0 hold comes from α̂ or from the cost fit.

    python bench/policy_beliefs.py --out bench/results/checks_2026-12-07/c1_beliefs.json   # ~5 min here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _window(url: str, workload: str, users: int, seconds: float, work: Path) -> dict:
    from load_tests.sweep import run_locust
    from load_tests.sweep_results import window_tokens

    raw = run_locust(url, workload, users, seconds, 64, work)
    tokens, window_seconds = window_tokens(raw, seconds)
    return {"tokens_per_s": tokens / window_seconds if window_seconds else 0.0,
            "itl_p50_ms": 1000 * statistics.median(raw.get("gaps_s") or [0.0]),
            "tokens_per_chunk": statistics.fmean(raw.get("tokens_per_chunk") or [0.0]),
            "rounds_by_reason": raw.get("rounds_by_reason") or {}}


def _beliefs(url: str, workload: str) -> dict:
    import requests

    from raysd.round_costs import expected_tokens

    policy = requests.get(f"{url}/health", timeout=30).json()["policy"]
    alpha = policy["segments"].get(f"completions:raysd-demo:{workload}", {}).get("alpha")
    costs = {int(k): cost for k, cost in policy["cost"]["round_cost"].items()}
    return {"alpha": alpha, "batch": policy["cost"]["batch"], "round_cost": costs,
            "model_gain": {k: expected_tokens(alpha, k) / cost for k, cost in costs.items()} if alpha else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="code,prose")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each window")
    parser.add_argument("--passes", type=int, default=2, help="windows per policy (ABBA order)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.passes < 1 or args.concurrency < 1 or args.seconds <= 0:
        parser.error("--passes and --concurrency must be at least 1 and --seconds positive")
    sys.path.insert(0, str(REPO))
    from tqdm import tqdm

    from load_tests.sweep import Server, set_policy

    order = [policy for index in range(args.passes)
             for policy in (("off", "on", "adaptive") if index % 2 == 0 else ("adaptive", "on", "off"))]
    workloads = args.workloads.split(",")
    result: dict = {}
    with tempfile.TemporaryDirectory() as scratch, tqdm(total=len(order) * len(workloads), unit="window") as bar:
        server = Server("adaptive", 4, Path(scratch))
        try:
            for workload in workloads:
                for policy in order:
                    bar.set_postfix_str(f"{workload} {policy}")
                    set_policy(server.url, policy, 4)
                    window = _window(server.url, workload, args.concurrency, args.seconds, Path(scratch))
                    if policy == "adaptive":
                        window["beliefs"] = _beliefs(server.url, workload)
                    result.setdefault(workload, {}).setdefault(policy, []).append(window)
                    bar.update()
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for workload, policies in result.items():
        for policy, windows in policies.items():
            line = ", ".join(f"{w['tokens_per_s']:.1f} tok/s ({w['tokens_per_chunk']:.2f}/chunk)" for w in windows)
            print(f"[{workload}] {policy}: {line}")
            for window in windows:
                beliefs = window.get("beliefs")
                if beliefs and beliefs["model_gain"]:
                    best = max(beliefs["model_gain"], key=beliefs["model_gain"].get)
                    print(f"    α̂ {beliefs['alpha']:.3f}, round cost k=4 {beliefs['round_cost'][4]:.2f}, "
                          f"model's best k={best} gain {beliefs['model_gain'][best]:.3f}; "
                          f"rounds {window['rounds_by_reason']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
