"""Float32 vs INT8 vs INT4 (RTN, weight-only) on the default model, measured in one run.

    python -m loadtest.bench_quant            # batch-1 decode tok/s + weight bytes
    python -m loadtest.bench_quant --kernels  # the per-GEMM table in kernels/quant_linear.py

Decode tok/s = 63 / (time of a 64-token generate - time of a 1-token generate), best of
`--repeats`, so prefill and the first token are excluded. Goal (issue 5): INT8 >= 1.6x float.
"""

from __future__ import annotations

import argparse
import time

import torch

GOAL_INT8_SPEEDUP = 1.6
PROMPT = "Write a short story about a robot who learns to paint."


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters + buffers, each tensor once (tied embeddings), without the RoPE tables,
    plus the oneDNN-packed weights of float linears (their only copy on CPU)."""
    seen: dict[int, int] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.startswith("rope."):
            seen[id(t)] = t.numel() * t.element_size()
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            seen[id(packed)] = packed.numel() * packed.element_size()
    return sum(seen.values())


def decode_tok_s(quantization: str | None, repeats: int) -> tuple[float, int]:
    from engine import LLM, SamplingParams

    llm = LLM(quantization=quantization)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate([PROMPT], full)  # warm-up
    best_one = best_full = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([PROMPT], one)
        best_one = min(best_one, time.perf_counter() - t)
        t = time.perf_counter()
        out = llm.generate([PROMPT], full)
        best_full = min(best_full, time.perf_counter() - t)
        assert len(out[0].outputs[0].token_ids) == 64
    return 63 / max(best_full - best_one, 1e-9), weight_bytes(llm.engine_core.model)


def bench_kernels() -> None:
    import torch.nn.functional as F

    from kernels.linear import linear
    from kernels.quant_linear import pack_int4_cpu, w4a16_linear_cpu, w8a16_linear_cpu

    def us(fn, iters: int = 20, reps: int = 15) -> float:
        fn()
        return min(_timed(fn, iters) for _ in range(reps)) * 1e6

    # int8: kernels/quant_linear.py's route (Pagoda's int8 GEMV at these row counts where
    # the C++ kernels have it); int8pack: torch's `_weight_int8pack_mm` it replaces, same casts.
    print(f"{'shape':>10} {'M':>2} {'F.linear':>9} {'bmm fp32':>9} {'int8':>9} {'int8pack':>9} {'int4':>9}  (us)")
    for n, k in [(576, 576), (960, 576), (3072, 576), (576, 1536), (1536, 576)]:
        g = 128 if k % 128 == 0 else 64
        w = torch.randn(n, k)
        q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        s8 = (torch.rand(n) * 0.01).bfloat16()
        packed, sz = pack_int4_cpu(torch.randint(0, 16, (n, k)), torch.rand(k // g, n), None, g)
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k)
            row = [
                us(lambda: F.linear(x, w)),
                us(lambda: linear(x, w)),
                us(lambda: w8a16_linear_cpu(x, q8, s8)),
                us(lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), q8, s8).to(x.dtype)),
                us(lambda: w4a16_linear_cpu(x, packed, sz, g)),
            ]
            print(f"{n}x{k:<5} {m:>2} " + " ".join(f"{v:9.1f}" for v in row), flush=True)


def _timed(fn, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", action="store_true", help="per-GEMM microbenchmark instead")
    args = parser.parse_args()
    if args.kernels:
        bench_kernels()
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch 1, 64 tokens, ignore_eos")
    results = {}
    for method in (None, "int8", "int4"):
        results[method] = decode_tok_s(method, args.repeats)
    base_tps, base_bytes = results[None]
    print(f"{'weights':>8} {'decode tok/s':>13} {'speedup':>8} {'weight MiB':>11} {'size':>6}")
    for method, (tps, nbytes) in results.items():
        print(
            f"{method or 'float32':>8} {tps:13.1f} {tps / base_tps:7.2f}x {nbytes / 2**20:11.1f} "
            f"{nbytes / base_bytes:5.2f}x"
        )
    speedup = results["int8"][0] / base_tps
    verdict = "PASS" if speedup >= GOAL_INT8_SPEEDUP else "MISS"
    print(f"INT8 decode speedup {speedup:.2f}x vs goal {GOAL_INT8_SPEEDUP}x: {verdict}")


if __name__ == "__main__":
    main()
