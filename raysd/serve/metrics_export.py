"""Exporter layer of the metrics (round stats → Prometheus), vLLM's names under our prefix.

Two sinks get the same figures: a ``prometheus_client`` registry that GET /metrics renders (one router's
view), and Ray's metrics (``ray.serve.metrics``, tagged by Ray with deployment/replica; scraped from each
node's Ray metrics port with Ray's ``ray_`` prefix), which sum over router replicas.

PromQL (per segment; add ``sum by (segment)`` over routers):
- acceptance rate:
  ``rate(raysd:spec_decode_num_accepted_tokens_total[5m]) / rate(raysd:spec_decode_num_draft_tokens_total[5m])``
- mean acceptance length (tokens per speculative round, bonus included):
  ``1 + rate(raysd:spec_decode_num_accepted_tokens_total[5m]) / rate(raysd:spec_decode_num_drafts_total[5m])``
- acceptance at draft position p: ``rate(raysd:spec_decode_num_accepted_tokens_per_pos_total{position="p"}[5m])
  / rate(raysd:spec_decode_num_drafts_total[5m])``
- p95 time to first token:
  ``histogram_quantile(0.95, sum by (le) (rate(raysd:time_to_first_token_seconds_bucket[5m])))``

Inter-token latency is observed once per burst (the gap before a burst of accepted + 1 tokens), vLLM v1's
per-step convention; a speculating stream shows long gaps and fewer observations per token.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from raysd.metrics import RoundStats

logger = logging.getLogger("raysd.metrics")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
SPEC_COUNTERS = (("num_drafts", "Speculative sequence-rounds (k >= 1)."),
                 ("num_draft_tokens", "Drafted tokens."),
                 ("num_accepted_tokens", "Drafted tokens the target accepted."),
                 ("num_emitted_tokens", "Tokens emitted (accepted + bonus)."))


class _RayMirror:
    """The same series through ``ray.serve.metrics`` (only inside a Ray worker; silently absent outside).
    Ray's metric names may not contain ':', so there they read ``raysd_spec_decode_…`` (Ray adds ``ray_``)."""

    def __init__(self):
        from ray.serve import metrics as base

        class ray_metrics:  # noqa: N801 - same call sites as the module, names made Ray-safe
            Counter = staticmethod(lambda name, *a, **k: base.Counter(name.replace(":", "_"), *a, **k))
            Gauge = staticmethod(lambda name, *a, **k: base.Gauge(name.replace(":", "_"), *a, **k))
            Histogram = staticmethod(lambda name, *a, **k: base.Histogram(name.replace(":", "_"), *a, **k))

        self.counters = {name: ray_metrics.Counter(f"raysd:spec_decode_{name}", text, tag_keys=("segment",))
                         for name, text in SPEC_COUNTERS}
        self.per_pos = ray_metrics.Counter("raysd:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted drafted tokens by draft position.",
                                           tag_keys=("segment", "position"))
        self.ttft = ray_metrics.Histogram("raysd:time_to_first_token_seconds", "Time to first token.",
                                          boundaries=list(TTFT_BUCKETS), tag_keys=("segment",))
        self.itl = ray_metrics.Histogram("raysd:inter_token_latency_seconds", "Gap before each burst.",
                                         boundaries=list(ITL_BUCKETS), tag_keys=("segment",))
        self.running = ray_metrics.Gauge("raysd:num_requests_running", "Sequences in the batch.")
        self.waiting = ray_metrics.Gauge("raysd:num_requests_waiting", "Sequences queued.")
        self.enabled = ray_metrics.Gauge("raysd:speculation_enabled", "1 when speculation is on.",
                                         tag_keys=("reason",))
        self.fallbacks = ray_metrics.Counter("raysd:draft_fallbacks", "Draft calls that failed (k=0 rounds).")


