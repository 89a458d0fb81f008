"""The product as users meet it: a real local Ray Serve app on the demo pair, over real HTTP."""

import json
import threading
import time

import pytest
import requests
import torch
from conftest import extra_app

from raysd.models import DEMO_DRAFT, DEMO_TARGET

pytestmark = pytest.mark.slow
MODEL = "raysd-demo"
PROMPTS = ['{"order_id": "ord_1234567", "customer_id": ', "def parse_header(line):\n    ",
           "The meaning of the word"]


@pytest.fixture(scope="module")
def server(serve_url):
    return serve_url


@pytest.fixture(scope="module")
def tp2_server(server):
    """A second app on the same cluster: the target sharded over 2 rank actors (DeepSpeed AutoTP, gloo)."""
    config = {
        "target": {"model_dir": str(DEMO_TARGET), "max_model_len": 512, "tp_size": 2,
                   "placement": {"resources": {"target_device": 1}}},
        "draft": {"model_dir": str(DEMO_DRAFT), "max_model_len": 512,
                  "placement": {"resources": {"draft_device": 1}}},
        "router": {"engine": {"max_model_len": 512, "max_num_seqs": 16},
                   "policy": {"mode": "on", "k": 4}, "target_timeout_s": 60.0},
    }
    with extra_app(server, "tp2", config) as url:
        yield url


@pytest.fixture(scope="module")
def references(demo_pair):
    """Target-only greedy continuations (transformers generate) of PROMPTS, 40 tokens each."""
    refs = {}
    for prompt in PROMPTS:
        ids = demo_pair.tokenizer.encode(prompt)
        with torch.no_grad():
            inputs = torch.tensor([ids])
            out = demo_pair.target.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                            max_new_tokens=40, min_new_tokens=40,
                                            pad_token_id=demo_pair.tokenizer.pad_token_id)
        refs[prompt] = out[0, len(ids):].tolist()
    return refs


def _complete(url, **body):
    payload = {"model": MODEL, "temperature": 0, "max_tokens": 40, "ignore_eos": True, "return_token_ids": True,
               **body}
    return requests.post(f"{url}/v1/completions", json=payload, timeout=120)


def test_greedy_completions_are_token_identical_to_target_only(server, references):
    for prompt, expected in references.items():
        response = _complete(server, prompt=prompt)
        assert response.status_code == 200, response.text
        body = response.json()
        choice = body["choices"][0]
        assert choice["token_ids"] == expected
        assert body["usage"]["completion_tokens"] == 40
        assert body["speculation"]["num_rounds"] >= 1 and "policy_reason" in body["speculation"]
        by_reason = body["speculation"]["rounds_by_reason"]  # why each round drafted or not: every round counted once
        assert sum(by_reason.values()) == body["speculation"]["num_rounds"] and by_reason["prefill"] == 1
    # a segment no earlier test used: its warm-up drafts whatever this machine's timings make of the costs
    stats = _complete(server, prompt=PROMPTS[0], metadata={"workload": "json-fresh"}).json()["speculation"]
    assert stats["segment"] == f"completions:{MODEL}:json-fresh"
    assert stats["num_draft_tokens"] > 0  # speculation really ran through the draft worker


def test_tensor_parallel_target_equals_single_rank_token_for_token(server, tp2_server, references):
    for prompt, expected in references.items():
        tp1 = _complete(server, prompt=prompt).json()["choices"][0]["token_ids"]
        response = _complete(tp2_server, prompt=prompt)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["token_ids"] == tp1 == expected
        assert body["speculation"]["num_draft_tokens"] > 0  # drafts verified by the sharded target
    targets = requests.get(f"{tp2_server}/health", timeout=30).json()["workers"]["targets"]
    assert [t["actors"] for t in targets] == [2]  # one group of two rank actors


