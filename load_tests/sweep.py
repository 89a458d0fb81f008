"""Concurrency sweep: speculation off / always on (fixed k) / adaptive, per workload, with Locust.

One ``raysd serve`` (its own local Ray) serves the whole sweep. At each workload and concurrency the
policies take turns (switched through ``PUT /v1/admin/policy``, each keeping its own state), each driven by
a headless Locust run (closed loop: users = concurrency) for a bounded window, reading Locust's raw
per-chunk timings. Output tokens/s counts what streamed during the window, while all c users ran, not the
drain that follows it (see ``sweep_results.window_tokens``). A window the hypervisor took CPU time from (steal time in
``/proc/stat`` above ``--max-steal`` of the machine's) is run again, up to ``--steal-retries`` times (see
``steal_share``). It writes ``sweep.csv`` and PNG plots into ``--out`` and prints
the ratios the claims rest on:

- adaptive / max(off, on) at each concurrency (goal ≥ 0.95 everywhere), with ``--passes`` ≥ 2 a 90% interval
  from resampling the passes (``intervals.py``: how much of a shortfall the machine's scatter explains);
- on / off at the top concurrency (speculation at high load loses: < 1);
- TTFT spec / off (speculation does nothing for prefill: ≈ 1.00).

    python load_tests/sweep.py --passes 5 --duration 12   # the recorded sweep (~90 min on 2 cores)
    python load_tests/sweep.py --quick --out /tmp/s       # smoke run: json only, concurrency 1 and 4, 5 s each
    python load_tests/sweep.py --fingerprint-only         # only the outside observer's verdicts, per policy
    python load_tests/sweep.py --layout per-policy        # a fresh server per policy (the old layout)

Why one server: this machine drifts (the same server and point read 473 and 509 tok/s five minutes apart),
and two fresh servers of the same policy differ by up to 30%; a ratio of two servers measures the servers.
Interleaved, the windows a ratio compares lie seconds apart on the same processes. ``--passes 2`` gives each
policy two windows per point in ABBA order (off, on, adaptive, adaptive, on, off; the order alternating per
point), merged per point (tokens / seconds summed), which cancels a linear drift. Per-pass rows go to
``sweep_passes.csv``.

Before the first workload's points each policy's idle server is also fingerprinted from outside
(``raysd fingerprint``'s analysis on a few streams per workload): ``fingerprints.json`` and
``fingerprint-<policy>-<workload>.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
HELDOUT = REPO / "bench" / "prompts" / "heldout.jsonl"  # the locustfile's prompt pools (never import locust here)
USER_CLASS = {"code": "CodeUser", "json": "JsonUser", "prose": "ProseUser"}
POLICIES = {"off": {"mode": "off"}, "on": {"mode": "on"}, "adaptive": {"mode": "adaptive"}}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """``raysd serve`` with one policy, as a child process (its own Ray); stopped with SIGINT."""

    def __init__(self, policy: str, k: int, workdir: Path, startup_timeout_s: float = 240):
        config = yaml.safe_load((REPO / "deployments" / "local.yaml").read_text())
        args = config["applications"][0]["args"]
        args["router"]["policy"] = {**args["router"]["policy"], **POLICIES[policy], "k": k}
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = workdir / f"config-{policy}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = open(workdir / f"server-{policy}.log", "w")
        self.process = subprocess.Popen([sys.executable, "-m", "raysd.cli", "serve", "--config", str(path),
                                         "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                        cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"raysd serve exited ({self.process.returncode}); see {self.log.name}")
            try:
                workers = requests.get(f"{self.url}/health", timeout=5).json()["workers"]
                if workers["targets"] and (policy == "off" or workers["drafts"]):
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"raysd serve did not come up in {startup_timeout_s:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def run_locust(url: str, workload: str, users: int, seconds: float, max_tokens: int, workdir: Path,
               max_tokens_spread: float = 0.0) -> dict:
    """One headless Locust run; returns the locustfile's raw figures for ``workload``."""
    dump = workdir / f"locust-{workload}-{users}.json"
    env = {**os.environ, "RAYSD_LOCUST_DUMP": str(dump), "RAYSD_MAX_TOKENS": str(max_tokens),
           "RAYSD_MAX_TOKENS_SPREAD": str(max_tokens_spread)}
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), USER_CLASS[workload], "--headless",
               "-u", str(users), "-r", str(users), "-t", f"{max(1, int(seconds))}s", "--stop-timeout", "60",
               "--host", url, "--only-summary", "--loglevel", "WARNING"]
    subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=seconds + 180)
    raw = json.loads(dump.read_text()) if dump.exists() else {}
    return raw.get(workload, {})


