"""Traces over real OTLP/HTTP to a receiver in the test, and Prometheus counters on GET /metrics.

The receiver decodes the exporters' protobuf (``ExportTraceServiceRequest``) exactly as a collector would.
A second app (``/traced``) runs on the session's Ray with the OTEL_* variables pointing at it.
"""

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from conftest import extra_app
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from raysd.models import DEMO_DRAFT, DEMO_TARGET

pytestmark = pytest.mark.slow
MODEL = "raysd-demo"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver():
    """An OTLP/HTTP trace endpoint: decodes every export into plain span dicts."""
    spans: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            export = ExportTraceServiceRequest()
            export.ParseFromString(body)
            for resource_spans in export.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        spans.append({"name": span.name, "trace_id": span.trace_id.hex(),
                                      "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                                      "attributes": {a.key: _value(a.value) for a in span.attributes},
                                      "links": [link.span_id.hex() for link in span.links],
                                      "pid": resource.get("process.pid"), "service": resource.get("service.name"),
                                      "duration_ms": (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6})
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", spans
    server.shutdown()


@pytest.fixture(scope="module")
def traced_url(serve_url, receiver):
    config = {
        "target": {"model_dir": str(DEMO_TARGET), "max_model_len": 512,
                   "placement": {"resources": {"target_device": 1}}},
        "draft": {"model_dir": str(DEMO_DRAFT), "max_model_len": 512, "placement": {"resources": {"draft_device": 1}}},
        "router": {"engine": {"max_model_len": 512, "max_num_seqs": 16}, "policy": {"mode": "on", "k": 4}},
    }
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver[0], "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_SERVICE_NAME": "raysd-test", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with extra_app(serve_url, "traced", config, telemetry_env=env) as url:
        yield url


def _wait_for(spans, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [s for s in list(spans) if predicate(s)]
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError("expected spans never arrived")


def _complete(url, headers=None, **body):
    payload = {"model": MODEL, "temperature": 0, "max_tokens": 24, "ignore_eos": True, **body}
    response = requests.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_request_trace_shows_rounds_with_draft_and_verify_from_their_processes(traced_url, receiver):
    _, spans = receiver
    body = _complete(traced_url, headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"},
                     prompt='{"order_id": "ord_1", "items": [')
    (request,) = _wait_for(spans, lambda s: s["trace_id"] == TRACE_ID and s["name"] == f"text_completion {MODEL}")
    assert request["parent"] == CALLER_SPAN_ID  # the caller's traceparent is continued
    attrs = request["attributes"]
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.usage.output_tokens"] == 24 and attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert attrs["gen_ai.request.max_tokens"] == 24 and attrs["gen_ai.request.temperature"] == 0
    time.sleep(1.0)  # actor spans are exported by their own processes' batch processors
    trace = [s for s in spans if s["trace_id"] == TRACE_ID]
    rounds = [s for s in trace if s["name"] == "raysd.round"]
    assert len(rounds) == body["speculation"]["num_rounds"] >= 2
    assert all(r["parent"] == request["span_id"] for r in rounds)
    assert sum(r["attributes"]["raysd.round.accepted"] for r in rounds) == body["speculation"][
        "num_accepted_draft_tokens"]
    assert sum(r["attributes"]["raysd.round.emitted"] for r in rounds) == 24
    assert all({"raysd.round.k", "raysd.round.batch_size", "raysd.policy.reason", "raysd.segment"}
               <= set(r["attributes"]) for r in rounds)
    round_ids = {r["span_id"] for r in rounds}
    drafts = [s for s in trace if s["name"] == "raysd.draft"]
    verifies = [s for s in trace if s["name"] == "raysd.verify"]
    assert drafts and len(verifies) == len(rounds)  # one verify per round; drafts where k > 0
    assert all(s["parent"] in round_ids for s in drafts + verifies)
    pids = {request["pid"], drafts[0]["pid"], verifies[0]["pid"]}
    assert len(pids) == 3  # router, draft actor and target rank: three processes, one trace


def test_batched_round_work_is_recorded_once_and_linked(traced_url, receiver):
    _, spans = receiver
    trace_ids = ["%032x" % (0xABC0 + i) for i in range(2)]
    threads = [threading.Thread(target=_complete, args=(traced_url,), kwargs={
        "headers": {"traceparent": f"00-{trace_id}-{CALLER_SPAN_ID}-01"}, "prompt": "def parse(line):\n",
        "max_tokens": 40}) for trace_id in trace_ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for trace_id in trace_ids:
        _wait_for(spans, lambda s, t=trace_id: s["trace_id"] == t and s["name"].startswith("text_completion"))
    time.sleep(1.0)
    rounds = [s for s in spans if s["name"] == "raysd.round" and s["trace_id"] in trace_ids]
    shared = {}
    for span in rounds:
        shared.setdefault(span["attributes"]["raysd.round.index"], []).append(span)
    batched = [group for group in shared.values() if len(group) == 2]
    assert batched, "the two requests never shared a round"
    for group in batched:
        carrier = [s for s in group if s["attributes"]["raysd.round.carries_work"]]
        other = [s for s in group if not s["attributes"]["raysd.round.carries_work"]]
        assert len(carrier) == 1 and len(other) == 1 and other[0]["links"] == [carrier[0]["span_id"]]
        work = [s for s in spans if s["parent"] == carrier[0]["span_id"] and s["name"] == "raysd.verify"]
        assert len(work) == 1 and work[0]["attributes"]["raysd.verify.rows"] == 2  # one forward for both
        assert not [s for s in spans if s["parent"] == other[0]["span_id"]]  # not duplicated


def _samples(url):
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_move_by_exactly_the_request_counts_under_its_segment(serve_url):
    segment = "completions:raysd-demo:metricsprobe"
    before = _samples(serve_url)
    stats = _complete(serve_url, prompt='{"id": 1, "name": ', max_tokens=32,
                      metadata={"workload": "metricsprobe"}, speculation="auto")["speculation"]
    after = _samples(serve_url)

    def delta(name, **labels):
        key = (name, tuple(sorted({"segment": segment, **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("raysd:spec_decode_num_draft_tokens_total") == stats["num_draft_tokens"]
    assert delta("raysd:spec_decode_num_accepted_tokens_total") == stats["num_accepted_draft_tokens"]
    assert delta("raysd:spec_decode_num_drafts_total") == stats["num_spec_steps"]
    assert delta("raysd:spec_decode_num_emitted_tokens_total") == 32
    assert delta("raysd:time_to_first_token_seconds_count") == 1
    assert delta("raysd:inter_token_latency_seconds_count") == stats["num_rounds"] - 1  # one gap per burst
    first_position = delta("raysd:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert first_position <= stats["num_spec_steps"]
    assert ("raysd:num_requests_running", ()) in after
    assert any(name == "raysd:speculation_enabled" for name, _ in after)


def test_grafana_dashboard_queries_only_metrics_we_export(serve_url):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "deployments/grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"raysd:[a-z_:]+", target["expr"])}
    exported = requests.get(f"{serve_url}/metrics", timeout=30).text
    missing = sorted(name for name in queried if f"\n{name}" not in exported and f"# TYPE {name}" not in exported)
    assert len(queried) >= 8 and not missing, missing
