"""kernels/triton_attention.py against a dense float64 reference, on awkward shapes.

Without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set here
before the kernel modules are imported: Triton reads it at @triton.jit time) in float32,
plus a few float16 cases; bfloat16 needs the GPU (the interpreter's tl.dot is numpy,
which has no bfloat16). With CUDA the same cases run compiled in bfloat16 and float16.
Outputs are poisoned with NaN before each call, so a row left unwritten fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from paged_batches import assert_close_to_reference, make_batch  # noqa: E402

from kernels.triton_attention import AttentionConfig, choose_config, launch_paged_attention, paged_attention  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_attention was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

# Device of the cases that are not about dtypes (argument checks, empty batch).
DEVICE = "cuda" if ON_CUDA else "cpu"
_CPU = pytest.mark.skipif(ON_CUDA, reason="interpreter variant: this process compiles the kernels for CUDA")
_GPU = pytest.mark.skipif(not ON_CUDA, reason="GPU variant (compiled bf16/fp16): needs CUDA")
# (device, dtype) every correctness case runs in.
VARIANTS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32", marks=_CPU),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=_GPU),
    pytest.param(("cuda", torch.float16), id="cuda-fp16", marks=_GPU),
]
# The interpreter also runs a few float16 cases (numpy matmul in float32 of fp16 inputs).
VARIANTS_WITH_CPU_FP16 = VARIANTS + [pytest.param(("cpu", torch.float16), id="cpu-fp16", marks=_CPU)]

CONTEXT_LENS = [1, 15, 16, 17, 1025]
# A full prefill is quadratic in its length: in the interpreter (~5 s a case at 1025) the
# longest is 300 tokens, still many query and key tiles with the causal edge inside them.
PREFILL_CONTEXT_LENS = [1, 15, 16, 17, 1025 if ON_CUDA else 300]
BLOCK_SIZES = [1, 16, 32]
# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8.
HEAD_CONFIGS = [(2, 2), (6, 2), (8, 1)]
HEAD_DIMS = [64, 128, 256]


def run_kernel(batch, config: AttentionConfig | None = None, window: int | None = None) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    if config is None:
        result = paged_attention(*batch.args(), batch.scale, out=out, sliding_window=window)
    else:
        result = launch_paged_attention(*batch.args(), batch.scale, out, config, sliding_window=window)
    assert result is out
    return out


def check(batch, config: AttentionConfig | None = None, window: int | None = None) -> None:
    assert_close_to_reference(run_kernel(batch, config, window), batch, window)


@pytest.mark.parametrize("variant", VARIANTS_WITH_CPU_FP16)
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("seq_len", CONTEXT_LENS, ids=lambda n: f"ctx{n}")
def test_decode(seq_len: int, block_size: int, variant) -> None:
    device, dtype = variant
    # A second, shorter decode in the batch pads its block table row with block 0.
    batch = make_batch(
        [(seq_len, 1), (3, 1)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size,
        dtype=dtype, device=device,
    )
    check(batch)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("seq_len", PREFILL_CONTEXT_LENS, ids=lambda n: f"ctx{n}")
def test_full_prefill(seq_len: int, block_size: int, variant) -> None:
    device, dtype = variant
    batch = make_batch(
        [(seq_len, seq_len)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size,
        dtype=dtype, device=device,
    )
    check(batch)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("seq_len", [16, 17, 1025], ids=lambda n: f"ctx{n}")
def test_prefill_chunk_after_cached_tokens(seq_len: int, block_size: int, variant) -> None:
    device, dtype = variant
    # The chunk starts mid-block: its first query token sees cached tokens of its own block.
    q_len = seq_len - 7 if seq_len < 1000 else 70
    batch = make_batch(
        [(seq_len, q_len)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size,
        dtype=dtype, device=device,
    )
    check(batch)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_gqa_mixed_batch(heads: tuple[int, int], head_dim: int, variant) -> None:
    device, dtype = variant
    num_heads, num_kv_heads = heads
    seqs = [(17, 1), (40, 9), (1, 1), (33, 33), (16, 1)]
    batch = make_batch(
        seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
        dtype=dtype, device=device,
    )
    check(batch)


MIXED_BATCHES = {
    "decodes_then_chunks": [(15, 1), (17, 1), (1, 1), (100, 37), (64, 64), (1025, 1)],
    "chunks_then_decodes": [(33, 2), (5, 5), (48, 1), (129, 1), (31, 30)],
    "interleaved": [(2, 1), (90, 45), (16, 1), (3, 3), (1025, 40), (200, 1)],
}


@pytest.mark.parametrize("variant", VARIANTS_WITH_CPU_FP16)
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("seqs", list(MIXED_BATCHES.values()), ids=list(MIXED_BATCHES))
def test_mixed_decode_and_prefill_batch(seqs: list[tuple[int, int]], block_size: int, variant) -> None:
    device, dtype = variant
    batch = make_batch(
        seqs, num_heads=6, num_kv_heads=2, head_dim=128, block_size=block_size, dtype=dtype, device=device, seed=1
    )
    check(batch)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
def test_shuffled_block_table(block_size: int, variant) -> None:
    device, dtype = variant
    seqs = [(37, 1), (70, 20), (16, 16), (5, 1)]
    needed = sum(math.ceil(s / block_size) for s, _ in seqs)
    batch = make_batch(
        seqs, num_heads=8, num_kv_heads=1, head_dim=64, block_size=block_size, num_blocks=2 * needed + 5,
        block_order="shuffled", dtype=dtype, device=device, seed=2,
    )
    check(batch)


# Block ids past 2**20 with 16 x 2 x 64 elements per block: id x block stride > 2**31, which
# a 32-bit offset would wrap. float16 keeps the untouched cache at 4 GiB of address space.
HUGE_NUM_BLOCKS = 2**20 + 64
HUGE_VARIANTS = [
    pytest.param(("cpu", torch.float16), id="cpu-fp16", marks=_CPU),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=_GPU),
    pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=_GPU),
]


def _make_huge_batch(seqs, device, dtype, seed):
    try:
        return make_batch(
            seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=HUGE_NUM_BLOCKS,
            block_order="highest", huge=True, dtype=dtype, device=device, seed=seed,
        )
    except (RuntimeError, MemoryError) as e:  # the OS refused the address space, not a kernel failure
        pytest.skip(f"cannot reserve a cache of {HUGE_NUM_BLOCKS} blocks here: {e}")


@pytest.mark.parametrize("variant", HUGE_VARIANTS)
@pytest.mark.parametrize(
    "seqs", [[(33, 1), (20, 1)], [(33, 1), (20, 20), (40, 9)]], ids=["decodes", "mixed"]
)
def test_block_ids_past_32_bit_offsets(seqs, variant) -> None:
    device, dtype = variant
    batch = _make_huge_batch(seqs, device, dtype, seed=3)
    stride = batch.key_cache.stride(0)
    assert int(batch.block_tables.max()) * stride >= 2**31
    check(batch)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "seqs", [[(17, 1), (3, 1)], [(40, 9)], [(17, 1), (40, 9), (5, 5)]], ids=["decodes", "prefill_chunk", "mixed"]
)
def test_slots_not_owned_do_not_leak(seqs: list[tuple[int, int]], variant) -> None:
    # Block-tail slots past seq_len and padded table entries (block 0) can hold anything a
    # freed block left behind. Non-finite garbage there must not reach the output.
    device, dtype = variant
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, device=device, seed=4)
    not_owned = ~batch.owned_slots.to(device)
    batch.key_cache.view(-1, 2, 64)[not_owned] = float("nan")
    batch.value_cache.view(-1, 2, 64)[not_owned] = float("inf")
    check(batch)


# Split-K forced on batches the config table would not split: prefill chunks in a split
# batch, more splits than key tiles (empty splits), every split count the table can pick.
SPLIT_CASES = {
    "decodes_2": ([(1025, 1), (17, 1), (1, 1)], 2),
    "decodes_16": ([(300, 1), (64, 1), (2, 1)], 16),
    "mixed_4": ([(70, 20), (16, 1), (33, 33)], 4),
    "more_splits_than_tiles_8": ([(5, 1), (17, 3)], 8),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", [1, 16], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("case", list(SPLIT_CASES.values()), ids=list(SPLIT_CASES))
def test_forced_split_k(case, block_size: int, variant) -> None:
    device, dtype = variant
    seqs, num_splits = case
    batch = make_batch(
        seqs, num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype, device=device, seed=5
    )
    check(batch, AttentionConfig(block_m=16, tile_n=32, num_splits=num_splits, num_warps=4))


@pytest.mark.parametrize("variant", VARIANTS)
def test_caller_owned_split_k_scratch(variant) -> None:
    device, dtype = variant
    batch = make_batch([(200, 1), (90, 1)], num_heads=8, num_kv_heads=1, head_dim=128, block_size=16, dtype=dtype, device=device)
    shape = (2, 8, 4)
    partial_out = torch.full((*shape, 128), float("nan"), device=device)
    partial_max = torch.full(shape, float("nan"), device=device)
    partial_sum = torch.full(shape, float("nan"), device=device)
    out = torch.full_like(batch.query, float("nan"))
    config = AttentionConfig(block_m=16, tile_n=32, num_splits=4, num_warps=4)
    launch_paged_attention(*batch.args(), batch.scale, out, config, partial_out, partial_max, partial_sum)
    assert_close_to_reference(out, batch)
    assert not partial_max.isnan().any(), "every split writes its partial max, even an empty one"


# Sliding windows smaller and larger than the block size (16) and than a key tile; the
# contexts reach past the window so whole tiles before it are skipped.
WINDOW_CASES = {
    "decodes_w5": ([(70, 1), (3, 1), (33, 1)], 5),
    "decodes_w40": ([(70, 1), (3, 1), (33, 1)], 40),
    "prefill_w7": ([(50, 50)], 7),
    "chunks_w23": ([(60, 20), (33, 9), (5, 1)], 23),
    "mixed_w16": ([(15, 1), (100, 37), (40, 40), (129, 1)], 16),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", list(WINDOW_CASES.values()), ids=list(WINDOW_CASES))
def test_sliding_window(case, variant) -> None:
    device, dtype = variant
    seqs, window = case
    batch = make_batch(
        seqs, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=40, block_order="shuffled",
        dtype=dtype, device=device, seed=window,
    )
    check(batch, window=window)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("num_splits", [2, 4])
def test_sliding_window_with_split_k(num_splits: int, variant) -> None:
    # The splits cover only the tiles from the window's start; a split may see no key at all.
    device, dtype = variant
    batch = make_batch([(300, 1), (45, 1), (70, 9)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=dtype, device=device, seed=11)
    check(batch, AttentionConfig(block_m=16, tile_n=16, num_splits=num_splits, num_warps=4), window=20)


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_dim_256_with_a_window(variant) -> None:
    """Gemma 3's shape: head_dim 256, GQA, a local window shorter than the prompt, decodes
    and a prefill chunk in one batch."""
    device, dtype = variant
    batch = make_batch([(40, 1), (30, 12), (9, 9)], num_heads=4, num_kv_heads=1, head_dim=256, block_size=16,
                       dtype=dtype, device=device, seed=12)
    check(batch)
    check(batch, window=8)


def test_window_check_can_fail() -> None:
    batch = make_batch([(40, 1), (30, 12)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device=DEVICE)
    with pytest.raises(AssertionError):
        assert_close_to_reference(run_kernel(batch), batch, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        run_kernel(batch, window=0)


def test_config_table_splits_only_long_decode_batches() -> None:
    # The decode cases above at context 1025 take the split-K path by default.
    assert choose_config(2, 2, 2, 3, 64, max_context=1040).num_splits > 1
    assert choose_config(64, 64, 8, 4, 128, max_context=1024).num_splits == 1  # enough programs already
    assert choose_config(16, 16, 8, 4, 128, max_context=4096).num_splits > 1
    assert choose_config(2, 2, 2, 3, 64, max_context=32).num_splits == 1  # too short to split
    assert choose_config(40, 2, 2, 3, 64, max_context=2048).num_splits == 1  # prefill in the batch
    for tokens, seqs in ((1, 1), (100, 3)):
        for ratio in (1, 3, 8):
            for head_dim in HEAD_DIMS:
                c = choose_config(tokens, seqs, 1, ratio, head_dim, max_context=4096)
                assert c.block_m >= 16 and c.block_m >= ratio and c.tile_n >= 16


@pytest.mark.parametrize("variant", VARIANTS)
def test_check_catches_a_wrong_block_table(variant) -> None:
    # The comparison above must be able to fail: swap two sequences' block rows.
    device, dtype = variant
    batch = make_batch([(40, 1), (40, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, device=device)
    batch.block_tables = batch.block_tables.flip(0).contiguous()
    with pytest.raises(AssertionError):
        check(batch)


def _valid_args(device: str = DEVICE, dtype: torch.dtype = torch.float32) -> dict:
    batch = make_batch([(20, 1), (9, 3)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, device=device)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")
    return dict(zip(names, batch.args()), scale=0.125)


def _with(**changes):
    def edit(args: dict) -> dict:
        for name, fn in changes.items():
            args[name] = fn(args)
        return args

    return edit


def _cache_shape(block_size=None, kv_heads=None, head_dim=None):
    def fn(args):
        nb, bs, kv, d = args["key_cache"].shape
        return torch.randn(nb, block_size or bs, kv_heads or kv, head_dim or d)

    return fn


BAD_ARGS = {
    "head_dim_32": (
        _with(
            query=lambda a: torch.randn(4, 4, 32),
            key_cache=_cache_shape(head_dim=32),
            value_cache=_cache_shape(head_dim=32),
        ),
        "head_dim",
    ),
    "block_size_256": (_with(key_cache=_cache_shape(block_size=256), value_cache=_cache_shape(block_size=256)), "block_size"),
    "block_size_3": (_with(key_cache=_cache_shape(block_size=3), value_cache=_cache_shape(block_size=3)), "block_size"),
    "gqa_ratio_16": (
        _with(query=lambda a: torch.randn(4, 16, 64), key_cache=_cache_shape(kv_heads=1), value_cache=_cache_shape(kv_heads=1)),
        "ratio",
    ),
    "heads_not_a_multiple": (_with(query=lambda a: torch.randn(4, 3, 64)), "multiple"),
    "float64": (
        _with(
            query=lambda a: a["query"].double(),
            key_cache=lambda a: a["key_cache"].double(),
            value_cache=lambda a: a["value_cache"].double(),
        ),
        "dtype",
    ),
    "mixed_dtypes": (_with(key_cache=lambda a: a["key_cache"].half()), "dtype"),
    "int64_block_tables": (_with(block_tables=lambda a: a["block_tables"].long()), "int32"),
    "int64_seq_lens": (_with(seq_lens=lambda a: a["seq_lens"].long()), "int32"),
    "query_start_loc_too_short": (_with(query_start_loc=lambda a: a["query_start_loc"][:-1]), "query_start_loc"),
    "non_contiguous_cache": (
        _with(key_cache=lambda a: a["key_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
        "contiguous",
    ),
    "strided_head_dim": (_with(query=lambda a: torch.randn(4, 4, 128)[:, :, ::2]), "stride"),
    "value_cache_shape": (_with(value_cache=_cache_shape(block_size=32)), "value_cache"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS.values()), ids=list(BAD_ARGS))
def test_rejects_unsupported_arguments(case) -> None:
    edit, message = case
    args = edit(_valid_args())
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)


@_CPU
def test_bfloat16_on_cpu_is_refused_not_wrong() -> None:
    args = _valid_args("cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        paged_attention(**args)


def test_empty_batch_is_a_no_op() -> None:
    args = _valid_args()
    args["query"] = args["query"][:0]
    args["block_tables"] = args["block_tables"][:0]
    args["seq_lens"] = args["seq_lens"][:0]
    args["query_start_loc"] = args["query_start_loc"][:1]
    assert paged_attention(**args).shape == (0, 4, 64)

