"""Dense linear layer `x @ weight.T + bias` on CPU: oneDNN with prepacked weights.

torch's default CPU GEMM (MKL) is slow on this project's AMD CPUs in float32 and runs a
few-row product on one thread. oneDNN, the library behind torch's `mkldnn` ops and
Inductor's CPU linears, is faster in float32 and spreads a 1-row bf16 product over every
thread, once the weight is reordered into its blocked layout. `pack_weight` makes that
copy once, at engine start; `linear` uses it when given. `python -m loadtest.bench_linear`
measures both paths per call on the default model's shapes (figures: docs/BENCHMARKS.md).

bf16 on a CPU with AVX512-BF16 (`gemv_enabled`), the engine runs bf16 linears through the
C++ kernel instead (`cpu_kernels.pack_bf16_weight` + `bf16_linear`, set up by
`engine/models/llama.py` `prepack_linears`): one kernel at every row count, batch-invariant,
0.87-1.06x oneDNN's packed GEMM on prefill-sized calls and 1.15-1.76x its GEMV at decode.
`PAGODA_CPU_GEMV=0` gives them this module's oneDNN path (not batch-invariant; for A/B runs).
Where the CPU lacks AVX512-BF16 the oneDNN path runs (the engine logs it).

Without a packed weight (CUDA, other dtypes, a torch without oneDNN), decode on CPU
falls back to the sliced batched GEMV below: `bmm` over P row-slices of the weight
spreads the weight stream over P threads, where F.linear reads it on one.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

# Up to this many rows the sliced bmm beats F.linear on CPU (docs/BENCHMARKS.md).
SMALL_BATCH_ROWS = 32
# The batch size oneDNN's weight layout is chosen for: one layout for decode and prefill
# alike, close to the best at every row count we serve (docs/BENCHMARKS.md).
PACK_BATCH_HINT = 64
def gemv_enabled() -> bool:
    """Whether bf16 linears run the C++ bf16 kernel (`cpu_kernels.bf16_linear`): the CPU and
    the build have AVX512-BF16 (`cpu_kernels.bf16_gemv_available`) and `PAGODA_CPU_GEMV` is
    not "0" (which gives them oneDNN's packed GEMM: slower at decode, not batch-invariant)."""
    if os.environ.get("PAGODA_CPU_GEMV", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    from kernels import cpu_kernels

    return cpu_kernels.bf16_gemv_available()


def gemv_unavailable_reason() -> str:
    """Why `gemv_enabled()` is False, for the engine's fallback log line."""
    if os.environ.get("PAGODA_CPU_GEMV", "1") == "0":
        return "PAGODA_CPU_GEMV=0"
    from kernels import cpu_kernels

    if not sys.platform.startswith("linux") or cpu_kernels.load() is None:
        return cpu_kernels.unavailable_reason() or "the CPU kernels are built for Linux only"
    return "this CPU has no AVX512-BF16"


def gemv_takes(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the C++ bf16 kernel takes this weight and bias: dense bf16 on CPU."""
    ok = weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.is_contiguous()
    return ok and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU float32/bf16 weight [N, K], or None where that path is
    unavailable or disagrees with F.linear (checked once, on a few random rows)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    weight = weight.detach().contiguous()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = _packed_linear(probe, packed, None).float()
    except (AttributeError, RuntimeError):
        return None
    want = F.linear(probe, weight).float()
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        return None
    return packed


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` through a weight packed by `pack_weight` (its only copy, once
    the dense one is dropped): x of any leading shape, in the weight's dtype."""
    if x.dim() == 2 and x.is_contiguous():  # the model's case: one call, nothing else per layer
        return _packed_linear(x, packed, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = _packed_linear(rows, packed, bias)
    return out.view(*x.shape[:-1], out.shape[-1])  # explicit: -1 cannot be inferred for 0 rows


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    if packed is not None:
        return packed_linear(x, packed, bias)
    rows = x.shape[0]
    parts = torch.get_num_threads()
    n, k = weight.shape
    if x.device.type != "cpu" or x.dtype != torch.float32 or rows > SMALL_BATCH_ROWS or parts < 2 or n % parts:
        return F.linear(x, weight, bias)
    out = torch.bmm(weight.view(parts, n // parts, k), x.t().expand(parts, k, rows))  # [P, n/P, rows]
    out = out.view(n, rows).t()
    if rows > 1:
        out = out.contiguous()
    if bias is not None:
        out = out + bias
    return out
