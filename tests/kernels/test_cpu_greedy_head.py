"""The LM head of a greedy step (kernels/greedy_head.py, csrc/cpu_kernels.cpp
`argmax_head_logits_impl`): its int8 copy's bound, and logits that are the whole bf16 head's
bits wherever they are finite, with the whole head's argmax (first index of the maximum),
on heads whose race is wide or close, with tied tokens, and on rows that are not finite."""

from __future__ import annotations

import sys

import pytest
import torch

from kernels import cpu_kernels
from kernels.cpu_kernels import unpack_bf16_weight
from kernels.greedy_head import greedy_head_copy

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU kernels are built on Linux only"),
    pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the CPU has no AVX512-BF16"),
]


def head(v: int, k: int, seed: int, std: float = 0.05) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(v, k, generator=g) * std).to(torch.bfloat16)


def rows(r: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, k, generator=g).to(torch.bfloat16)


def check(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The greedy head's logits of x, checked against the whole head's: equal bits where
    finite, -inf elsewhere, the same argmax. Returns which logits were computed exactly."""
    packed = cpu_kernels.pack_bf16_weight(weight)
    expected = cpu_kernels.bf16_linear(x, packed).float()
    got = cpu_kernels.argmax_head_logits(x, packed, greedy_head_copy(packed))
    assert got.dtype == torch.float32 and got.shape == expected.shape
    finite = torch.isfinite(got)
    assert torch.equal(got[finite], expected[finite])
    assert bool((got[~finite] == float("-inf")).all())
    assert torch.equal(cpu_kernels.argmax(got), cpu_kernels.argmax(expected))
    return finite


def test_the_copy_unpacks_the_packed_head_and_bounds_its_error():
    """The copy is made from the packed head's own values, and its scales and errors bound
    every weight: |w - s q| <= e per row, |q| <= 127."""
    weight = head(70, 45, seed=0)  # odd K and a part-filled last group of 32 rows
    weight[3] = 0  # a row of zeros: scale 1, error ~0
    packed = cpu_kernels.pack_bf16_weight(weight)
    assert torch.equal(unpack_bf16_weight(packed), weight)
    _, scales, errors = greedy_head_copy(packed)
    w = weight.double()
    s = scales.double()[:, None]
    q = torch.round(w / s)
    assert bool((q.abs() <= 127).all())
    assert bool(((w - s * q).abs().amax(dim=1) <= errors.double()).all())
    assert scales[3].item() == 1.0 and errors[3].item() < 1e-40  # 0, rounded up a step


@pytest.mark.parametrize("v, k", [(4096, 576), (1000, 64), (130, 96)])
@pytest.mark.parametrize("r", [1, 3, 4])
def test_exact_where_finite_and_the_same_argmax(v, k, r):
    check(rows(r, k, seed=v + r), head(v, k, seed=v))


def test_a_clear_winner_leaves_most_of_the_head_unread():
    """A row whose largest logit stands out (as a trained model's usually does) computes
    only a few groups of 32 exactly: the route's point, and proof it ran."""
    weight = head(4096, 256, seed=1)
    x = rows(1, 256, seed=2)
    weight[777] = (x[0].float() * 0.2).to(torch.bfloat16)  # token 777 aligned with the row
    finite = check(x, weight)
    assert bool(finite[0, 777]) and int(finite.sum()) <= 4 * 32


def test_tied_tokens_give_the_first_index():
    """Two tokens with the same weights, far apart and the later one in the earlier
    position of its group: both are computed and the argmax is the first."""
    weight = head(4096, 128, seed=3)
    x = rows(1, 128, seed=4)
    weight[3001] = (x[0].float() * 0.2).to(torch.bfloat16)
    weight[40] = weight[3001]
    finite = check(x, weight)
    assert bool(finite[0, 40]) and bool(finite[0, 3001])
    assert cpu_kernels.argmax(cpu_kernels.argmax_head_logits(
        x, cpu_kernels.pack_bf16_weight(weight), greedy_head_copy(cpu_kernels.pack_bf16_weight(weight)))).item() == 40


def test_a_race_of_every_token_computes_the_whole_head():
    """Every token's logit within the bound of the best (a head of equal rows): every group
    races, so every logit is the whole head's, and the argmax is token 0."""
    weight = head(1, 64, seed=5).repeat(2048, 1)
    x = rows(2, 64, seed=6)
    finite = check(x, weight)
    assert bool(finite.all())
    assert cpu_kernels.argmax(cpu_kernels.argmax_head_logits(
        x, cpu_kernels.pack_bf16_weight(weight), greedy_head_copy(cpu_kernels.pack_bf16_weight(weight)))).tolist() == [0, 0]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_row_that_is_not_finite_takes_the_whole_head(bad):
    """A hidden state with an inf or NaN: the whole head's logits (NaN, +-inf as they come),
    not a race decided on values that are not numbers; the other rows keep the route."""
    weight = head(2048, 64, seed=7)
    x = rows(2, 64, seed=8)
    x[1, 5] = bad
    packed = cpu_kernels.pack_bf16_weight(weight)
    expected = cpu_kernels.bf16_linear(x, packed).float()
    got = cpu_kernels.argmax_head_logits(x, packed, greedy_head_copy(packed))
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(cpu_kernels.argmax(got), cpu_kernels.argmax(expected))
    assert not bool(torch.isfinite(got[0]).all())


def test_a_copy_of_another_shape_is_refused():
    weight = head(64, 32, seed=9)
    packed = cpu_kernels.pack_bf16_weight(weight)
    other = greedy_head_copy(cpu_kernels.pack_bf16_weight(head(96, 32, seed=9)))
    with pytest.raises(RuntimeError, match="argmax head"):
        cpu_kernels.argmax_head_logits(rows(1, 32, seed=0), packed, other)


@pytest.mark.parametrize("seed", range(8))
def test_near_ties_are_settled_by_the_exact_head(seed):
    """512 tokens (16 of 128 groups) whose logits differ by less than the int8 copy's error
    (many of them tied once rounded to bf16), the rest far below: the copy's own order
    among them is not the head's (with no bound, seed 2 returns token 1692 where the head's
    first maximum is 1474); the bound keeps each one that can win in the race, and the
    result is the head's."""
    k = 256
    x = rows(1, k, seed=seed)
    weight = head(4096, k, seed=seed, std=0.01)
    g = torch.Generator().manual_seed(100 + seed)
    near = x[0].float() * 0.1 + 0.004 * torch.randn(512, k, generator=g)
    picked = torch.randperm(128, generator=g)[:16]
    weight[(picked[:, None] * 32 + torch.arange(32)).reshape(-1)] = near.to(torch.bfloat16)
    finite = check(x, weight)
    assert int(finite.sum()) <= 16 * 32  # the race, not the whole head
