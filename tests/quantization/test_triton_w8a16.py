"""kernels/triton_w8a16.py against kernels/quant_reference.py (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.quant_reference import dequantize_w8_ref, w8a16_linear_ref  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402
from kernels.triton_w8a16 import w8a16_config, w8a16_linear  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_w8a16 was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if ON_CUDA else "cpu"
# fp32 tl.dot is exact in the interpreter; on CUDA it runs in TF32 (10-bit mantissa).
TOL = {"rtol": 2e-2, "atol": 2e-2} if ON_CUDA else {"rtol": 1e-5, "atol": 1e-5}
# (M, N, K, path): decode (one 16-row tile; split-K when N has few tiles), prefill rows
# 17..64 and > 64; odd M, N and K around the 16/64/128 tiles (K = 200: a partial K block).
CASES = [
    (1, 33, 200, "decode-splitk"),
    (16, 70, 64, "decode"),
    (17, 65, 128, "prefill-splitk"),
    (131, 33, 96, "prefill"),
]
IDS = [f"{m}x{n}x{k}-{path}" for m, n, k, path in CASES]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, generator=gen) * 0.02 + 0.01
    bias = torch.randn(n, generator=gen)
    return x.to(DEVICE, dtype), qweight.to(DEVICE), scales.to(DEVICE, dtype), bias.to(DEVICE, dtype)


@pytest.mark.parametrize(("m", "n", "k", "path"), CASES, ids=IDS)
def test_matches_reference(m: int, n: int, k: int, path: str) -> None:
    config = w8a16_config(m, n, k, torch.device(DEVICE))
    assert (config["BLOCK_M"] == 16) == path.startswith("decode")
    if not ON_CUDA:  # the SM count decides the split on a GPU
        assert (config["SPLIT_K"] > 1) == path.endswith("splitk")
    x, qweight, scales, bias = _inputs(m, n, k)
    # Identity rows recover columns of the dequantized weight: the layout and scales.
    eye = torch.eye(k, device=DEVICE)[: min(m, k)]
    torch.testing.assert_close(
        w8a16_linear(eye, qweight, scales), dequantize_w8_ref(qweight, scales, torch.float32).t()[: min(m, k)], **TOL
    )
    has_bias = m % 2 == 1  # the fused bias (131 rows, one split) and the launcher's (split-K)
    b = bias if has_bias else None
    torch.testing.assert_close(w8a16_linear(x, qweight, scales, b), w8a16_linear_ref(x, qweight, scales, b), **TOL)


def test_rejects_bad_shapes() -> None:
    x, qweight, scales, bias = _inputs(2, 32, 64)
    with pytest.raises(ValueError, match="int8"):
        w8a16_linear(x, qweight.int(), scales)
    with pytest.raises(ValueError, match="scales"):
        w8a16_linear(x, qweight, scales[:-1])
    with pytest.raises(ValueError, match="K=63"):
        w8a16_linear(x[:, :63], qweight, scales)


@pytest.mark.skipif(not ON_CUDA, reason="bf16/fp16 tl.dot needs CUDA (the interpreter has no bf16 dot)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("m", "n", "k", "path"), CASES, ids=IDS)
def test_cuda_16bit_matches_reference(m: int, n: int, k: int, path: str, dtype: torch.dtype) -> None:
    x, qweight, scales, bias = _inputs(m, n, k, dtype)
    ref = w8a16_linear_ref(x.float(), qweight, scales.float(), bias.float())
    got = w8a16_linear(x, qweight, scales, bias)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.skipif(not ON_CUDA, reason="the Triton dispatch of kernels.quant_linear is for CUDA tensors")
def test_cuda_int8_linear_dispatches_to_triton() -> None:
    from kernels.quant_linear import w8a16_linear as dispatched

    x, qweight, scales, bias = _inputs(5, 96, 256, torch.bfloat16)
    assert torch.equal(dispatched(x, qweight, scales, bias), w8a16_linear(x, qweight, scales, bias))
