"""What a sweep's windows add up to: rows of ``sweep_passes.csv`` / ``sweep.csv``, passes merged, the ratios the
claims rest on and the docs' tables. Pure (no server, no Locust): ``sweep.py`` measures, this reads.

A row is one window (or, merged, one point): policy, workload, concurrency, counts, tokens over the window
(``window_tokens``), latency / TTFT / inter-token percentiles, tokens per chunk, acceptance and the policy's
round reasons (``round_reasons.py``).
"""

from __future__ import annotations

import statistics

from load_tests import round_reasons

COLUMNS = ["policy", "workload", "concurrency", "requests", "failures", "output_tokens", "seconds",
           "window_tokens", "window_seconds", "tokens_per_s", "latency_p50_s", "latency_p95_s", "ttft_p50_s",
           "ttft_p95_s", "itl_p50_s", "itl_p95_s", "tokens_per_chunk", "acceptance_rate", "steal_share", "runs",
           "round_reasons"]  # the last: JSON, the policy's reason → rounds (``round_reasons.py``)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def window_tokens(raw: dict, window_s: float | None) -> tuple[float, float]:
    """``(tokens, seconds)`` streamed while all users were running: chunks that arrived in the first
    ``window_s`` seconds from the first request's start (completed requests' chunks, each worth its request's
    mean tokens per chunk). None: the whole run, first request's start to last request's end.

    Locust stops starting requests after ``-t`` and waits for the ones in flight, so the end of a run drains:
    concurrency falls from c to 0, and it falls at different paces per policy: a policy that decodes a batch
    in lockstep (speculation off, equal max_tokens) ends all its requests in one round, one that speculates
    ends them one by one, running ever smaller batches for up to a request's length (2–3 s at c = 16 here,
    of a 12 s window). Counted in, that tail is throughput at less than c."""
    if not raw.get("requests"):
        return 0.0, 0.0
    whole = raw["last_at"] - raw["first_at"]
    if window_s is None or not raw.get("chunk_at"):
        return float(raw.get("output_tokens", 0)), whole
    end = raw["first_at"] + window_s
    tokens = sum(count for at, count in zip(raw["chunk_at"], raw["chunk_tokens"]) if at <= end)
    return tokens, min(window_s, whole)


def summarise(policy: str, workload: str, users: int, raw: dict, window_s: float | None = None) -> dict:
    """One window's row of ``sweep_passes.csv``; ``tokens_per_s`` is over the window (``window_tokens``)."""
    seconds = (raw["last_at"] - raw["first_at"]) if raw.get("requests") else 0.0
    drafted = raw.get("num_draft_tokens", 0)
    tokens, window_seconds = window_tokens(raw, window_s)
    return {
        "policy": policy, "workload": workload, "concurrency": users, "requests": raw.get("requests", 0),
        "failures": raw.get("failures", 0), "output_tokens": raw.get("output_tokens", 0), "seconds": seconds,
        "window_tokens": tokens, "window_seconds": window_seconds,
        "tokens_per_s": tokens / window_seconds if window_seconds else 0.0,
        "latency_p50_s": _percentile(raw.get("latency_s", []), 0.5),
        "latency_p95_s": _percentile(raw.get("latency_s", []), 0.95),
        "ttft_p50_s": _percentile(raw.get("ttft_s", []), 0.5), "ttft_p95_s": _percentile(raw.get("ttft_s", []), 0.95),
        "itl_p50_s": _percentile(raw.get("gaps_s", []), 0.5), "itl_p95_s": _percentile(raw.get("gaps_s", []), 0.95),
        "tokens_per_chunk": statistics.fmean(raw["tokens_per_chunk"]) if raw.get("tokens_per_chunk") else None,
        "acceptance_rate": raw.get("num_accepted_draft_tokens", 0) / drafted if drafted else None,
        "round_reasons": round_reasons.encode(raw.get("rounds_by_reason")),
    }


