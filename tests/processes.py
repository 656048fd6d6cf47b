"""Server processes for every test folder: loadtest/processes.py (the one launcher), started
as the tests start them, with a failed start reported as the test's failure.

Importable as `processes` from any test module or conftest: pytest puts tests/ (the folder of
the rootdir conftest, which has no __init__.py) on sys.path.
"""

from __future__ import annotations

import pytest

from loadtest.processes import PORT, REPO_ROOT, HttpServer, NotReady, free_port, pagoda_command

__all__ = ["PORT", "REPO_ROOT", "TEST_KV_CACHE_GIB", "Server", "free_port", "pagoda_command"]

TEST_KV_CACHE_GIB = 0.25
"""The KV cache of the suite's `pagoda serve` processes (`--kv-cache-memory`). A server's KV
cache is allocated and zeroed at start: the CPU default (2 GiB) made each start touch ~3 GB,
and on this project's VMs pages not touched for a while come back slowly, so in-suite starts
took 15-27 s instead of 7-9. 0.25 GiB is 5,824 tokens of the bundled model in float32, room
for eleven requests of 512 tokens; a module that needs another size passes its own flag
(the last one given wins)."""


class Server(HttpServer):
    """An `HttpServer` without PAGODA_API_KEY in its environment (a server's key comes from its
    flags only, never from the environment of whoever runs the tests) whose `wait_ready`
    fails the test, with the server's output, instead of raising."""

    def __init__(self, name: str, command: list[str], log_dir, **kw) -> None:
        kw.setdefault("drop_env", ("PAGODA_API_KEY",))
        super().__init__(name, command, log_dir, **kw)

    def wait_ready(self, timeout_s: float) -> None:
        try:
            super().wait_ready(timeout_s)
        except NotReady as e:
            pytest.fail(str(e), pytrace=False)
