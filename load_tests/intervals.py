"""How sure a sweep is of adaptive / max(off, on): an interval per point, from resampling its passes.

A sweep point's ratio pools ``--passes`` windows per policy (tokens / seconds summed). This machine's windows
scatter (coefficient of variation ~7% between passes of one policy, more while the hypervisor steals CPU), so
a ratio read once carries that scatter, and a 5% bar on 21 points is crossed by chance as well as by the policy.
``ratio_intervals`` puts a number on it: it draws the passes with replacement (a pass keeps its three windows
together, since they ran seconds apart and share the machine's state), pools each policy over the drawn
passes as the sweep does, and reads the spread of the ratio over the draws (percentile bootstrap).

With five passes the intervals are a floor on the uncertainty, not a bound: a resample of five can only
recombine the five windows there are (drift between passes beyond them is not seen).

    python load_tests/intervals.py bench/results/sweep_run19     # any sweep written with --passes ≥ 2
    python load_tests/intervals.py bench/results/sweep_run{19,20,21}   # sweeps of one policy, passes pooled

Several folders pool their passes (each sweep's passes kept apart): sweeps of the same code read together, the
best estimate of each point's ratio there is; it is not the one-sweep reading the issue's goal is set on.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
from pathlib import Path

POLICIES = ("off", "on", "adaptive")


def _windows_by_point(pass_rows: list[dict]) -> dict[tuple[str, int], dict[int, dict[str, tuple[float, float]]]]:
    """(workload, concurrency) → pass → policy → (window tokens, window seconds)."""
    points: dict[tuple[str, int], dict[int, dict[str, tuple[float, float]]]] = {}
    for row in pass_rows:
        point = points.setdefault((row["workload"], int(row["concurrency"])), {})
        point.setdefault(int(row["pass"]), {})[row["policy"]] = (float(row["window_tokens"]),
                                                                  float(row["window_seconds"]))
    return points


def adaptive_vs_best(passes: list[dict[str, tuple[float, float]]]) -> float:
    """adaptive / max(off, on) over ``passes`` (each: policy → (tokens, seconds)), each policy pooled."""
    rate = {policy: sum(p[policy][0] for p in passes) / sum(p[policy][1] for p in passes) for policy in POLICIES}
    return rate["adaptive"] / max(rate["off"], rate["on"])


def ratio_intervals(pass_rows: list[dict], confidence: float = 0.9, resamples: int = 2000,
                    seed: int = 0) -> dict[str, dict[int, tuple[float, float]]]:
    """``{workload: {concurrency: (low, high)}}``: the central ``confidence`` interval of adaptive /
    max(off, on) over ``resamples`` draws of the point's passes with replacement. ``pass_rows`` are
    ``sweep_passes.csv`` rows (``pass``, ``policy``, ``workload``, ``concurrency``, ``window_tokens``,
    ``window_seconds``; strings or numbers). A point is left out unless at least two passes have a window of
    every policy with time in it (one pass has no spread to read); passes missing a policy are dropped.
    Deterministic for a given ``seed``."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1) (got {confidence})")
    rng = random.Random(seed)
    result: dict[str, dict[int, tuple[float, float]]] = {}
    for (workload, users), by_pass in sorted(_windows_by_point(pass_rows).items()):
        passes = [windows for _, windows in sorted(by_pass.items())
                  if all(policy in windows and windows[policy][1] > 0 for policy in POLICIES)]
        if len(passes) < 2:
            continue
        draws = sorted(adaptive_vs_best(rng.choices(passes, k=len(passes))) for _ in range(resamples))
        tail = (1 - confidence) / 2
        low, high = draws[int(tail * (resamples - 1))], draws[round((1 - tail) * (resamples - 1))]
        result.setdefault(workload, {})[users] = (low, high)
    return result


def read_passes(folders: list[Path]) -> list[dict]:
    """The ``sweep_passes.csv`` rows of ``folders``, their passes renumbered so that no two sweeps share one
    (folder i's pass p becomes ``i * 1000 + p``). Raises ``FileNotFoundError`` naming a folder without one."""
    rows = []
    for index, folder in enumerate(folders):
        passes_csv = folder / "sweep_passes.csv"
        if not passes_csv.exists():
            raise FileNotFoundError(f"{passes_csv} not found: intervals need a sweep run with --passes 2 or more")
        with open(passes_csv) as handle:
            rows += [{**row, "pass": index * 1000 + int(row["pass"])} for row in csv.DictReader(handle)]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+",
                        help="a sweep's --out folder (holds sweep_passes.csv); several: their passes pooled")
    parser.add_argument("--confidence", type=float, default=0.9)
    parser.add_argument("--goal", type=float, default=0.95, help="the bar each point's ratio is read against")
    args = parser.parse_args(argv)
    if not 0 < args.confidence < 1:
        parser.error(f"--confidence must be in (0, 1), e.g. 0.9 (got {args.confidence})")
    try:
        rows = read_passes(args.results)
    except FileNotFoundError as error:
        parser.error(str(error))
    points = _windows_by_point(rows)
    below, undecided = 0, 0
    for workload, intervals in ratio_intervals(rows, args.confidence).items():
        cells = []
        for users, (low, high) in intervals.items():
            ratio = adaptive_vs_best([w for w in points[(workload, users)].values()
                                      if all(policy in w for policy in POLICIES)])
            below += high < args.goal
            undecided += low < args.goal <= high
            cells.append(f"c={users}: {ratio:.2f} [{low:.2f}, {high:.2f}]")
        print(f"[{workload}] adaptive / max(off, on) [{args.confidence:.0%} interval]: " + ", ".join(cells))
    print(f"points whose whole interval is below {args.goal}: {below}; whose interval straddles it: {undecided}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
