"""kernels/triton_w8a8.py against kernels/quant_reference.py (interpreter on CPU, compiled on CUDA).

Activation quantization is checked first (bit-exact: same fp32 operations, IEEE
division, halves to even), then the GEMM: with unit scales its output is the int32
accumulator converted to fp32, equal to the exact integer product; with real scales the
fp32 rescaling is the reference's, operation for operation.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.quant_reference import int8_matmul_ref, quantize_per_token_ref, w8a8_linear_ref  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402
from kernels.triton_w8a8 import _w8a8_config, quantize_per_token, w8a8_linear  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_w8a8 was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if ON_CUDA else "cpu"
# (M, N, K): M around the 16 / 64 / 128-row tiles, N around the 64 / 128-column tiles,
# K around the 128 / 256-wide K blocks (and one K shorter than a block).
GEMM_CASES = [
    (1, 33, 64),
    (15, 64, 257),
    (16, 65, 255),
    (17, 127, 129),
    (64, 129, 128),
    (65, 31, 576),
    (129, 130, 127),
]
GEMM_IDS = [f"{m}x{n}x{k}-tile{_w8a8_config(m)['BLOCK_M']}" for m, n, k in GEMM_CASES]
QUANT_SHAPES = [(1, 1), (3, 17), (5, 576), (2, 4096), (2, 5000)]  # the last takes two row chunks


def _int8(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen).to(DEVICE)


@pytest.mark.parametrize(("m", "k"), QUANT_SHAPES, ids=[f"{m}x{k}" for m, k in QUANT_SHAPES])
def test_quantize_per_token_equals_reference(m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]  # rows of very different ranges
    x[0, k // 2] = 30.0 if k > 1 else x[0, 0]  # an outlier channel
    x = x.to(DEVICE)
    q, scale = quantize_per_token(x)
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert q.dtype == torch.int8 and scale.shape == (m, 1) and scale.dtype == torch.float32
    assert torch.equal(q, q_ref)
    assert torch.equal(scale, scale_ref)
    assert int(q.abs().amax(dim=1).min()) == 127  # every row uses the full range


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_quantize_of_16bit_values_equals_reference(dtype: torch.dtype) -> None:
    """Activations that hold 16-bit values (stored as fp32 here, so the interpreter runs them)
    land on exact halves of the int8 grid often (x = absmax / 2 gives 63.5): there the
    reference must divide as the kernel does, one correctly rounded 127 / absmax. (torch's
    scalar / tensor is a reciprocal and a product: one ulp off for a quarter of the rows,
    which flipped these halves on the GPU.)"""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 255, generator=gen) * torch.logspace(-2, 1, 64)[:, None]).to(dtype).float().to(DEVICE)
    q, scale = quantize_per_token(x)
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    # The inputs do hit exact halves (else this test could not tell the divisions apart).
    halves = (x.double() * (127.0 / x.double().abs().amax(dim=1, keepdim=True))).remainder(1.0) == 0.5
    assert int(halves.sum()) > 0


def test_quantize_rounds_halves_to_even_and_keeps_zero_rows() -> None:
    # absmax 127 -> multiplier exactly 1: the row's values are the rounded ones.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -127.0], [0.0] * 8], device=DEVICE)
    q, scale = quantize_per_token(x)
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, 126, -127], [0] * 8]
    assert scale.flatten().tolist() == [1.0, 0.0]


@pytest.mark.parametrize(("m", "n", "k"), GEMM_CASES, ids=GEMM_IDS)
def test_gemm_accumulates_exactly(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    qx, qweight = _int8((m, k), gen), _int8((n, k), gen)
    ones_m, ones_n = torch.ones(m, 1, device=DEVICE), torch.ones(n, device=DEVICE)
    out = w8a8_linear(qx, ones_m, qweight, ones_n)
    assert torch.equal(out, int8_matmul_ref(qx, qweight).float())


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("m", "n", "k"), GEMM_CASES, ids=GEMM_IDS)
def test_quantize_then_gemm_matches_reference(m: int, n: int, k: int, has_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k + 1)
    x = torch.randn(m, k, generator=gen).to(DEVICE)
    qweight = _int8((n, k), gen)
    w_scale = (torch.rand(n, generator=gen) * 1e-2).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE) if has_bias else None
    qx, x_scale = quantize_per_token(x)
    out = w8a8_linear(qx, x_scale, qweight, w_scale, bias)
    torch.testing.assert_close(out, w8a8_linear_ref(qx, x_scale, qweight, w_scale, bias), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not ON_CUDA, reason="16-bit activations on the compiled kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("m", "n", "k"), GEMM_CASES, ids=GEMM_IDS)
def test_cuda_16bit_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    qweight = _int8((n, k), gen)
    w_scale = (torch.rand(n, generator=gen) * 1e-2).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    qx, x_scale = quantize_per_token(x)
    q_ref, scale_ref = quantize_per_token_ref(x)
    assert torch.equal(qx, q_ref) and torch.equal(x_scale, scale_ref)
    out = w8a8_linear(qx, x_scale, qweight, w_scale, bias, out_dtype=dtype)
    ref = w8a8_linear_ref(qx, x_scale, qweight, w_scale, bias, out_dtype=torch.float32)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_rejects_mismatched_shapes_and_dtypes() -> None:
    gen = torch.Generator().manual_seed(0)
    qx, qweight = _int8((2, 64), gen), _int8((32, 64), gen)
    x_scale, w_scale = torch.ones(2, 1, device=DEVICE), torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="K=64"):
        w8a8_linear(qx, x_scale, _int8((32, 63), gen), w_scale)
    with pytest.raises(ValueError, match="int8"):
        w8a8_linear(qx.float(), x_scale, qweight, w_scale)
    with pytest.raises(ValueError, match="w_scale"):
        w8a8_linear(qx, x_scale, qweight, w_scale[:31])
    with pytest.raises(ValueError, match="floating-point"):
        quantize_per_token(qx)
