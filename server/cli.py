"""`pagoda` command line: `pagoda serve [flags]`, `pagoda generate PROMPT [flags]`,
`pagoda quantize --method ... --bits ... --out DIR` (engine/quantize.py).

`serve` loads the model once, then runs uvicorn with the FastAPI app (server/app.py),
whose lifespan starts the engine loop and shuts it down on exit. `--config FILE` reads
a flat YAML mapping of flag names (dashes or underscores; a bare name such as
`cpu-default` means `configs/cpu-default.yaml`); flags given on the command line win.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
_ENGINE_KEYS = (
    "dtype", "max_model_len", "block_size", "kv_cache_memory", "kv_cache_dtype", "max_num_seqs",
    "max_num_batched_tokens", "quantization", "kernel_backend", "seed", "enable_prefix_caching",
    "tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "max_cuda_graph_batch_size", "load_format",
    "lm_head_quantization",
    "speculative_config",
    "kv_events_config",
    "scheduling_policy",
    "batch_invariant", "cpu_threads",
    "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "allow_runtime_lora_loading", "lora_dir",
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags. Their help is the docstring of the config field behind each
    (engine/config.py), filled in by `server.config_doc.document_flags`."""
    from engine.config import DTYPES, KERNEL_BACKENDS, LM_HEAD_QUANTIZATIONS, LOAD_FORMATS, QUANTIZATION_METHODS

    parser.add_argument("--model", default=None)
    # The aliases (fp32, half, bf16, ...) are accepted; the usage line names the canonical ones.
    parser.add_argument("--dtype", default="auto", choices=DTYPES, metavar="{auto,float32,float16,bfloat16}")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=None)
    from kernels.kv_quant import KV_CACHE_DTYPES

    parser.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    from engine.config import SCHEDULING_POLICIES

    parser.add_argument("--scheduling-policy", default=None, choices=SCHEDULING_POLICIES)
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS)
    parser.add_argument("--lm-head-quantization", default=None, choices=LM_HEAD_QUANTIZATIONS)
    parser.add_argument("--kernel-backend", default="auto", choices=KERNEL_BACKENDS)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-cuda-graph-batch-size", type=int, default=None)
    parser.add_argument("--load-format", default=None, choices=LOAD_FORMATS)
    parser.add_argument("--speculative-config", default=None, metavar="JSON")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON")
    # In a --config file: `enable-prefix-caching: false`.
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="do not reuse the KV blocks of earlier requests' identical prompt prefixes")
    # In a --config file: `batch-invariant: false`.
    parser.add_argument("--batch-invariant", dest="batch_invariant", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--enable-lora", dest="enable_lora", action="store_true", default=None)
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH")
    parser.add_argument("--max-loras", type=int, default=None)
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--allow-runtime-lora-loading", dest="allow_runtime_lora_loading", action="store_true",
                        default=None)
    parser.add_argument("--lora-dir", action="append", default=None, metavar="DIR")


