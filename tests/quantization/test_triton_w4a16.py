"""kernels/triton_w4a16.py against kernels/quant_reference.py (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from engine.quantization.affine import pack_int4  # noqa: E402
from kernels.quant_reference import dequantize_w4_ref, w4a16_linear_ref  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402
from kernels.triton_w4a16 import _num_sms, _w4a16_config, w4a16_linear  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_w4a16 was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if ON_CUDA else "cpu"
# fp32 tl.dot is exact in the interpreter; on CUDA it runs in TF32 (10-bit mantissa).
TOL = {"rtol": 2e-2, "atol": 2e-2} if ON_CUDA else {"rtol": 1e-5, "atol": 1e-5}
# (M, N, K, group, path): decode rows 1..16 (split-K when N has few tiles), prefill rows
# 17..64 and > 64; odd M and N around the 16/64/128 tiles; K = one group up to several
# 128-wide K blocks, and K = 576 (SmolLM2), not a multiple of the 128-wide K block.
CASES = [
    (1, 33, 64, 32, "decode"),
    (1, 130, 576, 64, "decode-splitk"),
    (7, 65, 256, 128, "decode-splitk"),
    (16, 64, 96, 32, "decode"),
    (15, 31, 64, 64, "decode"),
    (17, 65, 128, 128, "prefill-splitk"),
    (64, 129, 192, 64, "prefill-splitk"),
    (65, 127, 64, 32, "prefill"),
    (130, 33, 256, 128, "prefill"),
    # Group sizes past the 128-wide K block: 256, and AutoGPTQ's -1 (one group per row: G = K,
    # here 192, not a power of two).
    (3, 40, 512, 256, "decode-splitk"),
    (2, 24, 192, 192, "decode-splitk"),
]
IDS = [f"{m}x{n}x{k}-g{g}-{path}" for m, n, k, g, path in CASES]


def _inputs(m: int, n: int, k: int, group: int, has_zeros: bool, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.01
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, generator=gen) if has_zeros else None
    bias = torch.randn(n, generator=gen)
    move = lambda t: None if t is None else t.to(DEVICE, dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return move(x), move(pack_int4(q)), move(scales), move(zeros), move(bias)


@pytest.mark.parametrize(("m", "n", "k", "group", "path"), CASES, ids=IDS)
def test_cases_cover_their_path(m: int, n: int, k: int, group: int, path: str) -> None:
    config = _w4a16_config(m, n, k, _num_sms(torch.device(DEVICE)))
    assert (config["BLOCK_M"] == 16) == path.startswith("decode")
    if not ON_CUDA:  # the SM count decides the split on a GPU
        assert (config["SPLIT_K"] > 1) == path.endswith("splitk")


@pytest.mark.parametrize("has_zeros", [True, False], ids=["zeros", "symmetric"])
@pytest.mark.parametrize(("m", "n", "k", "group", "path"), CASES, ids=IDS)
def test_dequantize_then_gemm_matches_reference(m: int, n: int, k: int, group: int, path: str, has_zeros: bool) -> None:
    x, qweight, scales, zeros, bias = _inputs(m, n, k, group, has_zeros)
    # Dequantize first: x = m identity rows recover m columns of the dequantized weight.
    eye = torch.eye(k, device=DEVICE)[:m]
    w_kernel = w4a16_linear(eye, qweight, scales, zeros, group)  # [m, N] = W^T[:m]
    torch.testing.assert_close(w_kernel, dequantize_w4_ref(qweight, scales, zeros, group).t()[:m], **TOL)
    torch.testing.assert_close(
        w4a16_linear(x, qweight, scales, zeros, group, bias),
        w4a16_linear_ref(x, qweight, scales, zeros, group, bias),
        **TOL,
    )


@pytest.mark.skipif(not ON_CUDA, reason="bf16/fp16 tl.dot needs CUDA (the interpreter has no bf16 dot)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("m", "n", "k", "group", "path"), CASES, ids=IDS)
def test_cuda_16bit_matches_reference(m: int, n: int, k: int, group: int, path: str, dtype: torch.dtype) -> None:
    x, qweight, scales, zeros, bias = _inputs(m, n, k, group, True, dtype)
    ref = w4a16_linear_ref(x.float(), qweight, scales.float(), zeros, group, bias.float())
    got = w4a16_linear(x, qweight, scales, zeros, group, bias)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_rejects_bad_group() -> None:
    x, qweight, scales, zeros, _ = _inputs(1, 32, 64, 32, True)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_linear(x, qweight, scales, zeros, 48)  # does not divide K = 64
    with pytest.raises(ValueError, match="group_size"):
        w4a16_linear(x, qweight, scales, zeros, 12)  # not a multiple of 8


def test_rejects_bad_bias() -> None:
    x, qweight, scales, zeros, _ = _inputs(1, 32, 64, 32, True)
    with pytest.raises(ValueError, match="bias"):
        w4a16_linear(x, qweight, scales, zeros, 32, torch.zeros(31, device=DEVICE))


@pytest.mark.skipif(not ON_CUDA, reason="the Triton dispatch of kernels.quant_linear is for CUDA tensors")
def test_cuda_int4_linear_dispatches_to_triton() -> None:
    from kernels.quant_linear import w4a16_linear as dispatched

    x, qweight, scales, zeros, bias = _inputs(5, 96, 256, 64, True, torch.bfloat16)
    assert torch.equal(dispatched(x, qweight, scales, zeros, 64, bias), w4a16_linear(x, qweight, scales, zeros, 64, bias))
