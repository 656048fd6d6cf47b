"""Paged attention in Triton: one unified kernel for decode, prefill and extend, plus split-K.

Same semantics and signature as `kernels.reference.paged_attention`: each sequence's q_len
new query tokens are the last q_len positions of its seq_len cached tokens and attend
causally to positions 0..their own, or with a `sliding_window` W a query at p to the keys
p - W < k <= p only (a per-layer window: Mistral, Qwen2/3, Gemma 3's local layers).

Why one unified kernel (as vLLM's `triton_unified_attention`) rather than a decode kernel
plus a prefill kernel: the scheduler mixes decodes and prefill chunks in one step under
one token budget, so a step's batch is varlen anyway. A decode is just a sequence whose
q_len is 1, and a prefill chunk after cached tokens (chunked prefill, prefix-cache hit) is
the general case; one kernel over (query-token block of a sequence, KV head) covers both
with a single launch per layer, one code path to test, and no host-side split of the
batch (which would need the query lengths on the host: a device sync per layer).

- Grid axis 0 walks query blocks of BLOCK_Q tokens. Sequence i owns the programs
  `query_start_loc[i] // BLOCK_Q + i` up to the next sequence's start: an upper bound on
  its ceil(q_len / BLOCK_Q) blocks computed without a host sync; a program finds its
  sequence by binary search over query_start_loc and exits early when it has no tokens.
- GQA: a program takes all NUM_QUERIES_PER_KV query heads of one KV head together, so
  its BLOCK_M rows are BLOCK_Q tokens x that many heads and each K/V tile is read once
  for the whole group, never repeated in memory.
- The inner loop walks the keys in tiles of TILE_N positions, each key's block id looked
  up through the block table. A tile may span several KV blocks (block size 1..TILE_N)
  or part of one (block size > TILE_N), so every power-of-two block size 1..128 is the
  same code and `tl.dot` always sees >= 16 keys. Online softmax in fp32 (exp2, with the
  scale folded with log2(e)). Under a sliding window the loop starts at the tile holding
  the first key the block's first query sees: tiles wholly before every row's window are
  never read, so a decode reads O(window) keys, not O(context).
- Split-K (flash-decoding): a decode batch of few sequences x KV heads cannot fill the
  GPU, one program per (sequence, KV head) streaming a long context alone. Then grid
  axis 2 splits each sequence's key tiles into NUM_SPLITS ranges; each writes its
  partial (max, sum, unnormalised output) into caller-allocated fp32 scratch and a
  second kernel merges them. The split kernel is the same kernel (USE_SPLIT_K), valid
  for any batch; the config table only chooses it for decode-only batches.

Keys past seq_len (block tails, padded table entries) are never loaded: slots a sequence
does not own may hold anything a freed block left behind, inf/nan included.

A quantized cache (`kernels.kv_quant`: each (token, KV head) row is head_dim int8 codes or
FP8 E4M3 bits, then its bf16 scale) is read in place, the constexpr KV_QUANT (0 none,
1 int8, 2 fp8) choosing the loads, so the unquantized kernels are the same code as
without it. Each tile loads the codes and the tile's per-key scales; no dequantized copy
of the cache exists anywhere. The scales are applied where they cost least:
- K: a key's scale multiplies its whole column of scores, so the codes go into `tl.dot`
  as they are (cast to the query's dtype: int8 and E4M3 values are exact in fp16, bf16
  and fp32) and the scale joins the softmax scale, one multiply per score;
- V: the tile is dequantized in fp32 (codes x scale) and cast to the query's dtype, the
  values a cache in that dtype would hold. Folding V's scale into the probabilities
  instead would put p x scale through fp16, whose range underflows for small V rows.
The rows are head_dim + 2 bytes, so a tile's loads are only 2-byte aligned (the format
trades vector width for the scale sitting in its row).

All offsets are int64 (block id x block stride exceeds 2**31 elements in a large cache).
Values inside the metadata tensors (seq_lens vs the block table's width, ids below
num_blocks) are trusted, as in vLLM: checking them would need a device sync per layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels.triton_cache import check_quantized_caches, kv_quant_mode
from kernels.triton_runtime import check_device_runs_triton

_LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_GQA_RATIO = 8
MAX_BLOCK_SIZE = 128
# The kernel's window when there is none: wider than any context (q_pos - it stays in int32).
_NO_WINDOW = 2**31 - 1


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    q_block_global,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    # The last sequence i whose first program (query_start_loc[i] // BLOCK_Q + i) is <= ours.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_row_scales(cache_ptr, slot_off, valid, HEAD_DIM: tl.constexpr):
    # Each quantized row's scale: the bf16 in its two bytes after the codes (little-endian,
    # at an even offset), as fp32. Rows past seq_len are not read (garbage may be nan).
    bits = tl.load((cache_ptr + slot_off + HEAD_DIM).to(tl.pointer_type(tl.int16)), mask=valid, other=0)
    return bits.to(tl.bfloat16, bitcast=True).to(tl.float32)


@triton.jit
def _codes_to(codes, dtype: tl.constexpr, KV_QUANT: tl.constexpr):
    # A quantized tile's codes as values of `dtype` (before the scale): int8 integers, or the
    # uint8 bits of FP8 E4M3 (OCP "fn": no infinities) read as float8e4nv. Exact either way.
    if KV_QUANT == 1:
        return codes.to(dtype)
    else:
        return codes.to(tl.float8e4nv, bitcast=True).to(dtype)


# The batch size and the block table's width change every step: not specializing on them
# (== 1, % 16) keeps one compiled variant per config instead of new compiles mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]; unused when USE_SPLIT_K
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32; only when USE_SPLIT_K
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain; only when USE_SPLIT_K
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32; only when USE_SPLIT_K
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 2 bytes of scale when KV_QUANT)]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 2 bytes of scale when KV_QUANT)]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    sliding_window,  # a query at p sees keys p - sliding_window < k <= p (_NO_WINDOW: all of 0..p)
    stride_q_token: tl.int64,
    stride_q_head: tl.int64,
    stride_o_token: tl.int64,
    stride_o_head: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_token: tl.int64,
    stride_cache_head: tl.int64,
    stride_table_seq: tl.int64,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,  # the caches hold 0: values in the query's dtype; 1: int8 rows; 2: fp8 rows
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_local = q_block_global - (q_start // BLOCK_Q + seq_idx)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len  # tokens cached before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, TILE_N)
    q_local = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # [BLOCK_M] token within the sequence
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    head64 = head.to(tl.int64)
    q_offs = token[:, None] * stride_q_token + head64[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(query_ptr + q_offs, mask=row_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    q_pos = context_len + q_local  # [BLOCK_M] absolute position: sees keys q_pos - window < k <= q_pos

    # Keys any row of this block sees: from the first one its first query's window holds
    # to the position of its last query token.
    last_q_local = tl.minimum((q_block_local + 1) * BLOCK_Q, q_len) - 1
    num_keys = context_len + last_q_local + 1
    first_key = tl.maximum(context_len + q_block_local * BLOCK_Q - sliding_window + 1, 0)
    first_tile = first_key // TILE_N
    num_tiles = tl.cdiv(num_keys, TILE_N)
    if USE_SPLIT_K:
        tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_start = first_tile + split * tiles_per_split
        tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    else:
        tile_start = first_tile
        tile_end = num_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_table_seq
    kv_head_off = kv_head.to(tl.int64) * stride_cache_head
    for tile in range(tile_start, tile_end):
        key_pos = tile * TILE_N + offs_n  # [TILE_N]
        key_valid = key_pos < num_keys
        block_id = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot_off = (
            block_id * stride_cache_block + (key_pos % BLOCK_SIZE).to(tl.int64) * stride_cache_token + kv_head_off
        )  # [TILE_N] int64
        if KV_QUANT == 0:
            k = tl.load(key_cache_ptr + slot_off[None, :] + offs_d[:, None], mask=key_valid[None, :], other=0.0)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        else:
            # Rows are head_dim + 2 one-byte elements: every row starts at an even offset.
            slot_off = tl.multiple_of(slot_off, 2)
            k = tl.load(key_cache_ptr + slot_off[None, :] + offs_d[:, None], mask=key_valid[None, :], other=0)
            k_scale = _load_row_scales(key_cache_ptr, slot_off, key_valid, HEAD_DIM)  # [TILE_N] fp32
            k = _codes_to(k, q.dtype, KV_QUANT)  # exact: int8 / E4M3 values fit every float dtype
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * (k_scale * qk_scale)[None, :]
        visible = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        visible = visible & (key_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps max -inf; subtract 0 so exp2 gives 0, not nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_QUANT == 0:
            v = tl.load(value_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        else:
            v = tl.load(value_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0)
            v_scale = _load_row_scales(value_cache_ptr, slot_off, key_valid, HEAD_DIM)  # [TILE_N] fp32
            v = (_codes_to(v, tl.float32, KV_QUANT) * v_scale[:, None]).to(q.dtype)  # [TILE_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if USE_SPLIT_K:
        part = (token * num_heads + head64) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(partial_max_ptr + part, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
    else:
        o = acc / l_i[:, None]  # every valid row saw its own position's key, so l_i >= 1
        o_offs = token[:, None] * stride_o_token + head64[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] fp32
    partial_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32, log2 domain
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] fp32
    num_heads,
    stride_o_token: tl.int64,
    stride_o_head: tl.int64,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    part = (token * num_heads + head) * NUM_SPLITS + offs_s  # [NUM_SPLITS]
    m = tl.load(partial_max_ptr + part)
    l = tl.load(partial_sum_ptr + part)
    # Some split holds the query's own position, which it always sees, so the max is
    # finite; a split with no visible key has max -inf and weight 0.
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    denom = tl.sum(l * w, 0)
    acc = tl.load(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])  # [NUM_SPLITS, HEAD_DIM]
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + token * stride_o_token + head * stride_o_head + offs_d, o.to(out_ptr.dtype.element_ty))


# ---- configs ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    block_m: int  # rows per program: block_m // gqa_ratio query tokens x gqa_ratio heads
    tile_n: int  # keys per inner-loop tile, gathered through the block table (>= 16 for tl.dot)
    num_splits: int  # split-K ranges per sequence (power of two); 1 = no split
    num_warps: int


# (decode-only batch, head_dim) -> (block_m, tile_n, num_warps). Decodes have one query
# token per sequence, so 16 rows (the tl.dot minimum) hold a whole GQA group; prefill
# chunks fill 64 rows to amortise each K/V tile over more queries. Tiles carry ~8 KiB of
# K per step in 16-bit at either head dim. Starting points, not yet measured on the GPU:
# `loadtest/bench_kernels.py` is the measurement to tune them with.
_TILE_TABLE: dict[tuple[bool, int], tuple[int, int, int]] = {
    (True, 64): (16, 64, 4),
    (True, 128): (16, 32, 4),
    (True, 256): (16, 32, 4),
    (False, 64): (64, 64, 4),
    (False, 128): (64, 32, 4),
    # head_dim 256 (Gemma 3): half the query rows, so the fp32 accumulator [rows, 256]
    # stays in registers at 4 warps.
    (False, 256): (32, 32, 4),
}
# Split-K until (sequences x KV heads x splits) reaches about 4 programs per SM of an
# H100/H200 (132 SMs), keeping >= _MIN_KEYS_PER_SPLIT keys per split. Fixed numbers, not the
# local SM count, so the interpreter on CPU takes the same decisions as the GPU.
_SPLIT_TARGET_PROGRAMS = 512
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16


@functools.lru_cache(maxsize=4096)
def choose_config(
    num_tokens: int, num_seqs: int, num_kv_heads: int, gqa_ratio: int, head_dim: int, max_context: int,
    invariant: bool = False,
) -> AttentionConfig:
    """Config from shapes alone (no device sync, no autotuning; memoised per shape).

    `max_context` is the block table's width x block size: an upper bound of every
    sequence's length, known without reading seq_lens (the caller caps it at the sliding
    window: the keys one query reads).

    `invariant` (`--batch-invariant`): one config whatever the batch, so a query row's
    arithmetic never depends on the step around it. The default config changes with the
    batch in two ways that change a row's rounding: split-K (chosen for decode-only
    batches, with a split count from the number of sequences and the block table's width,
    which CUDA graphs pad to max_model_len) and the decode tile shape (a decode row and
    the same position's row in a prefill chunk would go through `tl.dot`s of different
    M). Invariant mode never splits and always takes the prefill tiles: every row walks
    its keys in TILE_N tiles at fixed absolute positions with one online softmax, and the
    tiles a row cannot see (past its position, before its window) are exact no-ops
    (p = 0, alpha = 1, or a row that has seen nothing yet stays at m = -inf, l = 0), so a
    decode row, a prefill row and a chunked-prefill row of the same context compute the
    same bits. The cost is decode parallelism on the GPU for few long sequences.
    """
    decode_only = num_tokens == num_seqs and not invariant
    block_m, tile_n, num_warps = _TILE_TABLE[(decode_only, head_dim)]
    block_m = max(block_m, triton.next_power_of_2(gqa_ratio))
    num_splits = 1
    if decode_only:
        while (
            num_splits < _MAX_SPLITS
            and num_seqs * num_kv_heads * num_splits < _SPLIT_TARGET_PROGRAMS
            and max_context >= 2 * num_splits * _MIN_KEYS_PER_SPLIT
        ):
            num_splits *= 2
    return AttentionConfig(block_m=block_m, tile_n=tile_n, num_splits=num_splits, num_warps=num_warps)


# ---- launch -------------------------------------------------------------------------------


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    sliding_window: int | None = None,
) -> None:
    """Shapes, dtypes, layouts and devices; raises ValueError (values are not read).

    The caches hold values in the query's dtype ([.., head_dim]) or quantized rows of any
    query dtype (int8 / uint8 = FP8, [.., head_dim + 2]: `kernels.kv_quant`).
    """
    if sliding_window is not None and not 1 <= sliding_window < _NO_WINDOW:
        raise ValueError(f"sliding_window must be in [1, {_NO_WINDOW}) or None, got {sliding_window}")
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim] and key_cache [num_blocks, block_size, "
            f"num_kv_heads, head_dim], got {tuple(query.shape)} and {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} != key_cache shape {tuple(key_cache.shape)}")
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_row = key_cache.shape
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {query.dtype}")
    if out.dtype != query.dtype:
        raise ValueError(f"out dtype {out.dtype} != query dtype {query.dtype}")
    quantized = kv_quant.is_quantized(key_cache)
    if quantized:
        # int8 / uint8 (fp8) rows of head_dim codes + a bf16 scale, read by any query dtype.
        check_quantized_caches(key_cache, value_cache, head_dim)
        cache_head_dim = cache_row - kv_quant.SCALE_BYTES
    else:
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            if t.dtype != query.dtype:
                raise ValueError(
                    f"{name} dtype {t.dtype} != query dtype {query.dtype} (a quantized cache is int8 or uint8)"
                )
        cache_head_dim = cache_row
    if head_dim not in SUPPORTED_HEAD_DIMS or cache_head_dim != head_dim:
        raise ValueError(
            f"head_dim must be one of {SUPPORTED_HEAD_DIMS} in query and caches, got {head_dim} and {cache_head_dim}"
            + (f" (the quantized cache's rows of {cache_row} less the 2 scale bytes)" if quantized else "")
        )
    if not _is_power_of_two(block_size) or block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads or not 1 <= num_heads // num_kv_heads <= MAX_GQA_RATIO:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) "
            f"with a ratio in [1, {MAX_GQA_RATIO}]"
        )
    if out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks], seq_lens [num_seqs], query_start_loc "
            f"[num_seqs + 1]; got {tuple(block_tables.shape)}, {tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}"
        )
    if block_tables.shape[1] < 1:
        raise ValueError("block_tables must have at least one column")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if query.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("query and out must be contiguous in head_dim (stride 1)")
    if block_tables.stride(1) != 1 or not (seq_lens.is_contiguous() and query_start_loc.is_contiguous()):
        raise ValueError("block_tables rows, seq_lens and query_start_loc must be contiguous")
    tensors = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
    if any(t.device != query.device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    check_device_runs_triton(query.device)
    if query.device.type == "cpu" and query.dtype == torch.bfloat16:
        raise ValueError("the Triton interpreter cannot run bfloat16 tl.dot (numpy has no bfloat16); use float16/32 on CPU")


def launch_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or head_dim + 2 int8/uint8
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or head_dim + 2 int8/uint8
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    config: AttentionConfig,
    partial_out: torch.Tensor | None = None,  # [num_tokens, num_heads, num_splits, head_dim] fp32
    partial_max: torch.Tensor | None = None,  # [num_tokens, num_heads, num_splits] fp32
    partial_sum: torch.Tensor | None = None,  # [num_tokens, num_heads, num_splits] fp32
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged attention with an explicit config and optional caller-owned split-K scratch.

    For tests (forcing split-K on any batch), benchmarks and callers that preallocate
    scratch (CUDA graphs); `paged_attention` picks the config itself.
    """
    check_paged_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, sliding_window
    )
    group = query.shape[1] // key_cache.shape[2]
    c = config
    if not (_is_power_of_two(c.block_m) and c.block_m >= max(16, group)):
        raise ValueError(f"block_m must be a power of two >= max(16, gqa ratio {group}), got {c.block_m}")
    if not (_is_power_of_two(c.tile_n) and c.tile_n >= 16):
        raise ValueError(f"tile_n must be a power of two >= 16, got {c.tile_n}")
    if not (_is_power_of_two(c.num_splits) and c.num_splits <= 64):
        raise ValueError(f"num_splits must be a power of two <= 64, got {c.num_splits}")
    if c.num_splits > 1 and partial_out is not None:
        shape = (query.shape[0], query.shape[1], c.num_splits)
        for name, t, want in (
            ("partial_out", partial_out, (*shape, query.shape[2])),
            ("partial_max", partial_max, shape),
            ("partial_sum", partial_sum, shape),
        ):
            if t is None or t.shape != want or t.dtype != torch.float32 or not t.is_contiguous() or t.device != query.device:
                raise ValueError(f"{name} must be a contiguous float32 tensor of shape {want} on {query.device}")
    return _launch(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out, config,
        partial_out, partial_max, partial_sum, sliding_window,
    )


