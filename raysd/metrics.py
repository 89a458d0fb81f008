"""Speculation metrics in three layers: per-round stats → per-segment aggregate → exporters.

Counters are kept, rates derived. In Prometheus (names as vLLM's, our prefix):
- acceptance rate of a segment:
  ``rate(raysd:spec_decode_num_accepted_tokens_total[5m]) / rate(raysd:spec_decode_num_draft_tokens_total[5m])``
- mean acceptance length (tokens per speculative round, bonus included):
  ``1 + rate(raysd:spec_decode_num_accepted_tokens_total[5m]) / rate(raysd:spec_decode_num_drafts_total[5m])``
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RoundStats:
    """What one round did. Lists are per sequence, in batch order."""

    segments: list[str]
    ks: list[int]  # k asked of the drafter
    drafted: list[int]  # tokens actually proposed (n-gram may propose fewer)
    accepted: list[int]
    emitted: list[int]  # tokens appended (≤ accepted + 1 at a stop)
    reasons: list[str]
    draft_seconds: float
    verify_seconds: float
    prefill_seconds: float
    round_seconds: float
    pressure: float
    speculation_on: bool
    verify_tokens: int

    @property
    def batch_size(self) -> int:
        return len(self.segments)


@dataclass
class SegmentTotals:
    num_drafts: int = 0  # speculative (k ≥ 1) sequence-rounds
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: Counter = field(default_factory=Counter)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class SpecDecodeAggregator:
    """Accumulates ``RoundStats`` into per-segment totals (what the exporters read)."""

    def __init__(self):
        self.segments: dict[str, SegmentTotals] = {}
        self.rounds = 0
        self.round_seconds = 0.0  # wall time of rounds, plan to commit
        self.model_seconds = 0.0  # of which drafting, prefill and verification took (measured where they ran)

    def add(self, stats: RoundStats) -> None:
        self.rounds += 1
        self.round_seconds += stats.round_seconds
        self.model_seconds += stats.draft_seconds + stats.prefill_seconds + stats.verify_seconds
        for segment, drafted, accepted, emitted in zip(stats.segments, stats.drafted, stats.accepted,
                                                       stats.emitted):
            totals = self.segments.setdefault(segment, SegmentTotals())
            totals.num_emitted_tokens += emitted
            if drafted > 0:
                totals.num_drafts += 1
                totals.num_draft_tokens += drafted
                totals.num_accepted_tokens += accepted
                for position in range(accepted):
                    totals.accepted_per_position[position] += 1

    def timing(self) -> dict[str, float | int]:
        """Mean round time and its overhead: what is not model work (scheduling, and remote-call hops when
        the draft and verify ran in other processes)."""
        rounds = max(self.rounds, 1)
        return {"rounds": self.rounds, "round_seconds": self.round_seconds, "model_seconds": self.model_seconds,
                "mean_round_ms": 1000 * self.round_seconds / rounds,
                "mean_model_ms": 1000 * self.model_seconds / rounds,
                "mean_overhead_ms": 1000 * (self.round_seconds - self.model_seconds) / rounds}

    def summary(self) -> dict[str, dict]:
        return {
            segment: {"num_drafts": t.num_drafts, "num_draft_tokens": t.num_draft_tokens,
                      "num_accepted_tokens": t.num_accepted_tokens, "acceptance_rate": t.acceptance_rate,
                      "mean_acceptance_length": t.mean_acceptance_length}
            for segment, t in sorted(self.segments.items())
        }
