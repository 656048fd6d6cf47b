"""Batch invariance of the Triton weight-only GEMMs (`--batch-invariant`): a row's output bits
do not depend on how many rows share the call.

The default configs change BLOCK_K and split-K with M (a decode's 1-16 rows, a prefill's
17-64, larger prefills), so the same row computed beside 0, 2, 15, 16, 63 or 129 other rows
sums its K products in other orders. `invariant=True` takes one config at every M; the
last test shows the comparison has teeth. Interpreter in float32 on CPU (small shapes),
compiled in bf16 on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from engine.quantization.affine import pack_int4  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402
from kernels.triton_w4a16 import w4a16_linear  # noqa: E402
from kernels.triton_w8a16 import w8a16_linear  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("the Triton GEMMs were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE, DTYPE = ("cuda", torch.bfloat16) if ON_CUDA else ("cpu", torch.float32)
# K = 576 (SmolLM2's hidden size): several K blocks of either width; N = 130: few N tiles,
# so the default config splits K for decode-sized calls.
N, K, GROUP = 130, 576, 64
ROW_COUNTS = [1, 3, 16, 17, 64, 130]


def _w4a16(invariant: bool):
    g = torch.Generator().manual_seed(1)
    qweight = pack_int4(torch.randint(0, 16, (N, K), dtype=torch.int32, generator=g)).to(DEVICE)
    scales = (torch.rand(K // GROUP, N, generator=g) * 0.02 + 0.01).to(DEVICE, DTYPE)
    zeros = torch.randint(0, 16, (K // GROUP, N), dtype=torch.uint8, generator=g).to(DEVICE)
    bias = torch.randn(N, generator=g).to(DEVICE, DTYPE)
    return lambda x: w4a16_linear(x, qweight, scales, zeros, GROUP, bias, invariant=invariant)


def _w8a16(invariant: bool):
    g = torch.Generator().manual_seed(2)
    qweight = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g).to(DEVICE)
    scales = (torch.rand(N, generator=g) * 0.02 + 0.01).to(DEVICE, DTYPE)
    bias = torch.randn(N, generator=g).to(DEVICE, DTYPE)
    return lambda x: w8a16_linear(x, qweight, scales, bias, invariant=invariant)


GEMMS = {"w4a16": _w4a16, "w8a16": _w8a16}
X = torch.randn(max(ROW_COUNTS), K, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)


def first_rows_by_row_count(gemm) -> dict[int, torch.Tensor]:
    """The first 3 rows' outputs when the call has M rows (the first 3 of X, then others)."""
    return {m: gemm(X[:m])[:3].cpu() if m >= 3 else gemm(X[:m]).cpu() for m in ROW_COUNTS}


def differing(rows: dict[int, torch.Tensor]) -> list[int]:
    return [m for m, out in rows.items() if not torch.equal(out[:1], rows[1][:1])
            or (m >= 3 and not torch.equal(out, rows[3]))]


@pytest.mark.parametrize("name", list(GEMMS))
def test_a_row_is_the_same_bits_at_every_row_count(name: str) -> None:
    rows = first_rows_by_row_count(GEMMS[name](invariant=True))
    assert differing(rows) == []


@pytest.mark.parametrize("name", list(GEMMS))
def test_the_comparison_has_teeth(name: str) -> None:
    rows = first_rows_by_row_count(GEMMS[name](invariant=False))
    assert differing(rows), "the default configs gave identical bits at every M: the test above proves nothing"
