"""kernels/triton_w4a16.py against kernels/quant_reference.py (interpreter on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from engine.quantization.affine import pack_int4  # noqa: E402
from kernels.quant_reference import w4a16_linear_ref  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402
from kernels.triton_w4a16 import w4a16_linear  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_w4a16 was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if ON_CUDA else "cpu"
# fp32 tl.dot is exact in the interpreter; on CUDA it runs in TF32 (10-bit mantissa).
TOL = {"rtol": 2e-2, "atol": 2e-2} if ON_CUDA else {"rtol": 1e-5, "atol": 1e-5}
# (M, N, K, group): odd M and N around the 16 x 32 tile; K = 1 or several groups.
CASES = [(1, 33, 64, 32), (15, 31, 64, 64), (17, 65, 128, 128), (3, 96, 256, 64), (16, 32, 96, 32)]
IDS = [f"{m}x{n}x{k}-g{g}" for m, n, k, g in CASES]


def _inputs(m: int, n: int, k: int, group: int, has_zeros: bool):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.01
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.int32, generator=gen) if has_zeros else None
    bias = torch.randn(n, generator=gen)
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return move(x), move(pack_int4(q)), move(scales), move(zeros), move(bias)


@pytest.mark.parametrize("has_zeros", [True, False], ids=["zeros", "symmetric"])
@pytest.mark.parametrize(("m", "n", "k", "group"), CASES, ids=IDS)
def test_dequantize_then_gemm_matches_reference(m: int, n: int, k: int, group: int, has_zeros: bool) -> None:
    x, qweight, scales, zeros, bias = _inputs(m, n, k, group, has_zeros)
    # Dequantize first: x = identity rows recover the dequantized weight, column by column.
    eye = torch.eye(k, device=DEVICE)
    w_kernel = w4a16_linear(eye, qweight, scales, zeros, group)  # [K, N] = W^T
    w_ref = w4a16_linear_ref(eye, qweight, scales, zeros, group)
    torch.testing.assert_close(w_kernel, w_ref, **TOL)
    torch.testing.assert_close(
        w4a16_linear(x, qweight, scales, zeros, group, bias),
        w4a16_linear_ref(x, qweight, scales, zeros, group, bias),
        **TOL,
    )


def test_rejects_bad_group() -> None:
    x, qweight, scales, zeros, _ = _inputs(1, 32, 64, 32, True)
    with pytest.raises(ValueError):
        w4a16_linear(x, qweight, scales, zeros, 48)
