"""Per-call speed of the CPU linear paths in kernels/linear.py, on the default model's shapes.

    python -m loadtest.bench_linear            # float32 and bf16, rows 1 / 4 / 8 / 16 / 32 / 256
    python -m loadtest.bench_linear --shapes llama-1b --dtypes bfloat16 --baseline-rev HEAD~1
                                               # the 1B-class shapes; this tree's kernel vs HEAD~1's

For each weight shape (SmolLM2-135M's fused qkv, gate_up, down_proj and LM head) it
times, in one process and alternating: torch's default path (what `linear` ran before the
oneDNN change: the sliced `bmm` GEMV up to 32 float32 rows, `F.linear` otherwise, i.e. MKL
in float32 and oneDNN without a prepacked weight in bf16), the oneDNN path with a
prepacked weight (`pack_weight` + `linear`), and in bf16 the C++ AVX512-BF16 kernel on
its packed weight (`cpu_kernels.pack_bf16_weight` + `bf16_linear`, where the CPU has it:
the one kernel the engine runs every bf16 linear through, at every row count, so a row's
outputs do not depend on the call's other rows). Each timing cycles through
enough distinct weights (~200 MB) that they stream from memory, as in a decode step,
instead of sitting in the caches. Also prints the 2048^3 GEMM rate of MKL (`torch.mm`) and
of oneDNN, the two limits `bench_offline` takes the faster of.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from kernels.linear import SMALL_BATCH_ROWS, linear, pack_weight

SHAPES = {
    "qkv [960x576]": (960, 576),
    "gate_up [3072x576]": (3072, 576),
    "down_proj [576x1536]": (576, 1536),
    "lm_head [49152x576]": (49152, 576),
}
# `--shapes llama-1b`: the linears of loadtest/bench_noise.py's random-weight 1B-class Llama
# (Llama-3.2-1B's hidden size 2048, 32 heads, 8 KV heads, an MLP of 5632).
SHAPES_1B = {
    "qkv [3072x2048]": (3072, 2048),
    "o_proj [2048x2048]": (2048, 2048),
    "gate_up [11264x2048]": (11264, 2048),
    "down_proj [2048x5632]": (2048, 5632),
}
# The C++ kernel is timed up to this many rows (a prefill chunk's at most, by default).
GEMV_BENCH_ROWS = 2048


def _old_path(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # `linear` without a packed weight: the sliced bmm for few float32 rows, else F.linear.
    if x.dtype == torch.float32 and x.shape[0] <= SMALL_BATCH_ROWS:
        return linear(x, weight)
    return F.linear(x, weight)


def time_per_call(fn, xs: torch.Tensor, weights: list, repeats: int = 3) -> float:
    for w in weights[:2]:
        fn(xs, w)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            fn(xs, w)
        best = min(best, (time.perf_counter() - t0) / len(weights))
    return best


def revision_kernels(rev: str):
    """kernels/csrc of git revision `rev`, built as a second extension module beside this
    tree's (`--baseline-rev`: a kernel change timed against what it replaced, in one process,
    calls alternating). Its packed layout must be this tree's: the table says whether the
    outputs were the same bits."""
    root = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    names = subprocess.run([*git, "ls-tree", "--name-only", rev, "kernels/csrc/"], capture_output=True, text=True,
                           check=True).stdout.split()
    folder = Path(tempfile.mkdtemp(prefix="pagoda-kernels-"))
    for name in names:
        (folder / Path(name).name).write_bytes(subprocess.run([*git, "show", f"{rev}:{name}"], capture_output=True,
                                                              check=True).stdout)
    source = folder / cpu_kernels.SOURCE.name
    # Named by content as `load` names this tree's build: a revision whose kernels are this
    # tree's reuses that build (and module) instead of compiling them again.
    return cpu_kernels.build(source, sorted(p for p in folder.iterdir() if p != source))


def gemm_rates(dtype: torch.dtype, n: int = 2048) -> tuple[float, float]:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    w = b.t().contiguous()
    packed = pack_weight(w)
    flops = 2 * n**3
    mkl = flops / time_per_call(lambda x, y: torch.mm(x, y), a, [b] * 3) / 1e9
    onednn = flops / time_per_call(lambda x, p: linear(x, w, None, p), a, [packed] * 3) / 1e9 if packed is not None else 0.0
    return mkl, onednn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,8,16,32,256")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--stream-mb", type=int, default=200, help="weight bytes cycled through per timing")
    p.add_argument("--shapes", choices=["bundled", "llama-1b"], default="bundled",
                   help="the bundled model's linears, or the 1B-class Llama's of bench_noise")
    p.add_argument("--baseline-rev", default=None,
                   help="also time the C++ kernel of this git revision (built beside this tree's), bf16 only")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    gemv = cpu_kernels.bf16_gemv_available()
    print(f"C++ bf16 kernel: {'available' if gemv else 'not available on this CPU/build (column left empty)'}")
    baseline = revision_kernels(args.baseline_rev) if args.baseline_rev and gemv else None
    extra = f" | {args.baseline_rev} C++ ms | this / {args.baseline_rev} time | same bits" if baseline else ""
    print("| dtype | weight | rows | default path ms | oneDNN packed ms | speed-up | oneDNN GB/s of weight "
          "| C++ kernel ms | C++ kernel GB/s | C++ / oneDNN speed" + extra + " |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:" + "|---:|---:|---:" * bool(baseline) + "|")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for name, (n, k) in (SHAPES_1B if args.shapes == "llama-1b" else SHAPES).items():
            size = n * k * torch.empty((), dtype=dtype).element_size()
            count = max(2, args.stream_mb * 1_000_000 // size)
            weights = [torch.randn(n, k).to(dtype) for _ in range(count)]
            packed = [pack_weight(w) for w in weights]
            kernel_weights = [cpu_kernels.pack_bf16_weight(w) for w in weights] if gemv and dtype == torch.bfloat16 else []
            if any(pw is None for pw in packed):
                print(f"| {dtype} | {name} | - | - | unavailable | | | | | |")
                continue
            pairs = list(zip(weights, packed))
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k).to(dtype)
                old = time_per_call(_old_path, x, weights)
                new = time_per_call(lambda xs, wp: linear(xs, wp[0], None, wp[1]), x, pairs)
                cells = ["", "", ""] + ["", "", ""] * bool(baseline)
                if kernel_weights and rows <= GEMV_BENCH_ROWS:
                    ours = lambda xs, w: cpu_kernels.bf16_linear(xs, w)  # noqa: E731
                    if baseline:  # in turns with this tree's kernel: the best of three turns each
                        # Both through the extensions' own entry into a preallocated output, so
                        # neither side pays a wrapper or an allocation the other does not.
                        out, ours_out = torch.empty(rows, n, dtype=dtype), torch.empty(rows, n, dtype=dtype)
                        theirs = lambda xs, w: baseline.bf16_gemv(out, xs, w, None)  # noqa: E731
                        this_tree = lambda xs, w: cpu_kernels.load().bf16_gemv(ours_out, xs, w, None)  # noqa: E731
                        turns = [(time_per_call(theirs, x, kernel_weights), time_per_call(this_tree, x, kernel_weights))
                                 for _ in range(3)]
                        base, cpp = min(t[0] for t in turns), min(t[1] for t in turns)
                        theirs(x, kernel_weights[0])
                        same = torch.equal(out, ours(x, kernel_weights[0]))
                        cells[3:] = [f"{base * 1e3:.3f}", f"{cpp / base:.2f}x", "yes" if same else "NO"]
                    else:
                        cpp = time_per_call(ours, x, kernel_weights)
                    cells[:3] = [f"{cpp * 1e3:.3f}", f"{size / cpp / 1e9:.1f}", f"{new / cpp:.2f}x"]
                print(f"| {str(dtype)[6:]} | {name} | {rows} | {old * 1e3:.3f} | {new * 1e3:.3f} | {old / new:.2f}x "
                      f"| {size / new / 1e9:.1f} | " + " | ".join(cells) + " |")
            del weights, packed, pairs, kernel_weights
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        mkl, onednn = gemm_rates(dtype)
        print(f"GEMM 2048^3 {str(dtype)[6:]}: torch.mm (MKL) {mkl:.0f} GFLOP/s, oneDNN packed {onednn:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
