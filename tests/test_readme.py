"""The README's curl and OpenAI-client examples work as written (only the port is the test server's)."""

import contextlib
import io
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
DOCUMENTED_URL = "http://127.0.0.1:8000"


def _block_after(marker: str, language: str) -> str:
    start = README.index(marker)
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(README, start)
    assert match, f"no {language} block after {marker!r} in README.md"
    return match.group(1)


def test_readme_curl_examples(serve_url):
    script = _block_after("In another terminal", "bash")
    assert script.count("curl ") == 5
    result = subprocess.run(["bash", "-c", "set -e\n" + script.replace(DOCUMENTED_URL, serve_url)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert '"text_completion"' in out and '"speculation"' in out and "data: [DONE]" in out
    assert '"id":"raysd-demo"' in out.replace(" ", "") and "raysd:spec_decode_num_draft_tokens_total" in out
    assert 'segment="completions:raysd-demo:code"' in out  # the X-Raysd-Workload header named the segment
    # no error object anywhere (sampled text may contain the word "error": inside a string it is escaped)
    assert '{"error"' not in out.replace(" ", "")


def test_readme_openai_client_example(serve_url):
    code = _block_after("With the OpenAI Python client", "python")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(DOCUMENTED_URL, serve_url), "README.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    assert any("num_draft_tokens" in line and "policy_reason" in line for line in lines)
    assert len(printed.getvalue().strip()) > 0
