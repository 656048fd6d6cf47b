"""`pagoda` command line: `pagoda serve [flags]`, `pagoda generate PROMPT [flags]`.

The HTTP server arrives with its own issue; until then `serve` loads the engine and runs
a short generation demo with the same flags, so the README's serve command already
exercises the whole engine.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face Llama-family folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=None, help="KV-cache budget in GiB")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--seed", type=int, default=None)


def engine_args_from(ns: argparse.Namespace) -> dict:
    keys = (
        "dtype", "max_model_len", "block_size", "kv_cache_memory", "max_num_seqs",
        "max_num_batched_tokens", "quantization", "kernel_backend", "seed",
    )
    return {k: getattr(ns, k) for k in keys if getattr(ns, k) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda: an OpenAI-compatible LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model (until the HTTP server lands: a generation demo)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--config", default=None, help="YAML preset from configs/")

    gen = sub.add_parser("generate", help="generate from prompts once and print the results")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    return parser


_DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain continuous batching in one sentence.",
    "List three prime numbers.",
]


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
    outs = llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=max_tokens))
    elapsed = time.perf_counter() - t0
    num_tokens = 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        num_tokens += len(c.token_ids)
        print(f"--- {prompt!r}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    print(f"[pagoda] {len(prompts)} requests, {num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "generate":
        return run_generate(ns, ns.prompts, ns.chat, ns.max_tokens, ns.temperature)
    print("[pagoda] the HTTP server is not built yet; running a generation demo with the same engine", file=sys.stderr)
    return run_generate(ns, _DEMO_PROMPTS, chat=True, max_tokens=48, temperature=0.0)


if __name__ == "__main__":
    sys.exit(main())
