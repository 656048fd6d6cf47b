"""engine/quantization/affine.py: the textbook formulas on hand-checked values."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.affine import (
    clip_search_ratios,
    dequantize,
    dequantize_tensor,
    pack_int4,
    qparams,
    quantize,
    quantize_tensor,
    unpack_int4,
)


def test_asymmetric_qparams_hand_checked() -> None:
    # [-1, 2] in 2 bits: s = 3 / 3 = 1, z = round(1 / 1) = 1.
    scale, zero = qparams(torch.tensor(-1.0), torch.tensor(2.0), bits=2, symmetric=False)
    assert scale.item() == 1.0 and zero.item() == 1
    # [-1, 2] in 4 bits: s = 3 / 15 = 0.2, z = round(5) = 5.
    scale, zero = qparams(torch.tensor(-1.0), torch.tensor(2.0), bits=4, symmetric=False)
    assert scale.item() == pytest.approx(0.2) and zero.item() == 5
    q = quantize(torch.tensor([-1.0, 0.0, 0.31, 2.0]), scale, zero, 4)
    assert q.tolist() == [0, 5, 7, 15]  # 0.31 / 0.2 = 1.55 -> 2, + 5
    torch.testing.assert_close(dequantize(q, scale, zero), torch.tensor([-1.0, 0.0, 0.4, 2.0]))


def test_range_always_contains_zero() -> None:
    # All-positive data: r_min is taken as 0, so z = 0 and 0.0 is exact.
    scale, zero = qparams(torch.tensor(1.0), torch.tensor(3.0), bits=8, symmetric=False)
    assert zero.item() == 0 and scale.item() == pytest.approx(3.0 / 255)


def test_symmetric_zero_point_is_half_range() -> None:
    for bits in (4, 8):
        scale, zero = qparams(torch.tensor(-0.5), torch.tensor(2.0), bits=bits, symmetric=True)
        assert zero.item() == 2 ** (bits - 1)
        assert scale.item() == pytest.approx(4.0 / (2**bits - 1))


def test_saturation_at_both_ends() -> None:
    scale, zero = torch.tensor(1.0), torch.tensor(1)
    q = quantize(torch.tensor([-5.0, -1.0, 2.0, 3.7, 1e6]), scale, zero, bits=2)
    assert q.tolist() == [0, 0, 3, 3, 3]
    assert dequantize(q, scale, zero).tolist() == [-1.0, -1.0, 2.0, 2.0, 2.0]
    q8 = quantize(torch.tensor([-1e9, 1e9]), torch.tensor(0.01), torch.tensor(128), bits=8)
    assert q8.tolist() == [0, 255]


def test_halfway_value_has_error_exactly_half_a_step() -> None:
    scale, zero = torch.tensor(1.0), torch.tensor(1)
    r = torch.tensor([0.5, 1.5, -0.5])  # each halfway between two levels
    err = (dequantize(quantize(r, scale, zero, 2), scale, zero) - r).abs()
    assert err.tolist() == [0.5, 0.5, 0.5]


def test_in_range_error_never_exceeds_half_a_step() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    for bits in (4, 8):
        qt = quantize_tensor(w, bits, 64)
        s = qt.scale.repeat_interleave(64, dim=1)
        err = (dequantize_tensor(qt) - w).abs()
        assert (err <= s / 2 + 1e-6).all()
        # ... and the bound is nearly attained (the step really is s).
        assert (err / s).max() > 0.45


def test_int4_int8_step_ratio_is_17() -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    for granularity in ("tensor", "channel", 32):
        s4 = quantize_tensor(w, 4, granularity).scale
        s8 = quantize_tensor(w, 8, granularity).scale
        torch.testing.assert_close(s4 / s8, torch.full_like(s4, 255 / 15), rtol=1e-5, atol=0)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_per_group_beats_per_tensor_with_one_outlier(group_size: int) -> None:
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    w[3, 17] = 5.0
    mse = {
        g: (dequantize_tensor(quantize_tensor(w, 4, g)) - w).pow(2).mean().item()
        for g in ("tensor", "channel", group_size)
    }
    assert mse[group_size] < mse["channel"] < mse["tensor"]
    # Only one group of 16 * 256 / group_size gets the outlier's coarse step.
    assert mse[group_size] < mse["tensor"] / 10


def test_granularity_shapes() -> None:
    w = torch.randn(8, 128)
    assert quantize_tensor(w, 8, "tensor").scale.shape == (1, 1)
    assert quantize_tensor(w, 8, "channel").scale.shape == (8, 1)
    assert quantize_tensor(w, 4, 32).scale.shape == (8, 4)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_tensor(w, 4, 48)
    with pytest.raises(ValueError, match="granularity"):
        quantize_tensor(w, 4, "row")


def test_clip_search_never_worse_and_helps_heavy_tails() -> None:
    torch.manual_seed(3)
    w = torch.distributions.StudentT(2.0).sample((64, 128))  # heavy tails: clipping pays
    plain = (dequantize_tensor(quantize_tensor(w, 4, 128)) - w).pow(2).sum(1)
    clipped = (dequantize_tensor(quantize_tensor(w, 4, 128, clip_ratios=clip_search_ratios())) - w).pow(2).sum(1)
    assert (clipped <= plain + 1e-6).all()
    assert clipped.sum() < 0.97 * plain.sum()


def test_int4_pack_round_trip_and_gptq_order() -> None:
    q = torch.randint(0, 16, (24, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(4))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(unpack_int4(packed), q)
    # AutoGPTQ order: input column 8 i + j sits in bits 4 j of qweight[i, n].
    assert (int(packed[1, 5]) >> 12) & 0xF == q[5, 8 + 3]
    with pytest.raises(ValueError):
        pack_int4(torch.full((2, 8), 16))
