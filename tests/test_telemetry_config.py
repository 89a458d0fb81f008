"""Tracing is configured by the OTEL_* variables alone: off when unset, OTLP/HTTP or OTLP/gRPC when set.

Each case runs ``raysd.telemetry`` in a fresh interpreter (its provider is per process) that records one
span through a W3C carrier round trip, and a receiver in this test decodes what arrives.
"""

import subprocess
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

CHILD = """
from raysd import telemetry
tracer = telemetry.tracer("test")
print("enabled" if tracer is not None else "disabled")
if tracer is not None:
    with tracer.start_as_current_span("parent") as parent:
        carrier = telemetry.inject(parent)
    with telemetry.remote_span("raysd.verify", carrier, {"raysd.verify.rows": 3}):
        pass
    telemetry.flush()
"""


def _run(env: dict) -> str:
    base = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    result = subprocess.run([sys.executable, "-c", CHILD], env={**base, **env}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def _names(requests_: list) -> dict[str, dict]:
    spans = {}
    for export in requests_:
        for resource_spans in export.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans[span.name] = {"trace": span.trace_id, "id": span.span_id, "parent": span.parent_span_id}
    return spans


def _assert_child_of_parent(spans: dict) -> None:
    assert set(spans) == {"parent", "raysd.verify"}
    assert spans["raysd.verify"]["trace"] == spans["parent"]["trace"]
    assert spans["raysd.verify"]["parent"] == spans["parent"]["id"]  # the carrier crossed the "process" hop


def test_tracing_is_off_without_an_endpoint():
    assert _run({}) == "disabled"
    assert _run({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"}) == "disabled"
    assert _run({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_EXPORTER": "none"}) == "disabled"


def test_otlp_http_export():
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            export = trace_service_pb2.ExportTraceServiceRequest()
            export.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(export)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert _run({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}"}) == "enabled"
    finally:
        server.shutdown()
    _assert_child_of_parent(_names(received))


def test_otlp_grpc_export():
    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert _run({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                     "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "enabled"
    finally:
        server.stop(grace=None)
    _assert_child_of_parent(_names(received))


def test_an_unknown_protocol_is_refused_with_the_fix():
    with pytest.raises(AssertionError, match="http/protobuf or grpc"):
        _run({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"})