def fingerprint_policy(url: str, policy: str, workloads: list[str], streams: int, max_tokens: int,
                       out: Path) -> dict:
    """``raysd fingerprint`` as an outsider would run it: ``streams`` completions of each workload's first
    held-out prompt on the idle server; returns {workload: figures + verdict} and writes the gap PNGs."""
    from raysd.fingerprint import analyse, plot, record_stream

    records = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    verdicts = {}
    for workload in workloads:
        prompt = next(r["prompt"] for r in records if r.get("workload") == workload)
        timings = [record_stream(url, "raysd-demo", prompt, max_tokens) for _ in range(streams)]
        fingerprint = analyse(timings)
        plot(fingerprint, out / f"fingerprint-{policy}-{workload}.png", f"{workload}, speculation {policy}")
        verdicts[workload] = fingerprint.summary()
    return verdicts


def read_cpu_ticks() -> list[int] | None:
    """The machine's CPU time so far, in ticks per state (the ``cpu`` line of ``/proc/stat``: user, nice,
    system, idle, iowait, irq, softirq, steal, guest, guest_nice); None without ``/proc`` (not Linux)."""
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    return [int(value) for value in fields[1:]] if fields and fields[0] == "cpu" else None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of the machine's CPU time between two ``read_cpu_ticks`` that the hypervisor gave elsewhere
    (steal); None when not known. On this VM it comes in bursts that slow every process alike: a window with
    0.17 of a core stolen ran its batch-32 rounds at 93 ms against 69–70 in the windows around it."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    deltas = [new - old for old, new in zip(before[:8], after[:8])]  # guest time is inside user already
    total = sum(deltas)
    return deltas[7] / total if total > 0 else None


def _measure(url: str, policy: str, workload: str, users: int, args, duration: float, workdir: Path,
             pass_index: int, progress) -> dict:
    """One load point's window: a row of ``sweep_passes.csv``; the first pass at c = 1 also keeps its gaps.
    A window the hypervisor stole more than ``args.max_steal`` of the CPU time from is run again (up to
    ``args.steal_retries`` times, the least-stolen run kept); the runs not kept go to ``sweep_stolen.csv``."""
    from load_tests.sweep_results import summarise  # (the repo's modules wait for main's sys.path)

    progress.set_postfix_str(f"{policy} {workload} c={users} (pass {pass_index + 1})")
    runs = []
    for _ in range(args.steal_retries + 1):
        before = read_cpu_ticks()
        raw = run_locust(url, workload, users, duration, args.max_tokens, workdir, args.max_tokens_spread)
        runs.append((steal_share(before, read_cpu_ticks()), raw))
        if runs[-1][0] is None or runs[-1][0] <= args.max_steal:
            break
        progress.set_postfix_str(f"{policy} {workload} c={users} (pass {pass_index + 1}, again: "
                                 f"{runs[-1][0]:.1%} stolen)")
    kept = min(range(len(runs)), key=lambda i: runs[i][0] or 0.0)
    share, raw = runs[kept]
    window_s = max(1, int(duration))
    for index, (stolen, other) in enumerate(runs):
        if index != kept:
            _append_csv(args.out / "sweep_stolen.csv", {**summarise(policy, workload, users, other, window_s),
                                                        "steal_share": stolen, "runs": 1, "pass": pass_index + 1})
    if users == 1 and pass_index == 0:
        gaps = args.out / f"gaps-{policy}-{workload}.json"
        gaps.write_text(json.dumps({k: raw.get(k, []) for k in ("gaps_s", "tokens_per_chunk")}))
    progress.update()
    return {**summarise(policy, workload, users, raw, window_s), "steal_share": share,
            "runs": len(runs), "pass": pass_index + 1}


def _append_csv(path: Path, row: dict) -> None:
    from load_tests.sweep_results import COLUMNS

    new = not path.exists()
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["pass"] + COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def _warm_up(url: str, workload: str, args, workdir: Path) -> None:
    """Load not measured: 4 users for 8 s (2 s with ``--quick``), the sweep's request shape."""
    run_locust(url, workload, 4, 2 if args.quick else 8, args.max_tokens, workdir, args.max_tokens_spread)


