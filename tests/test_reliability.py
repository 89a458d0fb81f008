"""Refusals, overload, disconnects and authentication on the real local Ray Serve app.

Every refusal is a 4xx/503 in the OpenAI error shape, the server stays healthy afterwards, and nothing
already accepted is lost.
"""

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from conftest import extra_app, small_target_app

pytestmark = pytest.mark.slow
MODEL = "raysd-demo"
KEY = "test-secret-key"
GUARDED = small_target_app(max_waiting=2, api_key=KEY)


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("body,status,param", [
    ({"model": MODEL, "prompt": 123}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": [1, 2]}, 400, "stop.list[str].0"),
    ({"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": "maybe"}}, 400,
     "stream_options.include_usage"),
    ({"model": MODEL, "prompt": "x", "speculation": "always"}, 400, "speculation"),
    ({"model": MODEL, "prompt": " ".join(map(str, range(2000)))}, 400, "prompt"),  # > the 512-token context
    ({"model": MODEL, "prompt": [99999999]}, 400, "prompt"),  # token id outside the vocabulary
    ({"model": MODEL, "prompt": "x", "metadata": {"workload": "../../etc"}}, 400, "metadata.workload"),
])
def test_bad_fields_are_4xx_in_the_openai_shape(serve_url, body, status, param):
    error = _error(requests.post(f"{serve_url}/v1/completions", json=body, timeout=30), status)
    assert error["param"] == param or (error["param"] or "").startswith(param.split(".")[0])


def test_malformed_bodies_and_huge_bodies_are_refused(serve_url):
    url = f"{serve_url}/v1/completions"
    assert _error(requests.post(url, data=b'{"model": "raysd-demo", "prompt": "x"', timeout=30), 400)["code"] == \
        "invalid_json"
    assert _error(requests.post(url, data=b"[1, 2]", timeout=30), 400)["code"] == "invalid_json"
    assert _error(requests.post(url, data=b"\xc3\x28\xa0\xa1", timeout=30), 400)["code"] == "invalid_json"
    huge = json.dumps({"model": MODEL, "prompt": "x" * 1_200_000}).encode()
    assert _error(requests.post(url, data=huge, timeout=60), 413)["code"] == "request_too_large"
    assert _error(requests.get(f"{serve_url}/v1/nothing", timeout=30), 404)["code"] == "not_found"
    chat = requests.post(f"{serve_url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    _error(chat, 400)
    assert requests.get(f"{serve_url}/health", timeout=30).json()["status"] == "ok"  # still healthy


@pytest.fixture(scope="module")
def guarded_url(serve_url):
    """A small app on the session's Ray: API key, 2 batch slots, at most 2 waiting (no draft: quick start)."""
    with extra_app(serve_url, "guarded", GUARDED) as url:
        yield url


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_key_is_required_everywhere_but_health(guarded_url):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        error = _error(requests.post(f"{guarded_url}/v1/completions", json=body, headers=headers, timeout=30), 401)
        assert error["code"] == "invalid_api_key" and KEY not in json.dumps(error)
    _error(requests.get(f"{guarded_url}/v1/models", timeout=30), 401)
    _error(requests.get(f"{guarded_url}/metrics", timeout=30), 401)
    assert requests.get(f"{guarded_url}/health", timeout=30).status_code == 200
    assert requests.post(f"{guarded_url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    assert requests.get(f"{guarded_url}/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_overload_gets_fast_503_with_retry_after_and_accepted_requests_complete(guarded_url):
    results = []

    def call():
        response = requests.post(f"{guarded_url}/v1/completions", headers=AUTH, timeout=180, json={
            "model": MODEL, "prompt": "The meaning of", "max_tokens": 48, "ignore_eos": True, "temperature": 0})
        results.append(response)

    threads = [threading.Thread(target=call) for _ in range(12)]
    for thread in threads:
        thread.start()
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    accepted = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 503]
    assert len(accepted) + len(refused) == 12 and accepted and refused
    for response in refused:
        assert response.headers["Retry-After"] == "1" and response.json()["error"]["code"] == "overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in accepted)  # nothing accepted was lost
    assert len({tuple(r.json()["choices"][0]["text"]) for r in accepted}) == 1  # and nothing changed


def test_client_disconnect_frees_the_sequence_and_is_counted(guarded_url):
    before = requests.get(f"{guarded_url}/health", timeout=30).json()["aborted"]
    payload = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with requests.post(f"{guarded_url}/v1/completions", json=payload, headers=AUTH, stream=True,
                       timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
    # the connection is closed: within a few rounds the sequence leaves the batch and its cache slots go
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = requests.get(f"{guarded_url}/health", timeout=30).json()
        # pinned by this router, and held in the target rank's KV cache (reported by the worker's heartbeat)
        held = sum(t["sequences"] + t["held_by_worker"] for t in health["workers"]["targets"])
        if health["aborted"] > before and health["running"] == 0 and held == 0:
            break
        time.sleep(0.2)
    assert health["aborted"] == before + 1 and health["running"] == 0 and held == 0, health
    metrics = requests.get(f"{guarded_url}/metrics", headers=AUTH, timeout=30).text
    assert "raysd:requests_aborted_total 1.0" in metrics


@pytest.fixture(scope="module")
def fuzz_url(serve_url):
    """A small-context app for fuzzing (every accepted case generates at most 48 tokens)."""
    with extra_app(serve_url, "fuzz", small_target_app(max_model_len=48, max_num_seqs=8, max_waiting=256)) as url:
        yield url


def test_schemathesis_finds_no_server_error_in_over_1000_cases(fuzz_url, tmp_path):
    """Property-based fuzzing from the app's own OpenAPI schema (valid and invalid bodies): zero 5xx."""
    result = subprocess.run(
        [str(Path(sys.executable).with_name("schemathesis")), "run", f"{fuzz_url}/openapi.json", "--url", fuzz_url,
         "--checks", "not_a_server_error", "--max-examples", "300", "--mode", "all", "--request-timeout", "60",
         "--generation-deterministic", "--report", "junit", "--report-dir", str(tmp_path), "--no-color"],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path)  # its caches stay out of the repository
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    cases = int(re.search(r"(\d+) generated", output).group(1))
    assert cases >= 1000, output[-2000:]
    assert requests.get(f"{fuzz_url}/health", timeout=30).json()["status"] == "ok"