class ServingMetrics:
    def __init__(self, mirror_to_ray: bool = True):
        self.registry = CollectorRegistry()
        self.counters = {name: Counter(f"raysd:spec_decode_{name}", text, ["segment"], registry=self.registry)
                         for name, text in SPEC_COUNTERS}
        self.per_pos = Counter("raysd:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted drafted tokens by draft position (0 = first drafted token).",
                               ["segment", "position"], registry=self.registry)
        self.ttft = Histogram("raysd:time_to_first_token_seconds", "Request arrival to first token.",
                              ["segment"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("raysd:inter_token_latency_seconds", "Gap before each burst of tokens.",
                             ["segment"], buckets=ITL_BUCKETS, registry=self.registry)
        self.running = Gauge("raysd:num_requests_running", "Sequences in the batch.", registry=self.registry)
        self.waiting = Gauge("raysd:num_requests_waiting", "Sequences queued.", registry=self.registry)
        self.pressure = Gauge("raysd:cluster_pressure", "Cluster-wide sequences per verify step (all routers).",
                              registry=self.registry)
        self.enabled = Gauge("raysd:speculation_enabled", "1 when speculation is on; the label says why.",
                             ["reason"], registry=self.registry)
        self.fallbacks = Counter("raysd:draft_fallbacks", "Draft calls that failed; their rows decoded with k=0.",
                                 registry=self.registry)
        self.aborted = Counter("raysd:requests_aborted", "Requests whose client disconnected before the end "
                               "(their sequences left the batch and their cache slots were freed).",
                               registry=self.registry)
        self._fallbacks_seen = 0
        self._aborted_seen = 0
        self.ray = None
        if mirror_to_ray:
            try:
                self.ray = _RayMirror()
            except Exception as error:  # not inside Ray: the registry alone
                logger.debug("Ray metrics unavailable: %s", error)

    def record_round(self, stats: RoundStats) -> None:
        for segment, drafted, accepted, emitted in zip(stats.segments, stats.drafted, stats.accepted, stats.emitted):
            values = {"num_drafts": int(drafted > 0), "num_draft_tokens": drafted,
                      "num_accepted_tokens": accepted if drafted else 0, "num_emitted_tokens": emitted}
            for name, value in values.items():
                if value:
                    self.counters[name].labels(segment=segment).inc(value)
                    if self.ray is not None:
                        self.ray.counters[name].inc(value, tags={"segment": segment})
            for position in range(accepted if drafted else 0):
                self.per_pos.labels(segment=segment, position=str(position)).inc()
                if self.ray is not None:
                    self.ray.per_pos.inc(1, tags={"segment": segment, "position": str(position)})

    def observe_ttft(self, segment: str, seconds: float) -> None:
        self.ttft.labels(segment=segment).observe(seconds)
        if self.ray is not None:
            self.ray.ttft.observe(seconds, tags={"segment": segment})

    def observe_gap(self, segment: str, seconds: float) -> None:
        self.itl.labels(segment=segment).observe(seconds)
        if self.ray is not None:
            self.ray.itl.observe(seconds, tags={"segment": segment})

    def update_state(self, state: dict) -> None:
        """Gauges and the fallback counter from the round loop's ``state()``."""
        self.running.set(state["running"])
        self.waiting.set(state["waiting"])
        self.pressure.set(state.get("cluster_pressure", state["pressure"]))
        self.enabled.clear()
        self.enabled.labels(reason=state["reason"]).set(int(state["speculation_on"]))
        new_fallbacks = state["draft_failures"] - self._fallbacks_seen
        if new_fallbacks > 0:
            self.fallbacks.inc(new_fallbacks)
            self._fallbacks_seen = state["draft_failures"]
        new_aborted = state["aborted"] - self._aborted_seen
        if new_aborted > 0:
            self.aborted.inc(new_aborted)
            self._aborted_seen = state["aborted"]
        if self.ray is not None:
            self.ray.running.set(state["running"])
            self.ray.waiting.set(state["waiting"])
            self.ray.enabled.set(int(state["speculation_on"]), tags={"reason": state["reason"]})
            if new_fallbacks > 0:
                self.ray.fallbacks.inc(new_fallbacks)

    def render(self, state: dict) -> bytes:
        self.update_state(state)
        return generate_latest(self.registry)
