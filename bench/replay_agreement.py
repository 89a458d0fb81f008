"""The policy tests' simulated batch-1 world (``tests/test_policy.py::_served_text_world``), run on recorded
agreement traces (``bench/agreement_traces.py``): tokens/s and share of decoding rounds drafting for off,
always-on k = 4, adaptive anchored at a fixed 0.5 (as before commit b94eeb8) and adaptive anchored at each
segment's long run, per trace file and workload, as JSON on stdout (48 requests × 3 seeds each).

    python bench/replay_agreement.py tests/data/demo_agreement.json \\
        bench/results/checks_2026-12-07/unseen_agreement.json > bench/results/checks_2026-12-07/replay_batch1.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        print(f"no such trace file: {', '.join(missing)} (write one with bench/agreement_traces.py)", file=sys.stderr)
        return 2
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    import test_policy as world

    policies = {"off": lambda: world._served_costs_policy(mode="off"),
                "on": lambda: world._served_costs_policy(mode="on", k=4),
                "anchored_at_0.5": lambda: world._anchored_at_the_prior(world._served_costs_policy()),
                "anchored_at_long_run": world._served_costs_policy}
    results = {}
    for path in paths:
        world.AGREEMENT = Path(path)
        results[path] = {}
        for workload in ("code", "json", "prose"):
            by_policy = {}
            for name, make in policies.items():
                policy = make()
                runs = [world._served_text_world(policy, workload, 48, seed) for seed in range(3)]
                by_policy[name] = {"tokens_per_s": round(sum(rate for _, rate in runs) / 3, 2),
                                   "drafting_share": round(sum(share for share, _ in runs) / 3, 3)}
            best = max(by_policy["off"]["tokens_per_s"], by_policy["on"]["tokens_per_s"])
            for name in ("anchored_at_0.5", "anchored_at_long_run"):
                by_policy[name]["vs_best_fixed"] = round(by_policy[name]["tokens_per_s"] / best, 3)
            results[path][workload] = by_policy
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
