"""Is an OpenAI-compatible endpoint speculating? Read it from the outside, from the stream's pacing.

Plain decoding emits one token per target step: chunks arrive at a steady pace, one token each.
Speculative decoding emits ``accepted + 1`` tokens per step: either several tokens in one chunk (raysd
sends a burst as one chunk) or several chunks back to back (servers that split bursts per token), then a
longer gap. So three figures, over the gaps between content chunks after the first:

- ``tokens_per_chunk``: output tokens / content chunks (from ``usage`` or per-chunk ``token_ids``);
- ``near_zero_share``: share of gaps shorter than ``NEAR_ZERO_FRACTION`` × the median gap (or 2 ms);
- ``gap_cv``: coefficient of variation of the gaps (bursts of varying size make it large).

Verdict: "speculation likely" when tokens per chunk ≥ 1.3, or near-zero gaps are ≥ 20% of all gaps;
"speculation unlikely" otherwise. A single short stream can mislead: use ``n`` ≥ 3 and ≥ 32 tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

NEAR_ZERO_FRACTION = 0.15
NEAR_ZERO_FLOOR_S = 0.002
TOKENS_PER_CHUNK_THRESHOLD = 1.3
NEAR_ZERO_SHARE_THRESHOLD = 0.2


@dataclass
class StreamTiming:
    """One streamed completion: arrival time (s, from request start) and token count of each content chunk."""

    arrivals: list[float] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)  # None: the chunk did not say
    total_tokens: int | None = None  # from the final usage chunk, when sent


@dataclass
class Fingerprint:
    streams: int
    chunks: int
    output_tokens: int
    tokens_per_chunk: float
    near_zero_share: float
    gap_cv: float
    median_gap_ms: float
    ttft_ms: float
    verdict: str
    gaps_ms: list[float]

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "gaps_ms"}


def analyse(streams: list[StreamTiming]) -> Fingerprint:
    """Burstiness figures and the verdict for a set of streams (pure; see the module docstring)."""
    gaps, chunks, tokens, ttfts = [], 0, 0, []
    for stream in streams:
        if not stream.arrivals:
            continue
        ttfts.append(stream.arrivals[0])
        gaps += [b - a for a, b in zip(stream.arrivals, stream.arrivals[1:])]
        chunks += len(stream.arrivals)
        counted = stream.total_tokens if stream.total_tokens is not None else None
        if counted is None:
            counted = sum(t if t is not None else 1 for t in stream.tokens)
        tokens += counted
    if chunks == 0:
        raise ValueError("no content chunks were received; check the URL, model and that streaming works")
    median = statistics.median(gaps) if gaps else 0.0
    threshold = max(NEAR_ZERO_FLOOR_S, NEAR_ZERO_FRACTION * median)
    near_zero = sum(gap < threshold for gap in gaps) / len(gaps) if gaps else 0.0
    mean = statistics.fmean(gaps) if gaps else 0.0
    cv = statistics.pstdev(gaps) / mean if len(gaps) > 1 and mean > 0 else 0.0
    per_chunk = tokens / chunks
    bursty = per_chunk >= TOKENS_PER_CHUNK_THRESHOLD or near_zero >= NEAR_ZERO_SHARE_THRESHOLD
    return Fingerprint(len(streams), chunks, tokens, per_chunk, near_zero, cv, 1000 * median,
                       1000 * statistics.median(ttfts), "speculation likely" if bursty else "speculation unlikely",
                       [1000 * gap for gap in gaps])


def record_stream(url: str, model: str, prompt: str, max_tokens: int, api_key: str | None = None,
                  timeout_s: float = 300, headers: dict[str, str] | None = None) -> StreamTiming:
    """Stream one completion from ``url`` (the server root, e.g. http://127.0.0.1:8000) and time its chunks."""
    import requests

    headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    timing = StreamTiming()
    started = time.perf_counter()
    with requests.post(f"{url.rstrip('/')}/v1/completions", json=body, headers=headers, stream=True,
                       timeout=timeout_s) as response:
        if response.status_code != 200:
            raise ValueError(f"{url} answered HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines(chunk_size=None):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                timing.total_tokens = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids")
                if choice.get("text") or ids:
                    timing.arrivals.append(time.perf_counter() - started)
                    timing.tokens.append(len(ids) if ids is not None else None)
    return timing


def plot(fingerprint: Fingerprint, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 3.5))
    bursty = fingerprint.verdict == "speculation likely"
    axis.hist(fingerprint.gaps_ms, bins=40, color="tab:red" if bursty else "tab:gray")
    axis.set_xlabel("gap between streamed chunks (ms)")
    axis.set_ylabel("gaps")
    axis.set_title(f"{title}\n{fingerprint.verdict}: {fingerprint.tokens_per_chunk:.2f} tokens/chunk, "
                   f"near-zero gaps {fingerprint.near_zero_share:.0%}, CV {fingerprint.gap_cv:.2f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
