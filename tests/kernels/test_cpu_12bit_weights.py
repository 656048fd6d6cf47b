"""bf16 weights held in 12 bits, losslessly (csrc/cpu_kernels.cpp `c12_linear_impl`,
`pack_c12_weight`): the kernel's outputs are the bf16 kernel's bits on the same weight, for
any shape, row count and weight values (zeros, subnormals, infinities, NaN, rows spanning
more binades than the 4-bit code holds), every weight decodes to its own bits, and the copy
is 3/4 of the bf16 bytes plus the few weights it keeps whole."""

from __future__ import annotations

import sys

import pytest
import torch

from kernels import cpu_kernels

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU kernels are built on Linux only"),
    pytest.mark.skipif(not cpu_kernels.c12_available(), reason="the CPU has no AVX512-BF16 or no AVX512-VBMI2"),
]


def weights(n: int, k: int, seed: int, std: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * std).to(torch.bfloat16)


def rows(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(torch.bfloat16)


def assert_same_bits(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    c12 = cpu_kernels.pack_c12_weight(w)
    expected = cpu_kernels.bf16_linear(x, cpu_kernels.pack_bf16_weight(w))
    got = cpu_kernels.c12_linear(x, c12, w.shape[0])
    assert got.shape == expected.shape
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    return c12


@pytest.mark.parametrize("n, k", [(64, 64), (70, 45), (4096, 576), (1000, 130), (33, 2048)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_the_bf16_kernels_bits(n, k, m):
    assert_same_bits(rows(m, k, seed=n + m), weights(n, k, seed=n * k))


def exceptions_expected(w: torch.Tensor) -> int:
    """Weights more than 14 binades below their row's largest exponent field (an odd K's
    padding included: its last pair holds a zero per row; padding rows are all zero, none)."""
    e = (w.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    if w.shape[1] % 2:
        e = torch.cat([e, torch.zeros(w.shape[0], 1, dtype=e.dtype)], dim=1)
    return int(((e.amax(dim=1, keepdim=True) - e) > 14).sum())


def test_values_the_code_cannot_hold_are_kept_whole():
    """Zeros, -0, subnormals, infinities, NaN, a row spanning 40 binades and an all-zero row:
    the same bits as the bf16 kernel; the exception list holds exactly the weights more than
    14 binades below their row's largest."""
    w = weights(96, 130, seed=3)
    w[0, :10] = 0
    w[1, 3] = -0.0
    w[2, 5] = torch.tensor(1e-40).to(torch.bfloat16)  # subnormal in bf16
    w[3, 7] = float("inf")
    w[4, 9] = float("-inf")
    w[5, 11] = float("nan")
    w[6] = (torch.logspace(-20, 20, 130, base=2.0) * torch.sign(torch.randn(130))).to(torch.bfloat16)
    w[7] = 0
    c12 = assert_same_bits(rows(3, 130, seed=1), w)
    assert int(c12[2][-1]) == exceptions_expected(w) > 0


def test_every_weight_decodes_to_its_own_bits():
    """With the rows of the identity as inputs each output is one weight times 1, so every
    normal weight comes back as its own bits: the decode is exact weight by weight, not only
    in sums."""
    w = weights(70, 48, seed=5)
    w[::7, ::5] *= 1e-6  # far below their rows' largest: kept whole
    got = cpu_kernels.c12_linear(torch.eye(48, dtype=torch.bfloat16), cpu_kernels.pack_c12_weight(w), 70)
    assert torch.equal(got.T.contiguous().view(torch.int16), w.view(torch.int16))


def test_the_copy_is_three_quarters_of_the_bytes():
    w = weights(2048, 2048, seed=7, std=0.02)
    packed, exceptions, offsets = cpu_kernels.pack_c12_weight(w)
    groups = 2048 // 32
    assert packed.numel() == groups * (128 + 1024 * 96)  # exponent vectors, then 96 bytes per input pair
    assert int(offsets[-1]) == exceptions_expected(w)
    total = packed.numel() + 2 * int(offsets[-1])
    assert total < 0.76 * 2 * w.numel()


def test_a_copy_of_another_shape_is_refused():
    c12 = cpu_kernels.pack_c12_weight(weights(64, 64, seed=0))
    with pytest.raises(RuntimeError, match="pack_c12_weight"):
        cpu_kernels.c12_linear(rows(1, 128, seed=0), c12, 64)
    with pytest.raises(RuntimeError, match="pack_c12_weight"):
        cpu_kernels.c12_linear(rows(1, 64, seed=0), c12, 96)