def set_policy(url: str, policy: str, k: int) -> None:
    """Switch a running server's speculation policy (``PUT /v1/admin/policy``)."""
    response = requests.put(f"{url}/v1/admin/policy", json={**POLICIES[policy], "k": k}, timeout=60)
    if response.status_code != 200:
        raise RuntimeError(f"switching the policy to {policy} failed: {response.status_code} {response.text}")


def sweep_interleaved(args, workloads, policies, levels, duration, workdir, progress) -> tuple[list, dict]:
    """One server for the whole sweep; at each load point the policies take turns in windows of
    ``duration`` (switched through ``PUT /v1/admin/policy``), ``--passes`` windows each, the order
    reversed every other turn. Each policy keeps its own state across its windows (the engine holds one
    policy object per config), so adaptive learns only from its own rounds."""
    rows, fingerprints = [], {}
    server = Server("adaptive", args.k, workdir)
    try:
        for block, workload in enumerate(workloads if levels else [None]):
            if workload is not None:
                for policy in policies:  # warm-up, not measured
                    progress.set_postfix_str(f"warm-up ({policy}, {workload})")
                    set_policy(server.url, policy, args.k)
                    _warm_up(server.url, workload, args, workdir)
            if block == 0:
                for policy in policies:
                    progress.set_postfix_str(f"fingerprint ({policy})")
                    set_policy(server.url, policy, args.k)
                    fingerprints[policy] = fingerprint_policy(server.url, policy, workloads, _streams(args),
                                                              args.max_tokens, args.out)
            for turn, users in enumerate(levels):
                for pass_index in range(args.passes):
                    order = policies if (block + turn + pass_index) % 2 == 0 else policies[::-1]
                    for policy in order:
                        set_policy(server.url, policy, args.k)
                        rows.append(_measure(server.url, policy, workload, users, args, duration, workdir,
                                             pass_index, progress))
    finally:
        server.stop()
    return rows, fingerprints


def sweep_per_policy(args, workloads, policies, levels, duration, workdir, progress) -> tuple[list, dict]:
    """A fresh server per (pass, workload, policy), policies in alternating order per workload; a policy's
    first server is also fingerprinted."""
    rows, fingerprints = [], {}
    blocks = [(index, workload) for index in range(args.passes) for workload in (workloads if levels else [None])]
    schedule = [(index, workload, policy) for turn, (index, workload) in enumerate(blocks)
                for policy in (policies if turn % 2 == 0 else policies[::-1])]
    for pass_index, workload, policy in schedule:
        progress.set_postfix_str(f"starting server ({policy}, {workload or 'fingerprints'}, pass {pass_index + 1})")
        server = Server(policy, args.k, workdir)
        try:
            if workload is not None:
                # warm-up, not measured: the first seconds of a new server run slow for every policy (run 7:
                # 55-74 tok/s at code c=1 in the first pass, 68-97 in the second)
                _warm_up(server.url, workload, args, workdir)
            for users in levels:
                rows.append(_measure(server.url, policy, workload, users, args, duration, workdir, pass_index,
                                     progress))
            if policy not in fingerprints:
                progress.set_postfix_str(f"fingerprint ({policy})")
                fingerprints[policy] = fingerprint_policy(server.url, policy, workloads, _streams(args),
                                                          args.max_tokens, args.out)
        finally:
            server.stop()
    return rows, fingerprints


