"""OpenTelemetry tracing, configured only by the standard ``OTEL_*`` environment variables.

Tracing is on in a process when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)
is set and neither ``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none`` says otherwise. Then spans go
through a ``BatchSpanProcessor`` (exported in batches on its own thread, off the decoding path) to an OTLP
exporter: HTTP/protobuf by default, gRPC when ``OTEL_EXPORTER_OTLP_PROTOCOL`` (or ``..._TRACES_PROTOCOL``)
is ``grpc``. The SDK itself reads the rest: ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``_ARG``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_HEADERS``…

When off, ``tracer()`` returns ``None`` and callers skip span work entirely: no cost.

Context crosses Ray calls as a W3C ``traceparent`` carrier dict (``inject`` / ``extract``); every Ray
worker process that records spans calls ``tracer()`` itself (the env vars reach workers through the
app's ``runtime_env``, see ``otel_env``).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

_lock = threading.Lock()
_state: dict[str, Any] = {}
DEFAULT_SERVICE_NAME = "raysd"


def otel_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``OTEL_*`` variables to hand to Ray workers (so actors trace exactly as the driver was told)."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items() if name.startswith("OTEL_")}


def tracing_configured(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _exporter():
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or
                os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use http/protobuf or grpc")
    return OTLPSpanExporter()  # reads the endpoint, headers, timeout and compression from OTEL_* itself


def tracer(component: str = "raysd"):
    """This process's tracer, set up on first use from the environment; ``None`` when tracing is off."""
    with _lock:
        if "provider" not in _state:
            _state["provider"] = _make_provider() if tracing_configured() else None
        provider = _state["provider"]
    return provider.get_tracer(component) if provider is not None else None


def _make_provider():
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    defaults = {"process.pid": os.getpid()}  # which process (router, draft actor, target rank) recorded a span
    if not os.environ.get("OTEL_SERVICE_NAME"):
        defaults[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    resource = Resource.create(defaults)
    provider = TracerProvider(resource=resource)  # sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    atexit.register(provider.shutdown)  # flush what is buffered when the worker exits
    return provider


def flush(timeout_ms: int = 5000) -> None:
    provider = _state.get("provider")
    if provider is not None:
        provider.force_flush(timeout_ms)


def inject(span) -> dict[str, str]:
    """A ``traceparent`` carrier for ``span`` (to send along a Ray call); empty when ``span`` is None."""
    if span is None:
        return {}
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: dict[str, str] | None):
    """The context a carrier (or incoming HTTP headers) names; ``None`` when it names none."""
    if not carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({k.lower(): v for k, v in carrier.items()})


def span_link(span):
    from opentelemetry.trace import Link

    return Link(span.get_span_context())


class remote_span:
    """``with remote_span("raysd.verify", carrier, {...}) as span:`` in an actor: a child of the caller's
    span when tracing is on and the caller sent a context; otherwise does nothing (``span`` is None)."""

    def __init__(self, name: str, carrier: dict[str, str] | None, attributes: dict[str, Any] | None = None):
        self.name, self.carrier, self.attributes = name, carrier, attributes
        self._manager = None

    def __enter__(self):
        active = tracer("raysd.worker") if self.carrier else None
        if active is None:
            return None
        self._manager = active.start_as_current_span(self.name, context=extract(self.carrier),
                                                     attributes=self.attributes)
        return self._manager.__enter__()

    def __exit__(self, *exc):
        if self._manager is not None:
            return self._manager.__exit__(*exc)
        return False
