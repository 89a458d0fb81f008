"""Time to first token under closed-loop load, in rounds: why speculation raises it at low concurrency.

One ``raysd serve`` (deployments/local.yaml); per concurrency the policies off and on (fixed k) take turns in
closed-loop Locust windows (off, on, off, on), switched through ``PUT /v1/admin/policy``. Around each window it
reads the router's round counters from ``/health`` (``round_timing``), so each window reports its TTFT next to
its mean round time: TTFT / round says how many rounds a new request waits through before its first token.

    python bench/ttft_rounds.py --concurrency 1,2,4,8 --out bench/results/checks_2026-12-08/ttft_rounds.json
    # ~5 min here: the recorded run, read in docs/benchmarks.md (Reading: where JSON's extra TTFT goes)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _window(url: str, policy: str, workload: str, users: int, seconds: float, k: int, work: Path) -> dict:
    """One closed-loop window at ``policy``: TTFT percentiles, mean round time and requests completed."""
    import requests

    from load_tests.sweep import run_locust, set_policy

    set_policy(url, policy, k)
    before = requests.get(f"{url}/health", timeout=30).json()["round_timing"]
    raw = run_locust(url, workload, users, seconds, 64, work)
    after = requests.get(f"{url}/health", timeout=30).json()["round_timing"]
    rounds = after["rounds"] - before["rounds"]
    round_ms = 1000 * (after["round_seconds"] - before["round_seconds"]) / max(rounds, 1)
    ttft_ms = sorted(1000 * t for t in raw.get("ttft_s", []))
    if not ttft_ms:
        raise RuntimeError(f"no request completed at {policy} c={users}; see the server log in {work}")
    median = ttft_ms[len(ttft_ms) // 2]
    return {"policy": policy, "concurrency": users, "requests": len(ttft_ms), "rounds": rounds,
            "mean_round_ms": round_ms, "ttft_p50_ms": median, "ttft_mean_ms": statistics.fmean(ttft_ms),
            "ttft_p50_rounds": median / round_ms if round_ms else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="2,4,8", help="comma-separated closed-loop user counts")
    parser.add_argument("--workload", default="json", choices=("code", "json", "prose"))
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per window")
    parser.add_argument("--k", type=int, default=4, help="draft length of the always-on policy")
    parser.add_argument("--out", type=Path, default=None, help="write the windows as JSON here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tqdm import tqdm

    from load_tests.sweep import Server, run_locust

    levels = [int(c) for c in args.concurrency.split(",")]
    windows = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        server = Server("adaptive", args.k, work)
        try:
            run_locust(server.url, args.workload, 2, 6, 64, work)  # warm the processes up
            schedule = [(users, policy) for users in levels for policy in ("off", "on", "off", "on")]
            for users, policy in tqdm(schedule, desc="windows", unit="window"):
                windows.append(_window(server.url, policy, args.workload, users, args.duration, args.k, work))
        finally:
            server.stop()
    for window in windows:
        print(f"c={window['concurrency']} {window['policy']:3s} requests={window['requests']:3d} "
              f"round={window['mean_round_ms']:5.1f} ms  TTFT p50={window['ttft_p50_ms']:5.1f} ms "
              + (f"= {window['ttft_p50_rounds']:.2f} rounds" if window["ttft_p50_rounds"] else "(no rounds counted)"))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"workload": args.workload, "k": args.k, "duration_s": args.duration,
                                        "windows": windows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