def _streams(args) -> int:
    return args.fingerprint_streams or (3 if args.quick else 5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="json only, concurrency 1 and 4, 5 s per point")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sweep")
    parser.add_argument("--duration", type=float, default=None, help="seconds per point (default 20; quick 5)")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,2,4,8,16,32,64)")
    parser.add_argument("--workloads", default=None, help="comma-separated subset of code,json,prose")
    parser.add_argument("--policies", default="off,on,adaptive")
    parser.add_argument("--k", type=int, default=4, help="draft length of the always-on policy")
    parser.add_argument("--max-tokens", type=int, default=64, help="mean output budget per request")
    parser.add_argument("--max-tokens-spread", type=float, default=0.0,
                        help="each prompt's budget is drawn once from max-tokens × [1 − s, 1 + s] (0, the default: "
                             "all equal, closed-loop users in lockstep; see the locustfile's max_tokens_for)")
    parser.add_argument("--max-steal", type=float, default=0.02,
                        help="share of the machine's CPU time the hypervisor may take from a window (steal) "
                             "before the window is run again (default 0.02)")
    parser.add_argument("--steal-retries", type=int, default=2,
                        help="times a window is run again for steal; the least-stolen run is kept (default 2)")
    parser.add_argument("--fingerprint-streams", type=int, default=None,
                        help="streams per workload and policy (default 5; quick 3)")
    parser.add_argument("--fingerprint-only", action="store_true", help="skip the load points")
    parser.add_argument("--passes", type=int, default=1,
                        help="windows per policy and point (interleaved), or runs of the whole schedule "
                             "(per-policy); alternating order (2 = ABBA); merged per point")
    parser.add_argument("--layout", choices=("interleaved", "per-policy"), default="interleaved",
                        help="interleaved (default): one server, the policies take turns at each point; "
                             "per-policy: a fresh server per policy (instance-to-instance speed differs by up "
                             "to 30%% on this machine)")
    args = parser.parse_args(argv)
    duration = args.duration or (5.0 if args.quick else 20.0)
    levels = [int(c) for c in (args.concurrency or ("1,4" if args.quick else "1,2,4,8,16,32,64")).split(",")]
    workloads = (args.workloads or ("json" if args.quick else "code,json,prose")).split(",")
    policies = args.policies.split(",")
    unknown = [w for w in workloads if w not in USER_CLASS] + [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown workload/policy: {unknown}")
    if args.passes < 1:
        parser.error(f"--passes must be at least 1 (got {args.passes})")
    if not 0 <= args.max_tokens_spread < 1:
        parser.error(f"--max-tokens-spread must be in [0, 1) (got {args.max_tokens_spread})")
    if not 0 <= args.max_steal <= 1 or args.steal_retries < 0:
        parser.error(f"--max-steal must be in [0, 1] and --steal-retries at least 0 (got {args.max_steal}, "
                     f"{args.steal_retries})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep_stolen.csv").unlink(missing_ok=True)  # appended to window by window: this sweep's only

    from tqdm import tqdm

    from load_tests.intervals import ratio_intervals
    from load_tests.plots import plot_all
    from load_tests.sweep_results import COLUMNS, markdown_summary, merge_passes, ratios

    if args.fingerprint_only:
        levels = []
    progress = tqdm(total=args.passes * len(policies) * len(workloads) * len(levels), desc="sweep", unit="point")
    with tempfile.TemporaryDirectory() as scratch:
        run = sweep_interleaved if args.layout == "interleaved" else sweep_per_policy
        rows, fingerprints = run(args, workloads, policies, levels, duration, Path(scratch), progress)
    progress.close()
    (args.out / "fingerprints.json").write_text(json.dumps(fingerprints, indent=2))
    for policy, verdicts in fingerprints.items():
        for workload, figures in verdicts.items():
            print(f"[fingerprint] {policy} {workload}: {figures['verdict']} ({figures['tokens_per_chunk']:.2f} "
                  f"tokens/chunk, near-zero gaps {figures['near_zero_share']:.0%}, gap CV {figures['gap_cv']:.2f})")
    if args.fingerprint_only:
        return 0
    intervals = ratio_intervals(rows) if args.passes > 1 else {}
    if args.passes > 1:
        with open(args.out / "sweep_passes.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["pass"] + COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    rows = merge_passes(rows)
    with open(args.out / "sweep.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    figures = ratios(rows)
    for workload, figure in figures.items():  # how sure each ratio is (passes resampled; see intervals.py)
        figure["adaptive_vs_best_interval"] = intervals.get(workload, {})
    (args.out / "ratios.json").write_text(json.dumps(figures, indent=2))
    (args.out / "summary.md").write_text(markdown_summary(rows, figures))
    plots = plot_all(rows, args.out)
    for workload, figure in figures.items():
        spread = figure["adaptive_vs_best_interval"]
        best = ", ".join(f"c={c}: {v:.2f}" + (" [{:.2f}, {:.2f}]".format(*spread[c]) if c in spread else "")
                         for c, v in figure["adaptive_vs_best"].items())
        ttft = ", ".join(f"c={c}: {v:.2f}" for c, v in figure["ttft_on_vs_off"].items())
        on_off = figure["on_vs_off_at_top"]
        print(f"[{workload}] adaptive / max(off, on): {best}")
        print(f"[{workload}] on / off at c={levels[-1]}: {on_off:.2f}" if on_off else f"[{workload}] on / off: n/a")
        print(f"[{workload}] TTFT on / off: {ttft}")
    failures = sum(r["failures"] for r in rows)
    print(f"wrote {args.out / 'sweep.csv'} and {len(plots)} plots; {failures} failed requests")
    return 0 if failures == 0 and all(r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
