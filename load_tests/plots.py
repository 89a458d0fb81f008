"""PNG plots of a sweep (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"off": "tab:gray", "on": "tab:red", "adaptive": "tab:blue"}


def _series(rows, policy, workload, key):
    points = sorted((r["concurrency"], r[key]) for r in rows
                    if r["policy"] == policy and r["workload"] == workload and r[key] is not None)
    return [p[0] for p in points], [p[1] for p in points]


def _per_workload(rows, out: Path, name: str, title: str, ylabel: str, draw) -> Path:
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        draw(axis, workload)
        axis.set_title(workload)
        if any(len(line.get_xdata()) for line in axis.lines if line.get_xdata() is not None and
               not line.get_label().startswith("_")):  # e.g. a TTFT ratio needs "off" in the sweep
            axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency (closed-loop users)")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(rows: list[dict], out: Path) -> list[Path]:
    policies = [p for p in ("off", "on", "adaptive") if any(r["policy"] == p for r in rows)]

    def throughput(axis, workload):
        for policy in policies:
            axis.plot(*_series(rows, policy, workload, "tokens_per_s"), "o-", color=COLORS[policy], label=policy)

    def latency(axis, workload):
        for policy in policies:
            axis.plot(*_series(rows, policy, workload, "latency_p50_s"), "o-", color=COLORS[policy],
                      label=f"{policy} p50")
            axis.plot(*_series(rows, policy, workload, "latency_p95_s"), "s--", color=COLORS[policy],
                      label=f"{policy} p95", alpha=0.6)

    def ttft_ratio(axis, workload):
        xs, off = _series(rows, "off", workload, "ttft_p50_s")
        baseline = dict(zip(xs, off))
        for policy in [p for p in policies if p != "off"]:
            x, y = _series(rows, policy, workload, "ttft_p50_s")
            pairs = [(c, v / baseline[c]) for c, v in zip(x, y) if baseline.get(c)]
            axis.plot([p[0] for p in pairs], [p[1] for p in pairs], "o-", color=COLORS[policy], label=f"{policy} / off")
        axis.axhline(1.0, color="black", lw=0.8)
        axis.axhspan(0.95, 1.05, color="green", alpha=0.1, label="±5%")

    def acceptance(axis, workload):
        for policy in [p for p in policies if p != "off"]:
            axis.plot(*_series(rows, policy, workload, "acceptance_rate"), "o-", color=COLORS[policy], label=policy)
        axis.set_ylim(0, 1)

    paths = [
        _per_workload(rows, out, "throughput", "Output tokens/s vs concurrency", "tokens/s", throughput),
        _per_workload(rows, out, "latency", "Request latency (64 tokens)", "seconds", latency),
        _per_workload(rows, out, "ttft_ratio", "Time to first token, speculation / off (p50)", "ratio", ttft_ratio),
        _per_workload(rows, out, "acceptance", "Draft acceptance rate (server-reported)", "accepted / drafted",
                      acceptance),
    ]
    gap_files = sorted(out.glob("gaps-*-*.json"))
    if gap_files:
        workloads = sorted({f.stem.split("-", 2)[2] for f in gap_files})
        fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
        for axis, workload in zip(axes[0], workloads):
            for policy in ("off", "on"):
                path = out / f"gaps-{policy}-{workload}.json"
                if path.exists():
                    gaps = [1000 * g for g in json.loads(path.read_text())["gaps_s"]]
                    if gaps:
                        axis.hist(gaps, bins=40, alpha=0.55, color=COLORS[policy], label=f"{policy} (n={len(gaps)})")
            axis.set_title(f"{workload}, concurrency 1")
            axis.set_xlabel("gap between streamed chunks (ms)")
            axis.set_ylabel("chunks")
            axis.legend(fontsize=8)
        fig.suptitle("Gaps between streamed chunks: speculation sends\nfewer, longer-spaced bursts", fontsize=10)
        fig.tight_layout()
        paths.append(out / "itl_hist.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
