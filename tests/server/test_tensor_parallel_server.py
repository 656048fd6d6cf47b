"""`pagoda serve --tensor-parallel-size 2`: serves, and a worker rank that dies takes the
server down visibly (/health 503, then a non-zero exit) instead of leaving it hung."""

import os
import re
import signal
import time

import httpx


def test_a_dead_worker_rank_makes_health_503_and_the_server_exit_nonzero(
    start_server, tiny_model_path, helpers, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on two cores
    server = start_server(["--model", str(tiny_model_path), "--tensor-parallel-size", "2", "--kv-cache-memory", "0.05"])
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Tensor parallel", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4

    worker_pid = int(re.search(r"workers: rank 1 pid (\d+)", server.log_tail(100_000)).group(1))
    os.kill(worker_pid, signal.SIGKILL)

    # The server idles: the worker's death must be noticed without any request arriving.
    answers = []
    deadline = time.monotonic() + 30
    with httpx.Client(timeout=2) as http:
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                answers.append(http.get(f"{server.url}/health"))
            except httpx.TransportError:
                pass  # the listening socket closed: the server is on its way out
            time.sleep(0.05)
    statuses = [a.status_code for a in answers]
    assert 503 in statuses, f"/health answered {sorted(set(statuses))} after the worker died"
    after = statuses[statuses.index(503):]
    assert set(after) == {503}, f"/health went back to {sorted(set(after))} after a 503"
    helpers.assert_error_envelope(answers[-1].json())
    assert server.proc.wait(timeout=30) not in (0, None), server.log_tail()
    assert "tensor-parallel rank 1" in server.log_tail() and f"pid {worker_pid}) exited" in server.log_tail()
