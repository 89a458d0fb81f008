"""Round spans for a batched round: each request's trace shows its own rounds, the batch work appears once.

A round serves every sequence in the batch with one draft call and one verify call. Each traced request
gets its own ``raysd.round`` span (child of its request span) carrying *its* figures (k, drafted, accepted,
emitted, reason, segment) and the round's shared ones (batch size, pressure, round index). The draft and
verify work spans, recorded inside the draft and target actors, are children of one of them only — the
round span of the first traced sequence in the batch (``raysd.round.carries_work = true``); every other
request's round span has a span link to that one. So the work is never duplicated, and a request whose
round span does not carry the work still points at where it was recorded (same ``raysd.round.index``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raysd.metrics import RoundStats
from raysd.telemetry import inject, span_link, tracer


@dataclass
class RoundSpans:
    by_row: dict[int, Any]  # batch row → its request's round span
    carrier: dict[str, str]  # traceparent of the span the actors' work spans go under


class RoundTracer:
    def __init__(self):
        self.tracer = tracer("raysd.router")
        self.index = 0

    def start(self, request_spans: list[Any | None]) -> RoundSpans | None:
        """Open round spans for the rows whose request is traced (``request_spans[row]`` or None)."""
        self.index += 1
        if self.tracer is None or not any(span is not None for span in request_spans):
            return None
        from opentelemetry import trace

        by_row: dict[int, Any] = {}
        lead = None
        for row, parent in enumerate(request_spans):
            if parent is None:
                continue
            context = trace.set_span_in_context(parent)
            attributes = {"raysd.round.index": self.index, "raysd.round.carries_work": lead is None}
            links = [span_link(lead)] if lead is not None else None
            by_row[row] = self.tracer.start_span("raysd.round", context=context, attributes=attributes, links=links)
            lead = lead or by_row[row]
        return RoundSpans(by_row, inject(lead))

    @staticmethod
    def end(spans: RoundSpans | None, stats: RoundStats | None, error: str | None = None) -> None:
        """Close the round's spans with each row's figures from the committed round's stats."""
        if spans is None:
            return
        from opentelemetry.trace import Status, StatusCode

        for row, span in spans.by_row.items():
            if stats is not None:
                span.set_attributes({
                    "raysd.round.k": stats.ks[row], "raysd.round.drafted": stats.drafted[row],
                    "raysd.round.accepted": stats.accepted[row], "raysd.round.emitted": stats.emitted[row],
                    "raysd.round.batch_size": stats.batch_size, "raysd.policy.reason": stats.reasons[row],
                    "raysd.segment": stats.segments[row], "raysd.round.pressure": stats.pressure,
                    "raysd.round.draft_seconds": stats.draft_seconds,
                    "raysd.round.verify_seconds": stats.verify_seconds})
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()
