"""The README's curl examples work as written (only the port differs)."""

import json
import re
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- readme-curl-examples"


def _curl_commands() -> list[str]:
    text = README.read_text()
    block = text[text.index(MARKER):]
    block = block[block.index("```bash") + len("```bash"): block.index("```", block.index("```bash") + 7)]
    joined = block.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("curl ")]


COMMANDS = _curl_commands()


def test_readme_has_curl_examples():
    assert len(COMMANDS) >= 6


@pytest.mark.parametrize("command", COMMANDS, ids=[re.search(r"localhost:8000(\S*)", c).group(1) for c in COMMANDS])
def test_readme_curl_example(server_url, command):
    port = server_url.rsplit(":", 1)[1]
    run = subprocess.run(
        ["bash", "-c", command.replace("localhost:8000", f"127.0.0.1:{port}") + " -w '\\n%{http_code}'"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    body, status = run.stdout.rsplit("\n", 1)
    assert status == "200", body
    if "/metrics" in command:
        assert "pagoda:num_requests_running" in body
    elif '"stream": true' in command:
        events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] > 0
    else:
        payload = json.loads(body)
        assert "error" not in payload
