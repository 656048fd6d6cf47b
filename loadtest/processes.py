"""Local server processes: start on a free loopback port, wait until ready, stop or kill.

The one launcher behind `python -m loadtest` (loadtest/servers.py), the server tests
(tests/server/conftest.py), the load-test tests and the ops tests (pagoda replicas, nginx,
Prometheus). Every process runs in its own session, so that stopping it can reach its
children, with stdout and stderr going to a log file (never a pipe a chatty server could
fill) that is read back when something fails. `wait_ready` raises `NotReady` with the
log's tail; the tests turn that into a test failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import httpx

import loadtest

REPO_ROOT = Path(__file__).resolve().parent.parent
PORT = "{port}"
"""Stands in a command for the port the server is given."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagoda_command(*args: str, port: int | str = PORT) -> list[str]:
    """`pagoda serve` on 127.0.0.1 (this interpreter, the checkout's code) with more flags."""
    return [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]


class NotReady(RuntimeError):
    """The process exited, or did not answer, before it was ready (the message has its log)."""


class Process:
    """One subprocess in its own session, its output in `log_path`.

    `env` is added to this process's environment, less the variables named in `drop_env`
    (the tests drop PAGODA_API_KEY: a server's key comes from its flags only, never from the
    environment of whoever runs them) and less the OMP_WAIT_POLICY loadtest/__init__.py set
    for this process's own engines (a peer keeps its OpenMP default: what passive did to
    llama-server is in docs/BENCHMARKS.md, "A benchmark fix on the way"). `stop()` sends SIGTERM to the process, or with
    `signal_group` to its whole session (a server that does not end its own children),
    and SIGKILL to the session after `stop_timeout_s`.
    """

    def __init__(
        self,
        name: str,
        args: list[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        drop_env: Iterable[str] = (),
        signal_group: bool = False,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.log_path = log_path
        self.signal_group = signal_group
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "wb")
        dropped = set(drop_env) | ({"OMP_WAIT_POLICY"} if loadtest.SET_OMP_WAIT_POLICY else set())
        full_env = {k: v for k, v in os.environ.items() if k not in dropped} | dict(env or {})
        self.proc = subprocess.Popen(
            self.args, cwd=REPO_ROOT, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def log_tail(self, num_chars: int = 6000) -> str:
        """The last `num_chars` characters of the output so far."""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def tail(self, num_chars: int = 4000) -> str:
        """`log_tail` under a heading with the process's name (for logs of several processes)."""
        return f"--- {self.name} ---\n{self.log_tail(num_chars)}"

    def wait_for(self, urls: Iterable[str], timeout_s: float) -> None:
        """Return once one of `urls` answers 200. Otherwise stop the process and raise
        NotReady: when it exits first, or after `timeout_s`."""
        urls = list(urls)
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                self.stop()
                raise NotReady(f"{self.name} (`{' '.join(self.args)}`) exited with {rc} before it was ready;"
                               f" its output:\n{self.log_tail()}")
            for url in urls:
                try:
                    r = httpx.get(url, timeout=2.0)
                except httpx.HTTPError as e:
                    last = f"{url}: {e!r}"
                    continue
                if r.status_code == 200:
                    return
                last = f"{url}: HTTP {r.status_code}: {r.text[:200]}"
            time.sleep(0.25)
        self.stop()
        raise NotReady(f"{self.name} not ready within {timeout_s:.0f} s (last: {last}); its output:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL to the whole session, as a crash would: no drain, open connections reset."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)

    def stop(self, stop_timeout_s: float = 15) -> None:
        """SIGTERM (a graceful shutdown), then `kill()` if it has not exited in time; closes the log."""
        if self.proc.poll() is None:
            try:
                if self.signal_group:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                else:
                    self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class HttpServer(Process):
    """A `Process` serving HTTP on 127.0.0.1: `port` (a free one unless given), `url`,
    ready when one of `ready_paths` answers 200. `PORT` in the arguments of `command` becomes
    the port; the log is `log_dir / "<name>-<port>.log"`."""

    def __init__(
        self,
        name: str,
        command: list[str],
        log_dir: Path,
        ready_paths: Iterable[str] = ("/health",),
        port: int | None = None,
        **process_kw,
    ) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_paths = tuple(ready_paths)
        args = [a.replace(PORT, str(self.port)) for a in command]
        super().__init__(name, args, log_dir / f"{name.replace(' ', '-')}-{self.port}.log", **process_kw)

    def wait_ready(self, timeout_s: float) -> None:
        """Return once a ready path answers 200; NotReady (with the log) otherwise."""
        self.wait_for([self.url + path for path in self.ready_paths], timeout_s)
