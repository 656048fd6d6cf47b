"""Pagoda's C++ int4 weight-only kernel (kernels/csrc/cpu_kernels.cpp `int4_linear_impl`,
kernels/cpu_kernels.py `int4_linear`): against a float64 reference of the weight it stands
for, the same bits for a row alone and among others, its refusals, and the serving module
(`Int4Linear`) choosing it."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.quantization.affine import quantize_tensor
from engine.quantization.linears import Int4Linear, int4_linear
from kernels import cpu_kernels
from kernels.quant_linear import cpu_int4_mm_available, int4_scale_offset, pack_int4_cpu, w4a16_linear_cpu

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU kernels are built on Linux only"),
    pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the CPU has no AVX512-BF16"),
]


def int4_weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int4 values (0 and 15 included) and their bf16 (scale, offset) per group and
    output, with zero points anywhere in [0, 15] (the offsets' signs vary)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    q[0, 0], q[-1, -1] = 0, 15
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (k // group, n), generator=g).float()
    return q, int4_scale_offset(scales, zeros)


def dequantized(q: torch.Tensor, scale_offset: torch.Tensor, group: int) -> torch.Tensor:
    """float64 [N, K]: (q - 8) * scale + offset, the weight the kernel stands for."""
    scale = scale_offset[..., 0].double().repeat_interleave(group, 0).t()
    offset = scale_offset[..., 1].double().repeat_interleave(group, 0).t()
    return (q.double() - 8) * scale + offset


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 13, 70])
@pytest.mark.parametrize("n, k, group", [(97, 576, 64), (1, 64, 32), (4 * 48 + 3, 1536, 128), (40, 64, 16),
                                         (33, 512, 256), (64, 96, 48)])
def test_int4_gemv_equals_float64_reference(rows, n, k, group):
    """Every tile (1-2 rows x two groups of outputs, 1-6 rows x one, passes past 64 rows), N
    not a multiple of 32, group sizes torch's int4 kernel takes and ones it does not (16, 48);
    one bf16 rounding of the exact result plus float32 sums."""
    q, so = int4_weight(n, k, group, seed=rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_kernels.int4_linear(x, cpu_kernels.pack_int4_weight(q, so, group), group)
    want = x.double() @ dequantized(q, so, group).t()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # The group sums of x times the offsets cancel part of the dot products: bound by the
    # magnitude of the terms, not of the result.
    terms = x.double().abs() @ dequantized(q, so, group).abs().t()
    tol = want.abs() * 2**-8 + 2**-20 * k ** 0.5 * terms
    assert bool(((got.double() - want).abs() <= tol).all()), (got.double() - want).abs().max()


@pytest.mark.parametrize("n, k, group", [(96, 576, 64), (53, 128, 32), (200, 1536, 128)])
def test_int4_rows_are_batch_invariant(n, k, group):
    """A row's outputs are the same bits alone and among 1 to 150 rows, at any position in the
    call (the tiles of 1, 2 and up to 6 rows, the passes of 64, the tails)."""
    q, so = int4_weight(n, k, group, seed=n + k)
    packed = cpu_kernels.pack_int4_weight(q, so, group)
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    alone = torch.cat([cpu_kernels.int4_linear(x[i : i + 1], packed, group) for i in range(150)])
    for rows in (2, 3, 4, 5, 6, 7, 12, 13, 63, 64, 65, 129, 150):
        assert torch.equal(cpu_kernels.int4_linear(x[:rows], packed, group), alone[:rows]), rows
        tail = x[150 - rows :]
        assert torch.equal(cpu_kernels.int4_linear(tail, packed, group)[-1], alone[-1]), rows


@pytest.mark.skipif(not cpu_int4_mm_available(), reason="torch's CPU int4 kernel is unavailable here")
def test_agrees_with_torchs_int4_kernel():
    """torch's CPU int4 kernel (the layout it replaced, still the fallback) computes the same
    weight's product, to bf16 rounding."""
    n, k, group = 256, 1024, 128
    g = torch.Generator().manual_seed(11)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (k // group, n), generator=g).float()
    x = torch.randn(64, k, generator=g).bfloat16()
    ours = cpu_kernels.int4_linear(x, cpu_kernels.pack_int4_weight(q, int4_scale_offset(scales, zeros), group), group)
    packed, scales_and_zeros = pack_int4_cpu(q, scales, zeros, group)
    theirs = w4a16_linear_cpu(x, packed, scales_and_zeros, group)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-7, atol=2**-7 * float(theirs.abs().max()))


def test_packing_and_the_kernel_refuse_what_they_cannot_read():
    q, so = int4_weight(32, 96, 32, seed=1)
    for bad_group in (24, 64, 0):  # not a multiple of 16; does not divide K; none
        with pytest.raises(RuntimeError, match="group size must be a multiple of 16"):
            cpu_kernels.pack_int4_weight(q, so, bad_group)
    with pytest.raises(RuntimeError, match=r"scale_offset \[K / group size, N, 2\]"):
        cpu_kernels.pack_int4_weight(q, so[:, :16], 32)
    too_big = q.clone()
    too_big[3, 5] = 16
    with pytest.raises(RuntimeError, match=r"int4 values in \[0, 15\]"):
        cpu_kernels.pack_int4_weight(too_big, so, 32)
    packed = cpu_kernels.pack_int4_weight(q, so, 32)
    x = torch.randn(2, 96).bfloat16()
    with pytest.raises(RuntimeError, match="packed by pack_int4_weight with groups of 16"):
        cpu_kernels.int4_linear(x, packed, 16)  # the group size it was not packed with
    with pytest.raises(RuntimeError, match="packed by pack_int4_weight"):
        cpu_kernels.int4_linear(x, q[:, :48].contiguous(), 32)  # a dense uint8 tensor of that shape
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cpu_kernels.int4_linear(torch.randn(2, 64).bfloat16(), packed, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_module_runs_the_kernel_at_any_group_size_it_takes(dtype):
    """`int4_linear` (load-time `--quantization int4`, quantized checkpoints, GGUF) gives the
    kernel's layout on such a CPU, also for a group size torch's kernel does not take (48:
    before, the dequantizing reference); float32 x is cast to bf16 and back, the bias added
    after, and the result is the quantized weight's product."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(80, 192, generator=g)
    bias = torch.randn(80, generator=g).to(dtype)
    x = torch.randn(5, 192, generator=g).to(dtype)
    for group in (64, 48):
        qt = quantize_tensor(w, 4, group)
        module = int4_linear(qt, bias, dtype, torch.device("cpu"))
        assert isinstance(module, Int4Linear) and module.kernel and module.cpu_packed
        got = module(x)
        assert got.dtype == dtype
        kernel = cpu_kernels.int4_linear(x.bfloat16(), module.kernel_weight, group).to(dtype) + bias
        assert torch.equal(got, kernel)
        weight = qt.scale.repeat_interleave(group, 1) * (qt.q - qt.zero.repeat_interleave(group, 1)).float()
        want = x.double() @ weight.double().t() + bias.double()
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
