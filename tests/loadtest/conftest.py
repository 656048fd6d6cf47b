"""Fixtures: a real `pagoda serve` subprocess on a free port, as in tests/server/conftest.py.

Started through `loadtest.servers.LaunchedServer` (the launcher `python -m loadtest` uses):
its own session, output to a log file, ready when /health answers 200. Two servers at most:
one shared by the module-level runs, and one the kill test kills. Both with a small KV cache
(tests/processes.py: TEST_KV_CACHE_GIB): a start then takes 7-9 s, not 15-27.
"""

from __future__ import annotations

import pytest

from processes import TEST_KV_CACHE_GIB

from loadtest.servers import LaunchedServer, pagoda_spec

MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def start_pagoda(default_model_path, tmp_path_factory):
    """Factory: start a pagoda server with extra flags, wait until ready; all stopped at the end."""
    started: list[LaunchedServer] = []
    log_dir = tmp_path_factory.mktemp("loadtest-server-logs")

    def start(extra_args: list[str] = ()) -> LaunchedServer:
        spec = pagoda_spec(default_model_path, None, ["--max-model-len", str(MAX_MODEL_LEN),
                                                              "--kv-cache-memory", str(TEST_KV_CACHE_GIB), *extra_args])
        server = LaunchedServer(spec, log_dir)
        started.append(server)
        try:
            server.wait_ready(STARTUP_TIMEOUT_S)
        except RuntimeError as e:
            pytest.fail(str(e), pytrace=False)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def pagoda(start_pagoda) -> LaunchedServer:
    return start_pagoda()
