"""The C++ LoRA delta (`cpu_kernels.lora_add`, engine/lora.py's bf16 CPU path): every row of a
step gets its own adapter's `(x @ A^T) @ B^T` added, base rows (-1) none, an adapter that
does not target the linear (an empty rank range) none; the result is the float64 reference
within the bf16 roundings (of the shrink's outputs and of the result), and a row's bits do
not depend on the other rows."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="lora_add needs AVX512-BF16")

K, N = 72, 100  # a K tail past 64 and an N tail past 96: the kernel's masked ends


def in_pairs(bt: torch.Tensor) -> torch.Tensor:
    """B^T [R, N] (R even) in the kernel's pair layout [R/2, 2N], as engine/lora.py stacks it."""
    R, n = bt.shape
    return bt.reshape(R // 2, 2, n).transpose(1, 2).reshape(R // 2, 2 * n).contiguous()


def _case(M: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Group 1 does not target this linear; group 2 has rank 3, padded with a zero column
    # (engine/lora.py pads odd ranks so that the pairs stay within one adapter).
    offsets = torch.tensor([0, 8, 8, 12], dtype=torch.int64)
    a = (torch.randn(12, K, generator=g) / K**0.5).to(torch.bfloat16)
    bt = (torch.randn(12, N, generator=g) * 0.5).to(torch.bfloat16)
    a[11], bt[11] = 0, 0
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    out = torch.randn(M, N, generator=g).to(torch.bfloat16)
    rows = torch.tensor([(0, -1, 1, 2)[i % 4] for i in range(M)], dtype=torch.int64)
    return out, x, a, bt, rows, offsets


def _reference(out, x, a, bt, rows, offsets) -> torch.Tensor:
    ref = out.double().clone()
    for m, g in enumerate(rows.tolist()):
        if g >= 0:
            o0, o1 = offsets[g].item(), offsets[g + 1].item()
            ref[m] += (x[m].double() @ a[o0:o1].double().T) @ bt[o0:o1].double()
    return ref


@pytest.mark.parametrize("M", [1, 3, 9])
def test_each_row_gets_its_own_adapters_delta(M: int) -> None:
    out, x, a, bt, rows, offsets = _case(M)
    before = out.clone()
    cpu_kernels.lora_add(out, x, a, in_pairs(bt), rows, offsets)
    ref = _reference(before, x, a, bt, rows, offsets)
    assert torch.allclose(out.double(), ref, rtol=2**-7, atol=1e-2), (out.double() - ref).abs().max()
    untouched = (rows == -1) | (rows == 1)
    assert torch.equal(out[untouched], before[untouched])
    assert not torch.equal(out[rows == 0], before[rows == 0])


def test_a_rows_bits_do_not_depend_on_the_other_rows() -> None:
    out, x, a, bt, rows, offsets = _case(9)
    together = out.clone()
    bp = in_pairs(bt)
    cpu_kernels.lora_add(together, x, a, bp, rows, offsets)
    for m in range(9):
        alone = out[m:m + 1].clone()
        cpu_kernels.lora_add(alone, x[m:m + 1].contiguous(), a, bp, rows[m:m + 1].contiguous(), offsets)
        assert torch.equal(alone[0], together[m]), m


def test_bad_groups_are_refused() -> None:
    out, x, a, bt, rows, offsets = _case(2)
    bp = in_pairs(bt)
    with pytest.raises(RuntimeError, match="row_group 3 not in"):
        cpu_kernels.lora_add(out, x, a, bp, torch.tensor([0, 3]), offsets)
    with pytest.raises(RuntimeError, match="offsets must rise"):
        cpu_kernels.lora_add(out, x, a, bp, rows, torch.tensor([0, 14], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="in pairs"):
        cpu_kernels.lora_add(out, x, a, bp, rows, torch.tensor([0, 3, 12], dtype=torch.int64))


def test_silu_mul_is_bf16_silu_mlps_activation() -> None:
    """`silu_mul` then the two linears through the kernel = `bf16_silu_mlp`, bit for bit (the
    per-op MLP of a step with LoRA rows gives base rows the bits of a step without)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    gate_up = (torch.randn(2 * 96, 64, generator=g) / 8).to(torch.bfloat16)
    down = (torch.randn(64, 96, generator=g) / 8).to(torch.bfloat16)
    gu_packed, down_packed = cpu_kernels.pack_bf16_weight(gate_up), cpu_kernels.pack_bf16_weight(down)
    split = cpu_kernels.bf16_linear(cpu_kernels.silu_mul(cpu_kernels.bf16_linear(x, gu_packed)), down_packed)
    assert torch.equal(split, cpu_kernels.bf16_silu_mlp(x, gu_packed, down_packed))
    gu = cpu_kernels.bf16_linear(x, gu_packed)
    eager = torch.nn.functional.silu(gu[:, :96]) * gu[:, 96:]
    assert torch.allclose(cpu_kernels.silu_mul(gu).float(), eager.float(), rtol=2**-7, atol=1e-3)
