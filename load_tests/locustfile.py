"""Locust load for raysd (or any OpenAI-compatible server): code, JSON and prose users, streaming.

    locust -f load_tests/locustfile.py --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000 --csv out
    locust -f load_tests/locustfile.py JsonUser ...        # one workload only

Each user is closed-loop (a new request as soon as the last one ends), so users = concurrency. Prompts are
the held-out prompts of ``bench/prompts/heldout.jsonl`` (never seen in training), tagged with their workload
(``metadata.workload``) so the server tracks acceptance per workload. Each user takes its workload's prompts
in a fixed order (user i of a run starts at prompt i and goes round the pool), so two runs with the same
users send the same requests: a sweep compares policies on the same prompts, not on two random draws of a
pool whose prompts draft very differently. Besides the HTTP request entry (``response_length`` = output
tokens), each request reports, as their own entries per workload: ``ttft [w]`` (time to the first token,
ms), ``itl [w]`` (one entry per gap between chunks, ms) and ``output_tokens_per_s [w]`` (the value is
reported as the entry's "response time").

Settings (environment): RAYSD_MODEL (default raysd-demo), RAYSD_MAX_TOKENS (64), RAYSD_MAX_TOKENS_SPREAD
(ratio r in [0, 1), default 0: each prompt asks for its own ``max_tokens`` drawn once, uniformly from
RAYSD_MAX_TOKENS × [1 − r, 1 + r]; see ``max_tokens_for``), RAYSD_PROMPTS (a JSONL
path), RAYSD_PROMPT_ORDER (``cycle``, the default, or ``random``: draw each prompt at random),
RAYSD_REQUEST_TIMEOUT (seconds without a byte before a request counts as hung, default 120),
RAYSD_LOCUST_DUMP (write raw per-chunk timings, token counts, speculation stats — rounds per policy reason
summed over requests too — and failure reasons to this JSON file when the run stops; the sweep and chaos
scripts read it; arrival times are ``time.perf_counter()`` of the Locust process, each chunk's tokens the mean
of its request's chunks), RAYSD_RECORD_OUTPUTS=1 (ask for ``return_token_ids``, a vLLM/raysd extension, and
keep each completed request's prompt and token ids).

Run Locust as its own process: importing it into a process that already imported ray/torch breaks gevent.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from pathlib import Path

from locust import HttpUser, constant, events, task

MODEL = os.environ.get("RAYSD_MODEL", "raysd-demo")
MAX_TOKENS = int(os.environ.get("RAYSD_MAX_TOKENS", "64"))
try:
    MAX_TOKENS_SPREAD = float(os.environ.get("RAYSD_MAX_TOKENS_SPREAD", "0"))
except ValueError:
    MAX_TOKENS_SPREAD = -1.0
if not 0 <= MAX_TOKENS_SPREAD < 1:
    raise SystemExit(f"RAYSD_MAX_TOKENS_SPREAD must be a number in [0, 1) "
                     f"(got {os.environ.get('RAYSD_MAX_TOKENS_SPREAD')!r})")
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "heldout.jsonl"
PROMPTS_PATH = Path(os.environ.get("RAYSD_PROMPTS", DEFAULT_PROMPTS))
DUMP_PATH = os.environ.get("RAYSD_LOCUST_DUMP")
REQUEST_TIMEOUT_S = float(os.environ.get("RAYSD_REQUEST_TIMEOUT", "120"))
RECORD_OUTPUTS = os.environ.get("RAYSD_RECORD_OUTPUTS") == "1"
PROMPT_ORDER = os.environ.get("RAYSD_PROMPT_ORDER", "cycle")
if PROMPT_ORDER not in ("cycle", "random"):
    raise SystemExit(f"RAYSD_PROMPT_ORDER must be 'cycle' or 'random' (got {PROMPT_ORDER!r})")
_records = [json.loads(line) for line in PROMPTS_PATH.read_text().splitlines() if line.strip()]
PROMPTS = {w: [r["prompt"] for r in _records if r.get("workload") == w] for w in ("code", "json", "prose")}
RAW: dict[str, dict] = {}  # workload → raw figures for RAYSD_LOCUST_DUMP
_USER_NUMBERS: dict[str, itertools.count] = {}  # workload → numbers handed to its users, in start order


def max_tokens_for(prompt_index: int, max_tokens: int = MAX_TOKENS, spread: float = MAX_TOKENS_SPREAD) -> int:
    """The output budget of the pool's prompt ``prompt_index``: ``max_tokens`` when ``spread`` is 0, else drawn
    uniformly from ``max_tokens × [1 − spread, 1 + spread]`` by a generator seeded with the index, so a prompt
    asks for the same length in every run (policies compare on the same requests) while the prompts a batch
    holds differ. Equal budgets keep closed-loop users in lockstep: a batch ends in one round and its users'
    next prompts are prefilled together; with a spread requests end at different rounds, as real traffic's
    do, and are prefilled a few at a time (prose at 32 users, speculation off: 281–310 tok/s with spread 0.5
    against 342–350 in lockstep, on this machine)."""
    if spread == 0:
        return max_tokens
    low, high = max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))
    return random.Random(prompt_index).randint(low, high)


def _raw(workload: str) -> dict:
    return RAW.setdefault(workload, {"ttft_s": [], "gaps_s": [], "tokens_per_chunk": [], "requests": 0,
                                     "failures": 0, "output_tokens": 0, "latency_s": [], "num_draft_tokens": 0,
                                     "num_accepted_draft_tokens": 0, "first_at": None, "last_at": None,
                                     "failure_reasons": [], "failure_at": [], "outputs": [], "chunk_at": [],
                                     "chunk_tokens": [], "rounds_by_reason": {}})


@events.test_stop.add_listener
def _dump(environment, **kwargs):
    if DUMP_PATH:
        Path(DUMP_PATH).write_text(json.dumps(RAW))


class _StreamingUser(HttpUser):
    abstract = True
    wait_time = constant(0)
    workload = "default"

    def on_start(self) -> None:
        self._next_prompt = next(_USER_NUMBERS.setdefault(self.workload, itertools.count()))

    def _prompt(self) -> tuple[str, int]:
        """The user's next prompt and its ``max_tokens``: round its workload's pool from its own start (or at
        random)."""
        pool = PROMPTS[self.workload]
        if PROMPT_ORDER == "random":
            index = random.randrange(len(pool))
        else:
            index = self._next_prompt % len(pool)
            self._next_prompt += 1
        return pool[index], max_tokens_for(index)

    def _report(self, name: str, value_ms: float, length: int = 0) -> None:
        events.request.fire(request_type="STREAM", name=f"{name} [{self.workload}]", response_time=value_ms,
                            response_length=length, exception=None, context={})

    @task
    def stream_completion(self) -> None:
        prompt, max_tokens = self._prompt()
        payload = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                   "metadata": {"workload": self.workload}}
        if RECORD_OUTPUTS:
            payload["return_token_ids"] = True
        raw = _raw(self.workload)
        started = time.perf_counter()
        arrivals, usage, speculation, token_ids = [], None, None, []

        def fail(response, reason: str) -> None:
            raw["failures"] += 1
            raw["failure_reasons"].append(reason)
            raw["failure_at"].append(time.time())
            response.failure(reason)

        with self.client.post("/v1/completions", json=payload, stream=True, catch_response=True,
                              timeout=(10, REQUEST_TIMEOUT_S),
                              name=f"POST /v1/completions [{self.workload}]") as response:
            if response.status_code != 200:
                return fail(response, f"HTTP {response.status_code}: {response.text[:200]}")
            try:
                for line in response.iter_lines(chunk_size=None):
                    if not line or not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return fail(response, f"stream error: {chunk['error'].get('message')}")
                    if chunk.get("usage"):
                        usage, speculation = chunk["usage"], chunk.get("speculation")
                        continue
                    choice = chunk["choices"][0] if chunk.get("choices") else {}
                    token_ids += choice.get("token_ids") or []
                    if choice.get("text"):
                        arrivals.append(time.perf_counter())
            except Exception as error:  # connection dropped or read timed out mid-stream
                return fail(response, f"{type(error).__name__}: {error}")
            ended = time.perf_counter()
            tokens = usage["completion_tokens"] if usage else len(arrivals)
            response.request_meta["response_length"] = tokens
            response.success()
        if not arrivals:
            return
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        self._report("ttft", 1000 * (arrivals[0] - started))
        for gap in gaps:
            self._report("itl", 1000 * gap)
        self._report("output_tokens_per_s", tokens / max(ended - started, 1e-9), tokens)
        raw["requests"] += 1
        raw["output_tokens"] += tokens
        raw["ttft_s"].append(arrivals[0] - started)
        raw["gaps_s"] += gaps
        raw["latency_s"].append(ended - started)
        raw["tokens_per_chunk"].append(tokens / len(arrivals))
        raw["chunk_at"] += arrivals  # when each chunk arrived, with the request's mean tokens per chunk
        raw["chunk_tokens"] += [tokens / len(arrivals)] * len(arrivals)
        raw["first_at"] = started if raw["first_at"] is None else min(raw["first_at"], started)
        raw["last_at"] = ended if raw["last_at"] is None else max(raw["last_at"], ended)
        if RECORD_OUTPUTS:
            raw["outputs"].append({"prompt": payload["prompt"], "token_ids": token_ids})
        if speculation:
            raw["num_draft_tokens"] += speculation.get("num_draft_tokens") or 0
            raw["num_accepted_draft_tokens"] += speculation.get("num_accepted_draft_tokens") or 0
            for reason, rounds in (speculation.get("rounds_by_reason") or {}).items():
                raw["rounds_by_reason"][reason] = raw["rounds_by_reason"].get(reason, 0) + rounds


class CodeUser(_StreamingUser):
    workload = "code"


class JsonUser(_StreamingUser):
    workload = "json"


class ProseUser(_StreamingUser):
    workload = "prose"
