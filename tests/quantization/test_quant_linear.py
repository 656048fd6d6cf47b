"""kernels/quant_linear.py (torch's CPU int8/int4 GEMMs) against kernels/quant_reference.py."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.affine import pack_int4, quantize_tensor
from kernels.quant_linear import (
    cpu_int4_mm_available,
    cpu_int8_mm_available,
    pack_int4_cpu,
    w4a16_linear_cpu,
    w8a16_linear,
)
from kernels.quant_reference import dequantize_w4_ref, w4a16_linear_ref, w8a16_linear_ref

# (M, N, K, group): decode rows 1..8, a prefill-sized M, SmolLM2's K = 576 (group 64).
SHAPES = [(1, 64, 128, 32), (3, 96, 576, 64), (8, 128, 256, 128), (65, 32, 1536, 128)]


def bf16_tol(ref: torch.Tensor) -> dict[str, float]:
    # Activations and outputs are rounded to bf16 (2^-9 relative) around the int GEMM.
    return {"rtol": 2e-2, "atol": 2e-2 * ref.abs().max().item()}


@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES, ids=[f"{m}x{n}x{k}-g{g}" for m, n, k, g in SHAPES])
def test_int4_gptq_dequantize_matches_affine_math(m: int, n: int, k: int, group: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k))
    qt = quantize_tensor(w, 4, group)
    expected = qt.scale.repeat_interleave(group, 1) * (qt.q - qt.zero.repeat_interleave(group, 1)).float()
    got = dequantize_w4_ref(pack_int4(qt.q), qt.scale.t(), qt.zero.t(), group)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.skipif(not cpu_int8_mm_available(), reason="torch's CPU int8 GEMM is unavailable here")
@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k, _ in SHAPES])
def test_w8a16_cpu_matches_reference(m: int, n: int, k: int, group: int) -> None:
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, generator=gen) * 0.01).bfloat16()
    bias = torch.randn(n, generator=gen)
    ref = w8a16_linear_ref(x, qweight, scales.float(), bias)
    torch.testing.assert_close(w8a16_linear(x, qweight, scales, bias), ref, **bf16_tol(ref))


@pytest.mark.skipif(not cpu_int4_mm_available(), reason="torch's CPU int4 GEMM is unavailable here")
@pytest.mark.parametrize("has_zeros", [True, False], ids=["zeros", "symmetric"])
@pytest.mark.parametrize(("m", "n", "k", "group"), SHAPES, ids=[f"{m}x{n}x{k}-g{g}" for m, n, k, g in SHAPES])
def test_w4a16_cpu_matches_reference(m: int, n: int, k: int, group: int, has_zeros: bool) -> None:
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.01
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.int32, generator=gen) if has_zeros else None
    ref = w4a16_linear_ref(x, pack_int4(q), scales, zeros, group)
    packed, scales_and_zeros = pack_int4_cpu(q, scales, zeros, group)
    torch.testing.assert_close(w4a16_linear_cpu(x, packed, scales_and_zeros, group), ref, **bf16_tol(ref))


def test_w8a16_falls_back_to_reference_off_cpu_fast_path() -> None:
    # float64 activations: the reference path (exact in float64) is what any non-CPU device gets.
    x = torch.randn(2, 32, dtype=torch.float64)
    qweight = torch.randint(-128, 128, (16, 32), dtype=torch.int8)
    scales = torch.rand(16, dtype=torch.float64)
    torch.testing.assert_close(w8a16_linear_ref(x, qweight, scales), x @ (qweight.double() * scales[:, None]).t())