def test_streaming_framing_and_usage(server):
    payload = {"model": MODEL, "prompt": PROMPTS[1], "temperature": 0, "max_tokens": 24, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"{server}/v1/completions", json=payload, stream=True, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line.decode() for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    plain = _complete(server, prompt=PROMPTS[1], max_tokens=24).json()["choices"][0]["text"]
    assert text == plain


def test_chat_completions_and_models(server):
    models = requests.get(f"{server}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == MODEL
    response = requests.post(f"{server}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8,
        "temperature": 0}, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 8


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 5}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    response = requests.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_non_json_body_is_400(server):
    response = requests.post(f"{server}/v1/completions", data=b"\xff\xfe not json", timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_cluster_pressure_turns_speculation_off_and_back_on(server):
    from ray import serve

    monitor = serve.get_deployment_handle("ClusterMonitor", app_name="raysd")
    stop = threading.Event()

    def flood():  # another source reporting load, as a second router under traffic would
        while not stop.is_set():
            monitor.report.remote("synthetic-load", 100.0).result()
            time.sleep(0.1)

    worker = threading.Thread(target=flood, daemon=True)
    worker.start()
    try:
        time.sleep(1.0)  # routers refresh the cluster figure every 0.2 s
        stats = _complete(server, prompt=PROMPTS[0], max_tokens=16).json()["speculation"]
        assert stats["num_draft_tokens"] == 0 and stats["policy_reason"] == "pressure"
        assert stats["rounds_by_reason"] == {"prefill": 1, "pressure": stats["num_rounds"] - 1}
        assert requests.get(f"{server}/health", timeout=30).json()["reason"] == "pressure"
    finally:
        stop.set()
        worker.join()
    monitor.report.remote("synthetic-load", 0.0).result()
    time.sleep(1.0)
    stats = _complete(server, prompt=PROMPTS[0], max_tokens=16).json()["speculation"]
    # the gate is open again: the segment's acceptance and the measured costs decide k now (which way they go
    # depends on this machine's timings; any of the model's own reasons, not the gate's)
    assert stats["policy_reason"] in {"adaptive", "warmup", "probe", "low_acceptance", "measured_slower",
                                      "measure_plain"}, stats
    health = requests.get(f"{server}/health", timeout=30).json()
    assert health["speculation_on"] and health["reason"] == "ok"
    assert health["policy"]["speculation_on"] and health["policy"]["cost"]["round_cost"]["0"] == 1.0
    assert health["policy"]["segments"], "the policy's per-segment acceptance is visible on /health"


def test_the_gate_reads_this_routers_load_now_and_the_others_as_last_reported():
    """The cluster pressure a round is decided on is the other routers' last reports plus this router's own
    load at that moment: a step in its own load reaches the gate in the same round, not at its next report."""
    from types import SimpleNamespace

    from raysd.serve.ingress import Router

    engine = SimpleNamespace(running=[object()] * 20, waiting=[])
    router = object.__new__(Router)
    router.loop = SimpleNamespace(engine=engine)
    router.other_routers_pressure = 5.0
    assert router.local_pressure == 20 and router.cluster_pressure == 25
    engine.running, engine.waiting = [object()] * 32, [object()] * 4  # a load step, no report in between
    assert router.cluster_pressure == 41


def test_admin_policy_switch_reaches_every_round_and_output_stays_identical(server, references):
    """``PUT /v1/admin/policy`` switches the running cluster's speculation without a restart; each mode drafts
    as it says, greedy output is the target's own in every one, and bad changes get OpenAI errors."""
    url = f"{server}/v1/admin/policy"
    configured = requests.get(url, timeout=30).json()
    assert configured["policy"]["mode"] == "adaptive"
    prompt, expected = PROMPTS[1], references[PROMPTS[1]]
    try:
        for change, drafts in (({"mode": "off"}, False), ({"mode": "on", "k": 2}, True)):
            response = requests.put(url, json=change, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["policy"]["mode"] == change["mode"] and response.json()["version"] >= 1
            body = _complete(server, prompt=prompt).json()
            assert body["choices"][0]["token_ids"] == expected, change
            assert (body["speculation"]["num_draft_tokens"] > 0) == drafts, body["speculation"]
            if drafts:  # k = 2: a round emits at most 3 tokens
                assert body["speculation"]["num_rounds"] >= 40 / 3
        assert requests.get(url, timeout=30).json()["policy"]["k"] == 2
        for bad, param in (({"mode": "sideways"}, "mode"), ({"k": 99}, "k"), ({"pressure_low": 100}, None),
                           ({"pressure_reopen_s": -1}, "pressure_reopen_s"), ({"surprise": 1}, "surprise")):
            response = requests.put(url, json=bad, timeout=30)
            assert response.status_code == 400, (bad, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
        assert requests.put(url, data=b"not json", timeout=30).json()["error"]["code"] == "invalid_json"
        assert requests.get(url, timeout=30).json()["policy"]["k"] == 2  # refused changes changed nothing
        # a change made through another router reaches this one with the cluster view (every 0.2 s)
        from ray import serve

        monitor = serve.get_deployment_handle("ClusterMonitor", app_name="raysd")
        version = monitor.set_policy.remote({**configured["policy"], "mode": "off"}).result()
        time.sleep(1.0)
        state = requests.get(url, timeout=30).json()
        assert state["version"] == version and state["policy"]["mode"] == "off"
    finally:
        restored = requests.put(url, json={}, timeout=30)  # every field back to its configured value
    assert restored.status_code == 200 and restored.json()["policy"] == configured["policy"]


def test_killed_draft_replica_mid_stream_keeps_output_identical(server, references):
    import ray

    prompt = PROMPTS[1]
    payload = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 40, "ignore_eos": True,
               "stream": True, "return_token_ids": True, "speculation": "auto"}
    token_ids = []
    with requests.post(f"{server}/v1/completions", json=payload, stream=True, timeout=180) as response:
        lines = response.iter_lines()
        killed = False
        for line in lines:
            if not line or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            token_ids += chunk["choices"][0].get("token_ids", [])
            if not killed:
                names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                         if "::raysd#DraftWorker#" in a["name"]]  # this app's, not raysd-tp2's
                assert names, "no draft replica found"
                ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
                killed = True
    assert token_ids == references[prompt]
    health = requests.get(f"{server}/health", timeout=30).json()
    assert health["draft_failures"] >= 1
    deadline = time.monotonic() + 90  # Serve replaces the replica; its new draft actor registers and is used
    while time.monotonic() < deadline:
        stats = _complete(server, prompt=PROMPTS[0], max_tokens=16, metadata={"workload": "json"}).json()["speculation"]
        if stats["num_draft_tokens"] > 0:
            break
        time.sleep(1.0)
    assert stats["num_draft_tokens"] > 0, "speculation did not resume after the draft replica came back"


def test_killed_target_rank_fails_its_request_with_a_retryable_error_then_recovers(tp2_server, references):
    """Runs last on the TP=2 app: killing rank 1 mid-stream ends the stream with an error event (no hang:
    the read timeout is below the router's target timeout), then the replaced group serves again."""
    import ray
    from ray import serve

    view = serve.get_deployment_handle("ClusterMonitor", app_name="raysd-tp2").view.remote().result()
    (group,) = [w for w in view.workers.values() if w.kind == "target"]
    payload = {"model": MODEL, "prompt": PROMPTS[2], "temperature": 0, "max_tokens": 300, "ignore_eos": True,
               "stream": True}
    events = []
    with requests.post(f"{tp2_server}/v1/completions", json=payload, stream=True, timeout=20) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                events.append(line.decode())
                if len(events) == 1:
                    ray.kill(group.actors[1])
    assert events[-1] == "data: [DONE]"
    errors = [json.loads(e[6:])["error"] for e in events if e.startswith("data: {") and '"error"' in e]
    assert errors and errors[0]["code"] == "worker_unavailable" and "retry" in errors[0]["message"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # Serve replaces the replica; a fresh group rendezvous and registers
        response = _complete(tp2_server, prompt=PROMPTS[0])
        if response.status_code == 200:
            break
        assert response.status_code == 503 and response.json()["error"]["code"] == "worker_unavailable"
        time.sleep(2.0)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == references[PROMPTS[0]]