def _launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    config: AttentionConfig,
    partial_out: torch.Tensor | None = None,
    partial_max: torch.Tensor | None = None,
    partial_sum: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Grid and launch of already-checked arguments."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    c = config
    if num_tokens == 0 or num_seqs == 0:
        return out
    use_split_k = c.num_splits > 1
    if use_split_k and partial_out is None:
        shape = (num_tokens, num_heads, c.num_splits)
        partial_out = torch.empty(*shape, head_dim, dtype=torch.float32, device=query.device)
        partial_max = torch.empty(shape, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty(shape, dtype=torch.float32, device=query.device)
    elif not use_split_k:
        # Never dereferenced (USE_SPLIT_K is False); any tensor of the device stands in.
        partial_out = partial_max = partial_sum = out

    block_q = c.block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, c.num_splits)
    _paged_attention_kernel[grid](
        out_ptr=out,
        partial_out_ptr=partial_out,
        partial_max_ptr=partial_max,
        partial_sum_ptr=partial_sum,
        query_ptr=query,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        qk_scale=scale * _LOG2E,
        num_seqs=num_seqs,
        num_heads=num_heads,
        sliding_window=_NO_WINDOW if sliding_window is None else sliding_window,
        stride_q_token=query.stride(0),
        stride_q_head=query.stride(1),
        stride_o_token=out.stride(0),
        stride_o_head=out.stride(1),
        stride_cache_block=key_cache.stride(0),
        stride_cache_token=key_cache.stride(1),
        stride_cache_head=key_cache.stride(2),
        stride_table_seq=block_tables.stride(0),
        NUM_QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=c.block_m,
        BLOCK_Q=block_q,
        TILE_N=c.tile_n,
        NUM_SPLITS=c.num_splits,
        USE_SPLIT_K=use_split_k,
        # fp32 inputs: exact fp32 products (tl.dot would default to tf32 on the GPU).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_QUANT=kv_quant_mode(key_cache),
        num_warps=c.num_warps,
    )
    if use_split_k:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out_ptr=out,
            partial_out_ptr=partial_out,
            partial_max_ptr=partial_max,
            partial_sum_ptr=partial_sum,
            num_heads=num_heads,
            stride_o_token=out.stride(0),
            stride_o_head=out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=c.num_splits,
            num_warps=4,
        )
    return out


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or head_dim + 2 int8/uint8
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or head_dim + 2 int8/uint8
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    sliding_window: int | None = None,  # a query at p sees keys p - sliding_window < k <= p
    invariant: bool = False,  # one config whatever the batch (`choose_config`): --batch-invariant
) -> torch.Tensor:
    """`kernels.reference.paged_attention` in Triton, config from `choose_config`.

    Quantized caches (`kernels.kv_quant`: int8 / uint8 rows of codes + bf16 scale) are
    dequantized as the kernel loads them; the output is in the query's dtype.
    """
    if out is None:
        out = torch.empty_like(query)
    check_paged_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, sliding_window
    )
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    config = choose_config(
        num_tokens=query.shape[0],
        num_seqs=seq_lens.shape[0],
        num_kv_heads=num_kv_heads,
        gqa_ratio=num_heads // num_kv_heads,
        head_dim=head_dim,
        max_context=min(block_tables.shape[1] * block_size, sliding_window or _NO_WINDOW),
        invariant=invariant,
    )
    return _launch(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out, config,
        sliding_window=sliding_window,
    )
