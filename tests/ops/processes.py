"""Real processes for the ops tests (pagoda replicas, nginx, Prometheus): start, wait, stop, kill.

Each runs in its own session with its output in a file, read back when something fails.
The API key comes from the flags only, never from the environment of whoever runs the tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = args
        self.log_path = log_path
        self.log = open(log_path, "wb")
        env = {k: v for k, v in os.environ.items() if k != "PAGODA_API_KEY"} | (env or {})
        self.proc = subprocess.Popen(
            args, cwd=REPO_ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def tail(self, num_chars: int = 4000) -> str:
        self.log.flush()
        return f"--- {self.name} ---\n" + self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}", pytrace=False)
            try:
                r = httpx.get(url, timeout=2.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.25)
        pytest.fail(f"{url} not ready within {timeout_s:.0f} s (last: {last}):\n{self.tail()}", pytrace=False)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no drain, open connections reset by the kernel."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
