"""CLI contracts that scripts rely on: `raysd generate --json` and `raysd probe --json`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _raysd(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raysd.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    records = [{"prompt": '{"id": 7, "name": "Ada", "tags": [', "workload": "json"},
               {"prompt": "def read_config(path):\n    ", "workload": "code"},
               {"prompt": "The history of the"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow
def test_generate_json_contract_and_speculation_is_lossless(prompt_file):
    outputs = {}
    for mode in ("off", "on", "adaptive"):
        result = _raysd("generate", "--prompts", str(prompt_file), "--speculation", mode, "--k", "3",
                        "--max-tokens", "20", "--ignore-eos", "--json")
        assert result.returncode == 0, result.stderr
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        assert len(lines) == 3
        for line in lines:
            for key in ("prompt_token_ids", "token_ids", "text", "rounds", "drafted_tokens", "accepted_tokens",
                        "decode_seconds"):
                assert key in line, key
            assert len(line["token_ids"]) == 20  # --ignore-eos: exactly max-tokens
        outputs[mode] = lines
    assert [o["token_ids"] for o in outputs["off"]] == [o["token_ids"] for o in outputs["on"]]
    assert [o["token_ids"] for o in outputs["off"]] == [o["token_ids"] for o in outputs["adaptive"]]
    assert all(o["drafted_tokens"] == 0 for o in outputs["off"])
    assert sum(o["drafted_tokens"] for o in outputs["on"]) > 0
    assert outputs["on"][0]["prompt_token_ids"] == outputs["off"][0]["prompt_token_ids"]


@pytest.mark.slow
def test_generate_ngram_drafter_and_sampling_seed(prompt_file):
    runs = [_raysd("generate", "--prompts", str(prompt_file), "--drafter", "ngram", "--speculation", "on",
                   "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--max-tokens", "12", "--json")
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout.splitlines()[0] and \
        [json.loads(x)["token_ids"] for x in runs[0].stdout.splitlines()] == \
        [json.loads(x)["token_ids"] for x in runs[1].stdout.splitlines()]


def test_bad_prompt_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    result = _raysd("generate", "--prompts", str(bad), "--json", timeout=120)
    assert result.returncode != 0 and "bad.jsonl:2: not JSON" in result.stderr


@pytest.mark.slow
def test_probe_reports_acceptance_costs_and_prediction(prompt_file):
    result = _raysd("probe", "--prompts", str(prompt_file), "--k-max", "2", "--max-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["workloads"]) == {"json", "code", "default"}
    for entry in report["workloads"].values():
        assert set(entry["by_k"]) == {"1", "2"}
        assert 0.0 <= entry["by_k"]["1"]["acceptance_rate"] <= 1.0
        assert set(entry["predicted"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert report["costs"]["1"]["c"] > 0 and report["costs"]["64"]["v"]["2"] > 0
