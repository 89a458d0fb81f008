"""Replica turnover on the real local Ray Serve: a whole-app redeploy and a crashed router replica.

The rule from the reliability issue: an in-flight stream either finishes — token-identical to the target
model alone — or ends promptly; it never hangs, and the app serves again afterwards.
"""

import json
import threading
import time

import pytest
import requests
from conftest import extra_app

from raysd.models import DEMO_DRAFT, DEMO_TARGET

pytestmark = pytest.mark.slow
MODEL = "raysd-demo"
PROMPT = "Once upon a time"
APP = {
    "target": {"model_dir": str(DEMO_TARGET), "max_model_len": 1024, "max_num_seqs": 8},
    "draft": {"model_dir": str(DEMO_DRAFT), "max_model_len": 1024, "max_num_seqs": 8},
    "router": {"engine": {"max_model_len": 1024, "max_num_seqs": 4},
               "policy": {"mode": "adaptive", "warmup_rounds": 2}},
}


@pytest.fixture(scope="module")
def rollout_url(serve_url):
    with extra_app(serve_url, "rollout", APP) as url:
        yield url


def _reference(url: str, max_tokens: int) -> list[int]:
    """Greedy output with speculation off for this request: the target model alone."""
    response = requests.post(f"{url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "return_token_ids": True, "speculation": "off"})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _stream(url: str, max_tokens: int):
    return requests.post(f"{url}/v1/completions", stream=True, timeout=120, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
        "return_token_ids": True, "stream": True})


def _target_workers(url: str) -> list[dict]:
    return requests.get(f"{url}/health", timeout=30).json()["workers"]["targets"]


def test_redeploy_mid_stream_finishes_the_stream_on_the_old_replicas(rollout_url):
    """A new config rolls out (Serve replaces router, monitor, draft and target replicas: the app's args
    changed) while a long stream is in flight. The old router keeps the stream, the old target group drains
    it — even though the replaced monitor's first views list no workers — and the output is unchanged."""
    from ray import serve

    from raysd.serve.app import build_app
    from raysd.serve.config import ServerConfig

    max_tokens = 400  # ~12 s undisturbed; the rollout's new replicas starting on 2 cores slow it 2-3x
    expected = _reference(rollout_url, max_tokens)
    old_ids = {w["worker_id"] for w in _target_workers(rollout_url)}
    new_config = ServerConfig.model_validate({**APP, "router": {**APP["router"], "max_waiting": 7}})
    rollout_started, rolled_out = [], threading.Event()

    def roll_out():
        rollout_started.append(time.monotonic())  # Serve marks the old replicas stopping at once
        serve.run(build_app(new_config), name="raysd-rollout", route_prefix="/rollout")
        rolled_out.set()

    token_ids, events = [], []
    with _stream(rollout_url, max_tokens) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line.decode())
            if line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                token_ids += chunk["choices"][0].get("token_ids", []) if chunk.get("choices") else []
            if len(events) == 1:
                threading.Thread(target=roll_out, daemon=True).start()
    ended = time.monotonic()
    assert not any('"error"' in e for e in events), events[-3:]
    assert events[-1] == "data: [DONE]"
    assert token_ids == expected
    # the stream outlived the start of the rollout by seconds: it was finished by replicas being replaced
    assert rollout_started and ended - rollout_started[0] > 3.0
    assert rolled_out.wait(180)
    deadline, ids = time.monotonic() + 60, set()
    while time.monotonic() < deadline:  # the old group leaves the registry once it stops heartbeating
        ids = {w["worker_id"] for w in _target_workers(rollout_url)}
        if ids and not ids & old_ids:
            break
        time.sleep(1.0)
    assert ids and not ids & old_ids  # the target group really was replaced
    assert _reference(rollout_url, 32) == expected[:32]  # and the new replicas serve


def test_killed_router_ends_its_streams_promptly_and_a_new_one_serves(rollout_url):
    """A crash (``ray.kill``) of the router replica: its in-flight stream ends at once — the connection
    closes without ``[DONE]``, nothing hangs — Serve starts a new router that serves identical output, and
    the dead router's cache rows in the workers are freed (its sequences are orphans)."""
    import ray

    expected = _reference(rollout_url, 64)
    received, ended_cleanly, started = 0, False, time.monotonic()
    with _stream(rollout_url, 400) as response:
        try:
            for line in response.iter_lines():
                if line == b"data: [DONE]":
                    ended_cleanly = True
                elif line and received == 0:
                    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                             if "::raysd-rollout#Router#" in a["name"]]
                    assert len(names) == 1
                    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
                received += bool(line)
        except requests.exceptions.RequestException:
            pass  # the connection was cut: what a client sees of a crashed server
    assert not ended_cleanly and received < 400
    assert time.monotonic() - started < 60  # ended, not hung until a timeout
    deadline, status = time.monotonic() + 120, None
    while time.monotonic() < deadline:
        try:
            response = requests.post(f"{rollout_url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True})
            status = response.status_code
            if status == 200:
                break
        except requests.exceptions.RequestException:
            pass
        time.sleep(1.0)
    assert status == 200
    assert response.json()["choices"][0]["token_ids"] == expected
    # the dead router's sequence held a cache row in the target; once the monitor declares that router
    # departed, the next calls from the new router free it
    deadline, held = time.monotonic() + 90, None
    while time.monotonic() < deadline:
        _reference(rollout_url, 4)  # traffic from the new router carries the departed list
        held = sum(w["held_by_worker"] for w in _target_workers(rollout_url))
        if held == 0:
            break
        time.sleep(2.0)
    assert held == 0