def engine_args_from(ns: argparse.Namespace) -> dict:
    return {k: getattr(ns, k) for k in _ENGINE_KEYS if getattr(ns, k) is not None}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server flags. A flag with a `ServerConfig` field (server/config.py) gets that
    field's docstring as its help (`server.config_doc.document_flags`); the others carry
    their own `help=` here."""
    from uvicorn.config import LOG_LEVELS

    from server.config import ServerConfig
    from server.reasoning import REASONING_PARSER_CHOICES
    from server.tools.parsers import TOOL_PARSERS

    defaults = ServerConfig()
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to listen on; `0.0.0.0` serves other machines (the Docker image's default).")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on.")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"))
    parser.add_argument("--api-keys-file", default=defaults.api_keys_file, metavar="PATH")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument("--max-header-bytes", type=int, default=defaults.max_header_bytes)
    parser.add_argument("--max-header-count", type=int, default=defaults.max_header_count)
    parser.add_argument("--client-read-timeout", type=float, default=defaults.client_read_timeout_s)
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="unfinished samples (prompts x n) the engine accepts before answering 503 + Retry-After; "
                             "one named API key may hold at most three quarters of them (past that its requests get "
                             "429, while other keys' are still admitted)")
    parser.add_argument("--max-waiting-tokens", type=int, default=None,
                        help="prompt tokens not yet prefilled (of requests without their first token) beyond which "
                             "new requests get 503 + Retry-After; an empty queue still takes one longer prompt "
                             "(none: no limit)")
    parser.add_argument("--max-queue-time", type=float, default=defaults.max_queue_time_s)
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout_s)
    parser.add_argument("--max-n", type=int, default=defaults.max_n)
    parser.add_argument("--health-stall-timeout", type=float, default=defaults.health_stall_timeout_s)
    parser.add_argument("--tokenizer-threads", type=int, default=defaults.tokenizer_threads)
    parser.add_argument("--grammar-compile-timeout", type=float, default=defaults.grammar_compile_timeout_s)
    parser.add_argument("--tool-call-parser", default=defaults.tool_call_parser, choices=list(TOOL_PARSERS))
    parser.add_argument("--max-parallel-tool-calls", type=int, default=defaults.max_parallel_tool_calls)
    parser.add_argument("--chat-template", default=defaults.chat_template)
    parser.add_argument("--reasoning-parser", default=defaults.reasoning_parser, choices=list(REASONING_PARSER_CHOICES))
    parser.add_argument("--responses-store-size", type=int, default=defaults.responses_store_size)
    parser.add_argument("--responses-store-ttl", type=float, default=defaults.responses_store_ttl_s)
    parser.add_argument("--responses-store-bytes", type=int, default=defaults.responses_store_bytes)
    parser.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs)
    parser.add_argument("--return-tokens-as-token-ids", action="store_true")
    parser.add_argument("--log-level", default="info", choices=list(LOG_LEVELS), help="uvicorn's log level.")
    parser.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    parser.add_argument("--config", default=None, help="YAML file of flag values (or a preset name from configs/)")


def build_parser() -> argparse.ArgumentParser:
    from server.config_doc import FlagHelpFormatter, document_flags

    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda: an OpenAI-compatible LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible)",
                           description="Serve a model over HTTP (OpenAI-compatible API).", formatter_class=FlagHelpFormatter)
    add_engine_args(serve)
    add_server_args(serve)
    document_flags(serve)

    gen = sub.add_parser("generate", help="generate from prompts once and print the results",
                         description="Generate from prompts once and print the results.", formatter_class=FlagHelpFormatter)
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", help="one request per prompt")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    document_flags(gen)

    quant = sub.add_parser("quantize", help="write a quantized copy of a model folder (AutoAWQ / AutoGPTQ / Pagoda INT8 layouts)",
                           description="Write a quantized copy of a model folder.", formatter_class=FlagHelpFormatter)
    quant.add_argument("--model", default=None, help="float Hugging Face folder (default: the bundled model)")
    quant.add_argument("--method", required=True, choices=["rtn", "awq", "gptq", "w8a8"])
    quant.add_argument("--bits", type=int, required=True, choices=[4, 8], help="4: rtn, awq, gptq; 8: rtn, w8a8")
    quant.add_argument("--group-size", type=int, default=128,
                       help="INT4 group size (if it does not divide every layer's input features: the largest of 64, 32 that does)")
    quant.add_argument("--out", required=True, help="output folder (config.json, model.safetensors, tokenizer files)")
    quant.add_argument("--calib-samples", type=int, default=64, help="calibration sequences of the built-in text (awq, gptq, w8a8)")
    quant.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration sequence")
    quant.add_argument("--act-order", action="store_true", help="gptq: quantize columns by decreasing Hessian diagonal (desc_act)")
    return parser


# ---- --config ------------------------------------------------------------------------------------
def resolve_config_path(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_file():
        return path
    for candidate in (_CONFIGS_DIR / name, _CONFIGS_DIR / f"{name}.yaml", _CONFIGS_DIR / f"{name}.yml"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"config file {name!r} not found (nor in {_CONFIGS_DIR})")


def load_config_defaults(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The YAML mapping as argparse defaults: keys are flag names, dashes or underscores."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values")
    known = {a.dest for a in parser._actions if a.dest not in ("help", "config")}
    switches = {a.dest for a in parser._actions if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))}
    defaults = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known:
            raise ValueError(f"{path}: unknown key {key!r}; known: {', '.join(sorted(known))}")
        if dest in switches and not isinstance(value, bool):
            # A quoted "false" is a non-empty string, which would read as true.
            raise ValueError(f"{path}: {key!r} must be true or false, got {value!r}")
        defaults[dest] = value
    return defaults


def parse_serve_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    ns = parser.parse_args(argv)
    if ns.command != "serve" or not ns.config:
        return ns
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    # Config values become defaults, so flags given on the command line override them.
    serve.set_defaults(**load_config_defaults(resolve_config_path(ns.config), serve))
    return parser.parse_args(argv)


# ---- serve -----------------------------------------------------------------------------------------
def run_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.default_model import resolve_model_path
    from server.app import ServerConfig, build_app
    from server.http_limits import HttpLimits, bounded_http_protocol
    from server.metrics import Metrics
    from server.shutdown import FLUSH_TIMEOUT_S, DrainingServer
    from server.tenants import KeyRegistry

    try:
        server_config = ServerConfig(
            served_model_name=ns.served_model_name,
            api_key=ns.api_key or None,
            api_keys_file=ns.api_keys_file,
            max_body_bytes=ns.max_body_bytes,
            max_header_bytes=ns.max_header_bytes,
            max_header_count=ns.max_header_count,
            client_read_timeout_s=ns.client_read_timeout,
            max_n=ns.max_n,
            health_stall_timeout_s=ns.health_stall_timeout,
            tokenizer_threads=ns.tokenizer_threads,
            max_queue_time_s=ns.max_queue_time,
            request_timeout_s=ns.request_timeout,
            shutdown_timeout_s=ns.shutdown_timeout,
            grammar_compile_timeout_s=ns.grammar_compile_timeout,
            tool_call_parser=ns.tool_call_parser,
            max_parallel_tool_calls=ns.max_parallel_tool_calls,
            chat_template=ns.chat_template,
            reasoning_parser=ns.reasoning_parser,
            responses_store_size=ns.responses_store_size,
            responses_store_ttl_s=ns.responses_store_ttl,
            responses_store_bytes=ns.responses_store_bytes,
            max_logprobs=ns.max_logprobs,
            return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        )
        if ns.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {ns.max_waiting_requests}")
        if ns.max_waiting_tokens is not None and ns.max_waiting_tokens < 1:
            raise ValueError(f"max_waiting_tokens must be >= 1, got {ns.max_waiting_tokens}")
        # Before the model loads: a malformed keys file fails at once, in one line.
        keys = KeyRegistry(server_config.api_keys_file, server_config.api_key)
        config = EngineConfig.from_engine_args(model=ns.model, **engine_args_from(ns))
        model_name = ns.served_model_name or resolve_model_path(config.model.model).name
        kv_events = config.cache.kv_events
        if kv_events is not None and not kv_events.topic:
            # The topic names the replica, so one subscriber can tell several apart.
            kv_events.topic = f"kv@{ns.host}:{ns.port}@{model_name}"
            config.cache.kv_events_config = dataclasses.asdict(kv_events)
        metrics = Metrics(
            model_name,
            max_model_len=config.model.max_model_len,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        )
        engine = AsyncEngine(
            config, max_waiting_requests=ns.max_waiting_requests, on_step=metrics.on_step,
            max_waiting_tokens=ns.max_waiting_tokens,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2
    server_config.served_model_name = model_name
    app = build_app(engine, server_config, metrics, keys)
    auth = "without an API key"
    if keys.names:
        auth = f"with {len(keys.names)} named API keys from {server_config.api_keys_file} (SIGHUP reloads it)"
    elif server_config.api_key:
        auth = "with an API key"
    print(f"[pagoda] serving {model_name!r} on http://{ns.host}:{ns.port} ({auth})", file=sys.stderr, flush=True)
    # loop "auto": uvloop when installed (a dependency, except on Windows), else asyncio.
    # http: httptools (a dependency) under the head size, header count and read-time limits.
    limits = HttpLimits(server_config.max_header_bytes, server_config.max_header_count,
                        server_config.client_read_timeout_s)
    uvicorn_config = uvicorn.Config(
        app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=not ns.no_access_log,
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S, loop="auto", http=bounded_http_protocol(limits),
    )
    # SIGTERM drains (server/shutdown.py) and the process then exits 0.
    DrainingServer(uvicorn_config, app.state.serving).run()
    if engine.error is not None:
        print(f"[pagoda] exiting with status 1: the engine loop died ({engine.error})", file=sys.stderr, flush=True)
        return 1
    return 0


# ---- generate --------------------------------------------------------------------------------------
def run_generate(ns: argparse.Namespace, prompts: list[str], chat: bool, max_tokens: int, temperature: float) -> int:
    from engine import LLM, SamplingParams

    try:
        llm = LLM(model=ns.model, **engine_args_from(ns))
    except (ValueError, FileNotFoundError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2
    if chat:
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts
        ]
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=max_tokens))
    finally:
        llm.shutdown()  # tensor-parallel workers (under torchrun too) exit cleanly
    elapsed = time.perf_counter() - t0
    num_tokens = 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        num_tokens += len(c.token_ids)
        print(f"--- {prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    print(f"[pagoda] {len(prompts)} requests, {num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s)")
    return 0


# ---- quantize --------------------------------------------------------------------------------------
def run_quantize(ns: argparse.Namespace) -> int:
    from engine.default_model import resolve_model_path
    from engine.quantize import QuantizeRecipe, quantize_checkpoint

    try:
        model_dir = resolve_model_path(ns.model)  # (before the recipe, as before: its errors first)
        recipe = QuantizeRecipe(ns.method, ns.bits, ns.group_size, ns.calib_samples, ns.calib_seq_len, ns.act_order)
        config = quantize_checkpoint(model_dir, Path(ns.out), recipe)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2
    print(f"[pagoda] wrote {ns.out}: quantization_config {config}")
    return 0


# ---- torchrun ranks > 0 ----------------------------------------------------------------------------
def run_worker_rank(ns: argparse.Namespace) -> int:
    """Under torchrun every rank runs the same command; all but rank 0 become its
    tensor-parallel workers (the process exits non-zero on an error)."""
    from engine.config import EngineConfig
    from engine.distributed.parallel_state import torchrun_rendezvous
    from engine.distributed.worker import worker_main

    try:
        config = EngineConfig.from_engine_args(model=ns.model, **engine_args_from(ns))
    except ValueError as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2
    worker_main(config, torchrun_rendezvous())
    return 0


def main(argv: list[str] | None = None) -> int:
    import engine  # noqa: F401  first: engine/__init__.py sets OMP_WAIT_POLICY=passive before torch loads
    parser = build_parser()
    try:
        ns = parse_serve_args(parser, argv)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"pagoda: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) > 0:
        return run_worker_rank(ns)
    if ns.command == "generate":
        return run_generate(ns, ns.prompts, ns.chat, ns.max_tokens, ns.temperature)
    if ns.command == "quantize":
        return run_quantize(ns)
    return run_serve(ns)


if __name__ == "__main__":
    sys.exit(main())
