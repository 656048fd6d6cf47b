"""kernels/triton_copy.py: copy-on-write block copies equal the reference, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import reference  # noqa: E402
from kernels.triton_copy import copy_blocks  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_copy was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if ON_CUDA else "cpu"


def _caches(num_layers, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype=dtype, device=DEVICE) for _ in range(num_layers)]


@pytest.mark.parametrize(
    "block_size, pairs",
    [(1, [(0, 3)]), (16, [(2, 5), (7, 1)]), (32, [(4, 0), (1, 6), (3, 2)])],
    ids=["bs1-one-pair", "bs16-two-pairs", "bs32-three-pairs"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_copy_blocks_matches_reference(block_size, pairs, dtype):
    shape = (8, block_size, 2, 64)
    keys, values = _caches(2, shape, dtype, 0), _caches(2, shape, dtype, 1)
    ref_keys, ref_values = [k.clone() for k in keys], [v.clone() for v in values]
    mapping = torch.tensor(pairs, dtype=torch.int64, device=DEVICE)
    copy_blocks(keys, values, mapping)
    reference.copy_blocks(ref_keys, ref_values, mapping)
    for got, want in zip(keys + values, ref_keys + ref_values):
        assert torch.equal(got, want)
    for src, dst in pairs:
        assert torch.equal(keys[1][dst], keys[1][src])


@pytest.mark.parametrize(
    "mapping, message",
    [
        (torch.tensor([[0, 9]]), "block ids"),
        (torch.tensor([[-1, 2]]), "block ids"),
        (torch.tensor([0, 1]), r"\[num_pairs, 2\]"),
        (torch.tensor([[0, 1]], dtype=torch.int32), "int64"),
    ],
    ids=["dst-out-of-range", "negative", "wrong-shape", "int32"],
)
def test_copy_blocks_rejects_bad_mappings(mapping, message):
    caches = _caches(1, (8, 16, 2, 64), torch.float32, 0)
    with pytest.raises(ValueError, match=message):
        copy_blocks(caches, caches, mapping.to(DEVICE))
