"""Paged KV-cache bookkeeping: free list, reference counts, block tables, prefix cache.

The scheduler speaks to it in token counts; it answers in block ids. Block tables are
append-only while a request runs (copy-on-write may swap one entry for its private
copy), so the model runner can rebuild its tables from scratch every step.

Prefix cache: every full block is keyed by a chained sha256 hash of (parent hash, the
block's token ids, extra keys). Blocks are registered when they are scheduled: within a
forward pass each layer writes all K/V before any attention reads it, so a request that
hits a block being filled in the same step still reads the right values. Freed blocks
keep their hash and stay reusable until the allocator needs them, least recently freed
first; reusing a block drops its old hash so a stale entry can never match.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request

_ROOT_HASH = b"pagoda-prefix-cache-v1"


def hash_block(parent: bytes, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    """Chained block hash; sha256, never Python's hash() (collisions would leak caches)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + repr(key).encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Insertion order is the eviction order: allocate from the front, free to the back.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # leading blocks of each table already offered to the cache
        # (src, dst) block copies the next forward pass must do first (copy-on-write).
        self.pending_copies: list[tuple[int, int]] = []
        # Counters in tokens, as vLLM reports them.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # KV-cache events (engine/kv_events.py): None when off; else the events since the
        # engine last took them, already in wire form. `events_medium` names this cache's tier.
        self.events: list | None = None
        self.events_medium = "GPU"

    # ---- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (the kv_cache_usage_perc gauge)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def tail_waste(self, request_id: str, num_tokens: int) -> int:
        """Unused slots in the request's allocated blocks beyond its `num_tokens` tokens."""
        return len(self.get_block_table(request_id)) * self.block_size - num_tokens

    # ---- prefix cache ------------------------------------------------------------------
    def block_hashes(self, request: "Request", num_full_blocks: int) -> list[bytes]:
        """The request's chain hashes for its first `num_full_blocks` blocks (memoised on it)."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            tokens = [request.token_id_at(j) for j in range(i * bs, (i + 1) * bs)]
            hashes.append(hash_block(parent, tokens, request.cache_extra_keys))
        return hashes

    def find_cached_prefix(self, request: "Request") -> list[int]:
        """Blocks holding the longest cached run of the request's full blocks.

        At most `num_tokens - 1` tokens: the last token is always computed, since its
        logits are what the request samples from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self.block_hashes(request, max_blocks):
            block_id = self.cached_blocks.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits

    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        """Register the request's blocks that `num_tokens` tokens fill completely."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[request.request_id]
        num_full = min(num_tokens // self.block_size, len(table))
        done = self.num_registered.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self.block_hashes(request, num_full)
        self.num_registered[request.request_id] = num_full
        stored: list[int] = []  # indices of the blocks that entered the cache now
        for i in range(done, num_full):
            block_id, h = table[i], hashes[i]
            if self.block_hash[block_id] is not None:
                continue
            # Another block already holds these tokens (computed concurrently): keep that
            # entry; this block stays private and is simply freed later.
            if h not in self.cached_blocks:
                self.cached_blocks[h] = block_id
                self.block_hash[block_id] = h
                stored.append(i)
        if self.events is not None and stored:
            self._emit_stored(request, hashes, stored)

    def _emit_stored(self, request: "Request", hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored per contiguous run of newly cached blocks (a run's blocks chain)."""
        from engine.kv_events import block_stored

        lora = request.sampling_params.lora_request
        lora_id = None if lora is None else lora.lora_id
        bs = self.block_size
        start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[start], stored[k - 1]
            tokens = [request.token_id_at(j) for j in range(first * bs, (last + 1) * bs)]
            self.events.append(block_stored(
                hashes[first:last + 1], hashes[first - 1] if first else None, tokens, bs, lora_id,
                self.events_medium,
            ))
            start = k

    def take_events(self) -> list:
        """The events since the last call (empty when events are off)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    # ---- changes -----------------------------------------------------------------------
    def allocate_slots(
        self,
        request_id: str,
        num_tokens: int,
        cached_prefix: list[int] = (),
        write_from: int | None = None,
    ) -> bool:
        """Grow the request's table so it holds `num_tokens` tokens in all.

        `cached_prefix` (from find_cached_prefix, only for a request holding no blocks yet)
        is shared by reference count. `write_from` is the first position this step writes:
        if its block is shared (a fork), it is copied first (copy-on-write; the pair lands
        in `pending_copies`). All or nothing: returns False and changes nothing when free
        blocks are short, so the caller can preempt and retry.
        """
        table = self.block_tables.get(request_id, [])
        extra = max(self.blocks_needed(num_tokens) - len(table) - len(cached_prefix), 0)
        cow_index = None
        if write_from is not None and write_from // self.block_size < len(table):
            if self.ref_counts[table[write_from // self.block_size]] > 1:
                cow_index = write_from // self.block_size
        # Cached blocks nobody holds sit on the free list: taking them uses it up too.
        idle_hits = sum(1 for b in cached_prefix if self.ref_counts[b] == 0)
        if extra + idle_hits + (cow_index is not None) > len(self.free_blocks):
            return False
        if request_id not in self.block_tables:
            self.block_tables[request_id] = table
        for block_id in cached_prefix:
            if self.ref_counts[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_counts[block_id] += 1
            table.append(block_id)
        if cow_index is not None:
            shared = table[cow_index]
            private = self._pop_free()
            self.ref_counts[private] = 1
            self.ref_counts[shared] -= 1
            table[cow_index] = private
            self.pending_copies.append((shared, private))
        for _ in range(extra):
            block_id = self._pop_free()
            self.ref_counts[block_id] = 1
            table.append(block_id)
        return True

    def _pop_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        h = self.block_hash[block_id]
        if h is not None:
            # Evicted: its old contents are about to be overwritten.
            if self.cached_blocks.get(h) == block_id:
                del self.cached_blocks[h]
                if self.events is not None:
                    from engine.kv_events import block_removed

                    self.events.append(block_removed([h], self.events_medium))
            self.block_hash[block_id] = None
        return block_id

    def free(self, request_id: str) -> None:
        """Release the request's blocks (a no-op for a request that holds none)."""
        table = self.block_tables.pop(request_id, None)
        self.num_registered.pop(request_id, None)
        if not table:
            return
        # Freed tail first, so a prefix's tail is evicted before its head.
        for block_id in reversed(table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None
            elif self.ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks beyond what `num_tokens` tokens need: the tail that
        held only rejected draft tokens (speculative decoding). Such blocks were never full
        of verified tokens, so the prefix cache never registered them."""
        table = self.block_tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        while table is not None and len(table) > keep:
            block_id = table.pop()
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None

    def fork(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """Give `child_id` the parent's first `num_blocks` blocks by reference."""
        if child_id in self.block_tables:
            raise ValueError(f"{child_id!r} already holds blocks")
        table = self.block_tables[parent_id][:num_blocks]
        for block_id in table:
            self.ref_counts[block_id] += 1
        self.block_tables[child_id] = table

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (blocks and their owners are untouched)."""
        self.cached_blocks.clear()
        self.block_hash = [None] * self.num_blocks
        self.num_registered.clear()
        if self.events is not None:
            from engine.kv_events import ALL_BLOCKS_CLEARED

            self.events.append(list(ALL_BLOCKS_CLEARED))

    def check_invariants(self) -> None:
        """Every block is either free (ref 0) or referenced exactly by its table entries."""
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                counts[block_id] += 1
        for block_id in range(self.num_blocks):
            if counts[block_id] != self.ref_counts[block_id]:
                raise AssertionError(f"block {block_id}: ref count {self.ref_counts[block_id]} != {counts[block_id]}")
            if (counts[block_id] == 0) != (block_id in self.free_blocks):
                raise AssertionError(f"block {block_id}: free-list membership disagrees with its ref count")
        for h, block_id in self.cached_blocks.items():
            if self.block_hash[block_id] != h:
                raise AssertionError(f"stale prefix-cache entry for block {block_id}")