def merge_passes(rows: list[dict]) -> list[dict]:
    """One row per (policy, workload, concurrency) from several passes' rows: counts, tokens and seconds are
    summed (so tokens/s is over all passes' windows); percentiles, tokens/chunk and acceptance are the mean of
    the passes' values (approximate for percentiles); the policy's round reasons are summed."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["policy"], row["workload"], row["concurrency"]), []).append(row)
    merged = []
    for (policy, workload, users), group in groups.items():
        row = {"policy": policy, "workload": workload, "concurrency": users}
        for key in ("requests", "failures", "output_tokens", "seconds", "window_tokens", "window_seconds"):
            row[key] = sum(r[key] for r in group)
        row["tokens_per_s"] = row["window_tokens"] / row["window_seconds"] if row["window_seconds"] else 0.0
        for key in COLUMNS[COLUMNS.index("tokens_per_s") + 1:COLUMNS.index("round_reasons")]:
            values = [r[key] for r in group if r[key] is not None]
            row[key] = statistics.fmean(values) if values else None
        row["round_reasons"] = round_reasons.merge([r.get("round_reasons") for r in group])
        merged.append(row)
    return merged


def ratios(rows: list[dict]) -> dict:
    """The figures the claims rest on, per workload."""
    table = {(r["policy"], r["workload"], r["concurrency"]): r for r in rows}
    workloads = sorted({r["workload"] for r in rows})
    levels = sorted({r["concurrency"] for r in rows})
    result = {}
    for workload in workloads:
        def value(policy, users, key="tokens_per_s", w=workload):
            row = table.get((policy, w, users))
            return row[key] if row and row[key] else None

        adaptive_vs_best = {}
        ttft_on, ttft_adaptive = {}, {}
        for users in levels:
            off, on, adaptive = value("off", users), value("on", users), value("adaptive", users)
            if off and on and adaptive:
                adaptive_vs_best[users] = adaptive / max(off, on)
            ttft_off = value("off", users, "ttft_p50_s")
            if ttft_off and value("on", users, "ttft_p50_s"):
                ttft_on[users] = value("on", users, "ttft_p50_s") / ttft_off
            if ttft_off and value("adaptive", users, "ttft_p50_s"):
                ttft_adaptive[users] = value("adaptive", users, "ttft_p50_s") / ttft_off
        top = levels[-1]
        off_top, on_top = value("off", top), value("on", top)
        result[workload] = {"adaptive_vs_best": adaptive_vs_best,
                            "on_vs_off_at_top": on_top / off_top if off_top and on_top else None,
                            "ttft_on_vs_off": ttft_on, "ttft_adaptive_vs_off": ttft_adaptive}
    return result


def markdown_summary(rows: list[dict], figures: dict) -> str:
    """Tables for docs: output tokens/s per policy and concurrency, the ratios, TTFT, acceptance, tokens per chunk
    and why adaptive's rounds drafted or not (``round_reasons.py``)."""
    levels = sorted({r["concurrency"] for r in rows})
    table = {(r["policy"], r["workload"], r["concurrency"]): r for r in rows}
    lines = []
    for workload, figure in figures.items():
        lines += [f"### {workload}", "", "| | " + " | ".join(f"c={c}" for c in levels) + " |",
                  "|---|" + "---|" * len(levels)]
        for policy in ("off", "on", "adaptive"):
            cells = [table.get((policy, workload, c)) for c in levels]
            if any(cells):
                lines.append(f"| {policy} tok/s | " + " | ".join(f"{r['tokens_per_s']:.0f}" if r else "" for r in cells)
                             + " |")
        for label, key in (("adaptive / max(off, on)", "adaptive_vs_best"), ("TTFT on / off", "ttft_on_vs_off"),
                           ("TTFT adaptive / off", "ttft_adaptive_vs_off")):
            values = figure[key]
            lines.append(f"| {label} | " + " | ".join(f"{values[c]:.2f}" if c in values else "" for c in levels)
                         + " |")
            spread = figure.get(f"{key}_interval") or {}
            if spread:
                lines.append("| 90% interval (passes resampled) | " + " | ".join(
                    "{:.2f}–{:.2f}".format(*spread[c]) if c in spread else "" for c in levels) + " |")
        for policy in ("on", "adaptive"):
            cells = [table.get((policy, workload, c)) for c in levels]
            if any(cells):
                lines.append(f"| {policy} acceptance | " + " | ".join(
                    f"{r['acceptance_rate']:.2f}" if r and r["acceptance_rate"] is not None else "–" for r in cells)
                    + " |")
        for policy in ("off", "on", "adaptive"):
            cells = [table.get((policy, workload, c)) for c in levels]
            if any(cells):
                lines.append(f"| {policy} tokens/chunk | " + " | ".join(
                    f"{r['tokens_per_chunk']:.2f}" if r and r["tokens_per_chunk"] else "" for r in cells) + " |")
        cells = [table.get(("adaptive", workload, c)) for c in levels]
        if any(cell and cell.get("round_reasons") for cell in cells):
            lines.append(round_reasons.markdown_row("adaptive", [cell and cell.get("round_reasons") for cell in cells]))
        lines.append("")
    return "\n".join(lines)
