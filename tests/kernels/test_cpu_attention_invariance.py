"""Batch invariance of the C++ CPU attention in bf16 (the default: `paged_attention(...,
invariant=True)`, `attention_invariant`): a query row's output bits do not depend on the
step around it (the steps: tests/kernels/invariance_steps.py): a decode alone or beside
others, from other blocks, or the row of a 16- or 64-token chunk or of a whole prefill. The
last two shapes take the route's many-row path (keys transposed, scores with the keys in the
lanes), the decodes its few-row path (per-row dot products): the same bits by construction,
checked here. The teeth: `--no-batch-invariant`'s routes give other bits."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels
from tests.kernels.invariance_steps import TARGET_LEN, Steps, differing

pytestmark = pytest.mark.skipif(not cpu_kernels.blocked_attention_runs(torch.bfloat16, 64),
                                reason="the bf16 C++ attention needs AVX512-BF16")

STEPS = Steps(cpu_kernels.paged_attention, torch.bfloat16, "cpu")


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_a_row_is_the_same_bits_in_every_step_shape(window: int | None) -> None:
    rows = STEPS.target_row_in_each_step(invariant=True, window=window)
    assert not any(row.isnan().any() for row in rows.values())
    assert differing(rows) == []


def test_the_invariant_route_is_close_to_the_reference() -> None:
    """The whole prompt through the invariant route against the float64 reference of the same
    bf16 inputs: each output within bf16 rounding of the weights and values."""
    from kernels import reference

    target = STEPS.target
    got = STEPS.run_step([(target, TARGET_LEN, TARGET_LEN)], invariant=True)[0]
    want = STEPS.run_step([(target, TARGET_LEN, TARGET_LEN)], invariant=True)[0]  # same bits run to run
    assert torch.equal(got, want)
    def in_float64(query, key_cache, value_cache, *args, invariant, **kw):
        return reference.paged_attention(query.double(), key_cache.double(), value_cache.double(), *args, **kw)

    ref = Steps(in_float64, torch.bfloat16, "cpu").run_step([(target, TARGET_LEN, TARGET_LEN)], invariant=False)[0]
    assert torch.allclose(got.double(), ref, atol=2e-2, rtol=2e-2), (got.double() - ref).abs().max()


def test_the_comparison_has_teeth() -> None:
    rows = STEPS.target_row_in_each_step(invariant=False)
    assert differing(rows), "the default routes gave identical bits: the test above proves nothing"
