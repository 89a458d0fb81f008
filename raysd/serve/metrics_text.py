"""Prometheus text for GET /metrics, from the router's aggregates (vLLM's names, our prefix).

Acceptance rate of a segment:
  rate(raysd:spec_decode_num_accepted_tokens_total[5m]) / rate(raysd:spec_decode_num_draft_tokens_total[5m])
Mean acceptance length:
  1 + rate(raysd:spec_decode_num_accepted_tokens_total[5m]) / rate(raysd:spec_decode_num_drafts_total[5m])
"""

from __future__ import annotations


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(loop) -> str:
    lines = []
    counters = (("num_drafts", "num_drafts", "Speculative sequence-rounds."),
                ("num_draft_tokens", "num_draft_tokens", "Drafted tokens."),
                ("num_accepted_tokens", "num_accepted_tokens", "Drafted tokens the target accepted."),
                ("num_emitted_tokens", "num_emitted_tokens", "Tokens emitted (accepted + bonus)."))
    segments = loop.engine.aggregator.segments
    for name, attribute, help_text in counters:
        metric = f"raysd:spec_decode_{name}_total"
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        for segment, totals in sorted(segments.items()):
            lines.append(f'{metric}{{segment="{_label(segment)}"}} {getattr(totals, attribute)}')
    metric = "raysd:spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {metric} Accepted drafted tokens by position in the draft.", f"# TYPE {metric} counter"]
    for segment, totals in sorted(segments.items()):
        for position, count in sorted(totals.accepted_per_position.items()):
            lines.append(f'{metric}{{segment="{_label(segment)}",position="{position}"}} {count}')
    state = loop.state()
    lines += ["# HELP raysd:num_requests_running Sequences in the batch.", "# TYPE raysd:num_requests_running gauge",
              f"raysd:num_requests_running {state['running']}",
              "# HELP raysd:num_requests_waiting Sequences queued.", "# TYPE raysd:num_requests_waiting gauge",
              f"raysd:num_requests_waiting {state['waiting']}",
              "# HELP raysd:speculation_enabled 1 when speculation is on.", "# TYPE raysd:speculation_enabled gauge",
              f'raysd:speculation_enabled{{reason="{state["reason"]}"}} {int(state["speculation_on"])}',
              "# HELP raysd:draft_fallbacks_total Rounds decoded without drafts after a draft failure.",
              "# TYPE raysd:draft_fallbacks_total counter", f"raysd:draft_fallbacks_total {state['draft_failures']}"]
    return "\n".join(lines) + "\n"
