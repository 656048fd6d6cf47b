"""kernels/triton_cache.py: exactly the mapped slots are written, bit for bit; -1 skips.

Without CUDA the kernel runs in the Triton interpreter (TRITON_INTERPRET=1, set before
the kernel modules are imported); with CUDA the same cases run compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import reference  # noqa: E402
from kernels.triton_cache import reshape_and_cache  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_cache was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

_CPU = pytest.mark.skipif(ON_CUDA, reason="interpreter variant: this process compiles the kernels for CUDA")
_GPU = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
# A copy kernel: bfloat16 runs in the interpreter too (stored as 16-bit words).
VARIANTS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32", marks=_CPU),
    pytest.param(("cpu", torch.bfloat16), id="cpu-bf16", marks=_CPU),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=_GPU),
    pytest.param(("cuda", torch.float16), id="cuda-fp16", marks=_GPU),
]


def _nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8], ids=lambda h: f"kv{h}")
@pytest.mark.parametrize("block_size", [1, 16, 32, 128], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("num_tokens", [1, 17, 100], ids=lambda n: f"tokens{n}")
def test_writes_exactly_the_mapped_slots(num_tokens: int, block_size: int, num_kv_heads: int, variant) -> None:
    device, dtype = variant
    g = torch.Generator().manual_seed(5)
    head_dim = {1: 128, 3: 256, 8: 64}[num_kv_heads]  # every head_dim the kernels take
    num_blocks = 40 * 32 // block_size + 1
    num_slots = num_blocks * block_size
    key_cache = _nan_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    value_cache = torch.full_like(key_cache, float("nan"))
    slot_mapping = torch.randperm(num_slots, generator=g)[:num_tokens].to(torch.int64)
    # K/V as the model produces them: head-major views of a wider row (not contiguous).
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=g).to(dtype)
    key = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    expected_k, expected_v = key_cache.cpu().clone(), value_cache.cpu().clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)

    reshape_and_cache(key.to(device), value.to(device), key_cache, value_cache, slot_mapping.to(device))

    torch.testing.assert_close(key_cache.cpu(), expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache.cpu(), expected_v, atol=0, rtol=0, equal_nan=True)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert key_cache.view(num_slots, -1).cpu()[untouched].isnan().all()
    assert not key_cache.view(num_slots, -1).cpu()[~untouched].isnan().any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_slot_minus_one_skips_the_token(variant) -> None:
    device, dtype = variant
    key_cache = _nan_cache(4, 16, 2, 64, dtype, device)
    value_cache = torch.full_like(key_cache, float("nan"))
    key = torch.randn(3, 2, 64).to(dtype).to(device)
    value = torch.randn(3, 2, 64).to(dtype).to(device)
    slot_mapping = torch.tensor([5, -1, 63], dtype=torch.int64, device=device)

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    flat_k, flat_v = key_cache.view(64, 2, 64), value_cache.view(64, 2, 64)
    torch.testing.assert_close(flat_k[[5, 63]], key[[0, 2]], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[[5, 63]], value[[0, 2]], atol=0, rtol=0)
    assert int((~flat_k.isnan()).any(-1).any(-1).sum()) == 2
    assert int((~flat_v.isnan()).any(-1).any(-1).sum()) == 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_int32_slot_mapping(variant) -> None:
    device, dtype = variant
    key_cache = _nan_cache(8, 4, 2, 64, dtype, device)
    value_cache = torch.full_like(key_cache, float("nan"))
    key = torch.randn(2, 2, 64).to(dtype).to(device)
    value = torch.randn(2, 2, 64).to(dtype).to(device)
    reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([31, 0], dtype=torch.int32, device=device))
    torch.testing.assert_close(key_cache.view(32, 2, 64)[[31, 0]], key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache.view(32, 2, 64)[[31, 0]], value, atol=0, rtol=0)


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(("cpu", torch.float16), id="cpu-fp16", marks=_CPU),
        pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=_GPU),
    ],
)
def test_slots_past_32_bit_offsets(variant) -> None:
    # 2**20 + 16 blocks of 16 x 2 x 64: the last slots sit past 2**31 elements. The cache is
    # torch.empty, so only the pages written cost memory.
    device, dtype = variant
    block_size, num_blocks = 16, 2**20 + 16
    shape = (num_blocks, block_size, 2, 64)
    try:
        key_cache = torch.empty(shape, dtype=dtype, device=device)
        value_cache = torch.empty(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as e:
        pytest.skip(f"cannot reserve a cache of {num_blocks} blocks here: {e}")
    num_slots = num_blocks * block_size
    slot_mapping = torch.tensor([num_slots - 1, num_slots - block_size - 3, 2**24 + 7], dtype=torch.int64, device=device)
    assert int(slot_mapping.max()) * key_cache.stride(1) >= 2**31
    for block in (slot_mapping // block_size).tolist():
        key_cache[block] = float("nan")
        value_cache[block] = float("nan")
    key = torch.randn(3, 2, 64).to(dtype).to(device)
    value = torch.randn(3, 2, 64).to(dtype).to(device)

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    flat_k, flat_v = key_cache.view(num_slots, 2, 64), value_cache.view(num_slots, 2, 64)
    torch.testing.assert_close(flat_k[slot_mapping], key, atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slot_mapping], value, atol=0, rtol=0)
    # Nothing else in those blocks was written (a wrapped offset would land elsewhere).
    for block in (slot_mapping // block_size).tolist():
        assert int((~key_cache[block].isnan()).any(-1).any(-1).sum()) == 1


def _args(**changes):
    args = dict(
        key=torch.randn(3, 2, 64),
        value=torch.randn(3, 2, 64),
        key_cache=torch.zeros(4, 16, 2, 64),
        value_cache=torch.zeros(4, 16, 2, 64),
        slot_mapping=torch.tensor([0, 1, 2]),
    )
    args.update(changes)
    return args


BAD_ARGS = {
    "head_dim_32": (
        _args(
            key=torch.randn(3, 2, 32), value=torch.randn(3, 2, 32),
            key_cache=torch.zeros(4, 16, 2, 32), value_cache=torch.zeros(4, 16, 2, 32),
        ),
        "head_dim",
    ),
    "block_size_3": (_args(key_cache=torch.zeros(4, 3, 2, 64), value_cache=torch.zeros(4, 3, 2, 64)), "block_size"),
    "block_size_256": (_args(key_cache=torch.zeros(1, 256, 2, 64), value_cache=torch.zeros(1, 256, 2, 64)), "block_size"),
    "kv_heads_mismatch": (_args(key=torch.randn(3, 1, 64), value=torch.randn(3, 1, 64)), "match"),
    "dtype_mismatch": (_args(key=torch.randn(3, 2, 64).half()), "dtype"),
    "float64": (
        _args(
            key=torch.randn(3, 2, 64).double(), value=torch.randn(3, 2, 64).double(),
            key_cache=torch.zeros(4, 16, 2, 64).double(), value_cache=torch.zeros(4, 16, 2, 64).double(),
        ),
        "dtype",
    ),
    "float_slot_mapping": (_args(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "slot_mapping"),
    "short_slot_mapping": (_args(slot_mapping=torch.tensor([0, 1])), "slot_mapping"),
    "non_contiguous_cache": (_args(key_cache=torch.zeros(16, 4, 2, 64).transpose(0, 1)), "contiguous"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS.values()), ids=list(BAD_ARGS))
def test_rejects_unsupported_arguments(case) -> None:
    args, message = case
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)
