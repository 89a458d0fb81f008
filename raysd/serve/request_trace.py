"""The request span: one per HTTP generation request, following the OpenTelemetry GenAI conventions.

Name ``"{gen_ai.operation.name} {gen_ai.request.model}"`` (``text_completion raysd-demo`` / ``chat
raysd-demo``), kind SERVER, a child of the caller's span when the request carries a W3C ``traceparent``.
Round spans (``round_trace.py``) go under it. Prompt and completion text are never recorded.
"""

from __future__ import annotations

from typing import Any

from raysd.telemetry import extract, tracer


def start_request_span(headers, operation: str, parsed, prompt_tokens: int, segment: str) -> Any | None:
    """Open the request span (``None`` when tracing is off)."""
    active = tracer("raysd.router")
    if active is None:
        return None
    from opentelemetry.trace import SpanKind

    attributes = {
        "gen_ai.operation.name": operation, "gen_ai.system": "raysd", "gen_ai.request.model": parsed.model,
        "gen_ai.request.temperature": parsed.temperature, "gen_ai.request.top_p": parsed.top_p,
        "gen_ai.usage.input_tokens": prompt_tokens, "raysd.segment": segment,
        "raysd.request.stream": bool(parsed.stream), "raysd.request.speculation": parsed.speculation,
    }
    max_tokens = getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens
    if max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = max_tokens
    if parsed.seed is not None:
        attributes["gen_ai.request.seed"] = parsed.seed
    return active.start_span(f"{operation} {parsed.model}", context=extract(dict(headers)), kind=SpanKind.SERVER,
                             attributes=attributes)


def end_request_span(span, output_tokens: int, finish_reason: str | None, stats: dict | None,
                     error: str | None = None) -> None:
    """Close the request span with usage, finish reason and the request's speculation figures."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    if finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
    for name, value in (stats or {}).items():
        if value is not None:
            span.set_attribute(f"raysd.speculation.{name}", value)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
