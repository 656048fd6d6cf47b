"""Batch invariance of the Triton attention (`--batch-invariant`): a query row's output bits
do not depend on the step around it (the steps: tests/kernels/invariance_steps.py). In
invariant mode every step shape gives the same bits for that position; the last test shows
the comparison has teeth: the default config does not.

Without CUDA the kernel runs in the Triton interpreter in float32 (small shapes); with CUDA
compiled in bf16, where the default config's split-K and tile choices change the bits too.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.triton_attention import choose_config, paged_attention  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402
from tests.kernels.invariance_steps import HEAD_DIM, NUM_KV_HEADS, TARGET_LEN, Steps, differing  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_attention was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE, DTYPE = ("cuda", torch.bfloat16) if ON_CUDA else ("cpu", torch.float32)
STEPS = Steps(paged_attention, DTYPE, DEVICE)


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_a_row_is_the_same_bits_in_every_step_shape(window: int | None) -> None:
    # The interpreter's cost is quadratic in the prompt: one whole prefill on CPU only.
    rows = STEPS.target_row_in_each_step(invariant=True, window=window, whole_prompt=not ON_CUDA)
    assert not any(row.isnan().any() for row in rows.values())
    assert differing(rows) == []


def test_invariant_config_is_one_config_whatever_the_batch() -> None:
    configs = {
        choose_config(tokens, seqs, 2, 3, 64, max_context=context, invariant=True)
        for tokens, seqs in ((1, 1), (3, 3), (64, 64), (100, 3), (512, 1))
        for context in (16, 1040, 8192)
    }
    assert len(configs) == 1 and next(iter(configs)).num_splits == 1


def test_the_comparison_has_teeth() -> None:
    """The default config splits a lone long decode and uses decode tiles: some of the same
    steps then give other bits for the same position (what invariant mode removes)."""
    assert choose_config(1, 1, NUM_KV_HEADS, 3, HEAD_DIM, max_context=TARGET_LEN + 8).num_splits > 1
    target = STEPS.target
    alone = STEPS.run_step([(target, TARGET_LEN, 1)], invariant=False)[0][-1]
    wide = STEPS.run_step([(target, TARGET_LEN, 1)], invariant=False, table_width=64)[0][-1]  # 4 splits, not 2
    in_chunk = STEPS.run_step([(target, TARGET_LEN, 16)], invariant=False)[0][-1]  # no split, prefill tiles
    assert not torch.equal(alone, wide) or not torch.equal(alone, in_chunk), (
        "the default config gave identical bits: the test above proves nothing")
