"""Torch reference ops: the semantics every Triton kernel is tested against, and the CPU path.

Shapes (per layer):
  key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], or a quantized
                          cache's [..., head_dim + 2] int8/uint8 rows (kernels/kv_quant.py)
  block_tables:           [num_seqs, max_blocks_per_seq] int32, padded with 0
  seq_lens:               [num_seqs] int32, tokens in the cache after this step's writes
  query_start_loc:        [num_seqs + 1] int32, prefix sums of the query lengths
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

from kernels import kv_quant


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    """Scatter this step's K/V into their cache slots (quantized first where the cache is)."""
    if kv_quant.is_quantized(key_cache):
        kind = kv_quant.kind_of(key_cache)
        key, value = kv_quant.quantize(key, kind), kv_quant.quantize(value, kind)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = key
    value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot_mapping] = value


def copy_blocks(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[torch.Tensor],  # per layer, same shape
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src, dst) block ids
) -> None:
    """Copy whole KV blocks in every layer (copy-on-write of shared blocks)."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for key_cache, value_cache in zip(key_caches, value_caches):
        key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
        value_cache.index_copy_(0, dst, value_cache.index_select(0, src))


class _AttentionPlan:
    """What a step's metadata says about gathering K/V for one sliding window (None: full
    causal), built once and reused by every layer with that window.

    A decode at position p reads only the keys its window sees, p - window < k <= p: the
    gather starts at `seq_len - window` and is at most `window` long."""

    __slots__ = ("starts", "lens", "q_lens", "decode_b", "decode_all", "decode_token_idx",
                 "decode_slots", "decode_max_len", "decode_mask", "decode_first_slot")

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 block_size: int, window: int | None = None):
        self.starts = starts = query_start_loc.tolist()
        self.lens = lens = seq_lens.tolist()
        self.q_lens = q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        decode_seqs = [i for i, n in enumerate(q_lens) if n == 1]
        self.decode_b = b = len(decode_seqs)
        self.decode_all = b == len(q_lens)
        if not decode_seqs:
            return
        dev = block_tables.device  # the index tensors live beside the cache (CPU or CUDA)
        if self.decode_all:
            rows = torch.arange(b, device=dev)
            self.decode_token_idx = query_start_loc[:-1].long()
        else:
            rows = torch.tensor(decode_seqs, device=dev)
            self.decode_token_idx = torch.tensor([starts[i] for i in decode_seqs], device=dev)
        # Per decode: the first key its window sees and how many keys it reads from there.
        first = [0 if window is None else max(0, lens[i] - window) for i in decode_seqs]
        read = [lens[i] - f for i, f in zip(decode_seqs, first)]
        self.decode_max_len = max_len = max(read)
        # One sequence whose blocks happen to be consecutive in the cache (common: the free
        # list hands out blocks in order) is read in place, without a gather or a mask.
        self.decode_first_slot = None
        if b == 1:
            blocks = block_tables[decode_seqs[0], : (lens[decode_seqs[0]] + block_size - 1) // block_size].tolist()
            if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
                self.decode_first_slot = blocks[0] * block_size + first[0]
                self.decode_mask = None
                return
        read_lens = torch.tensor(read, device=dev)
        # One flat slot per key read. Positions past a sequence's end read its last real
        # slot instead (masked below): slots there may hold stale data, even inf/nan, and
        # 0 * inf would poison the output.
        offsets = torch.minimum(torch.arange(max_len, device=dev)[None, :], read_lens[:, None] - 1)  # [b, ctx]
        positions = torch.tensor(first, device=dev)[:, None] + offsets
        tables = block_tables[rows].long()
        self.decode_slots = (tables.gather(1, positions // block_size) * block_size + positions % block_size).flatten()
        if min(read) == max_len:
            self.decode_mask = None  # every decode reads max_len keys: nothing to mask
        else:
            valid = torch.arange(max_len, device=dev)[None, :] < read_lens[:, None]  # [b, ctx]
            self.decode_mask = valid[:, None, None, :]


# Inside `reuse_attention_plans` (one forward pass), the plans of the metadata tensors last
# seen are kept, one per sliding window: every layer passes the same tensors, so the index
# arithmetic runs once per step and window instead of once per layer. Outside it nothing
# is kept. Per thread.
_plans = threading.local()


@contextlib.contextmanager
def reuse_attention_plans() -> Iterator[None]:
    outer = (getattr(_plans, "active", False), getattr(_plans, "entry", None))
    _plans.active, _plans.entry = True, None
    try:
        yield
    finally:
        _plans.active, _plans.entry = outer


def _plan_for(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
              window: int | None) -> _AttentionPlan:
    if not getattr(_plans, "active", False):
        return _AttentionPlan(block_tables, seq_lens, query_start_loc, block_size, window)
    entry = _plans.entry
    if not (entry is not None and entry[0] is block_tables and entry[1] is seq_lens and entry[2] is query_start_loc
            and entry[3] == block_size):
        entry = _plans.entry = (block_tables, seq_lens, query_start_loc, block_size, {})
    by_window = entry[4]
    plan = by_window.get(window)
    if plan is None:
        plan = by_window[window] = _AttentionPlan(block_tables, seq_lens, query_start_loc, block_size, window)
    return plan


def _values(rows: torch.Tensor) -> torch.Tensor:
    """Gathered cache rows as float32 values: widened, or a quantized cache's dequantized."""
    return kv_quant.dequantize(rows) if kv_quant.is_quantized(rows) else rows.float()


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Varlen causal attention of each sequence's new query tokens over its paged context.

    Query token i of a sequence with q_len new tokens and seq_len cached tokens sits at
    position p = seq_len - q_len + i and attends to positions 0..p, or with a
    `sliding_window` W to p - W < k <= p only (as Hugging Face's sliding window). Decodes
    (q_len == 1) and prefill chunks (q_len > 1, possibly after cached tokens) are the
    same formula; the reference batches the decodes and loops over the rest. Scores and
    softmax run in float32 whatever the input dtype; a quantized cache's gathered rows are
    dequantized to float32 (kernels/kv_quant.py).

    The math is torch's `scaled_dot_product_attention` (its fused CPU kernel reads the
    gathered K/V through strides: 4-7x faster than explicit matmul + softmax at decode
    batch 8-32, measured on SmolLM2's 3 KV heads x 64), fed from a gather of the paged
    cache: the paging changes where K/V live, never the attention math.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    plan = _plan_for(block_tables, seq_lens, query_start_loc, block_size, sliding_window)
    starts, lens = plan.starts, plan.lens
    width = key_cache.shape[3]  # head_dim, or a quantized row's codes and scale
    kv_row = num_kv_heads * width

    if plan.decode_b:
        b, max_len = plan.decode_b, plan.decode_max_len
        # index_select copies whole rows (4x faster than advanced indexing on CPU).
        if plan.decode_first_slot is not None:
            k = key_cache.view(-1, kv_row).narrow(0, plan.decode_first_slot, max_len)
            v = value_cache.view(-1, kv_row).narrow(0, plan.decode_first_slot, max_len)
        else:
            k = key_cache.view(-1, kv_row).index_select(0, plan.decode_slots)
            v = value_cache.view(-1, kv_row).index_select(0, plan.decode_slots)
        k = _values(k.view(b, max_len, num_kv_heads, width)).transpose(1, 2)
        v = _values(v.view(b, max_len, num_kv_heads, width)).transpose(1, 2)
        # The `group` query heads sharing a KV head are that head's query rows: [b, kv, g, d].
        in_order = plan.decode_all and num_tokens == b  # decode row i is query token i
        if in_order:
            q = query.reshape(b, num_kv_heads, group, head_dim).float()
        else:
            q = query[plan.decode_token_idx].view(b, num_kv_heads, group, head_dim).float()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=scale)
        if in_order:
            out.copy_(o.reshape(b, num_heads, head_dim))
        else:
            out[plan.decode_token_idx] = o.reshape(b, num_heads, head_dim).to(out.dtype)
        if plan.decode_all:
            return out

    for i, q_len in enumerate(plan.q_lens):
        if q_len == 1 or q_len == 0:
            continue
        ctx = lens[i]
        # Keys from the first one the chunk's first query sees: 0, or inside its window.
        first = 0 if sliding_window is None else max(0, ctx - q_len - sliding_window + 1)
        num_blocks = (ctx + block_size - 1) // block_size
        first_block = first // block_size
        table = block_tables[i, first_block:num_blocks].long()
        skip = first - first_block * block_size  # keys of the first block before `first`
        end = ctx - first_block * block_size
        k = _values(key_cache[table].view(-1, num_kv_heads, width)[skip:end]).transpose(0, 1)  # [kv, keys, d]
        v = _values(value_cache[table].view(-1, num_kv_heads, width)[skip:end]).transpose(0, 1)
        q = query[starts[i] : starts[i + 1]].transpose(0, 1).float()  # [heads, q_len, d]
        if q_len == ctx and sliding_window is None:
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
        else:
            # After cached tokens (or under a window): query j sits at position ctx - q_len + j.
            key_pos = torch.arange(first, ctx, device=query.device)[None, :]
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
            allowed = key_pos <= q_pos  # [q_len, ctx - first]
            if sliding_window is not None:
                allowed &= key_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed, scale=scale, enable_gqa=True)
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1).to(out.dtype)
    return out
