"""Paged KV-cache bookkeeping: a free list, reference counts and per-request block tables.

The scheduler speaks to it only in token counts; it answers in block ids. Block tables
are append-only while a request runs, so a block id never changes under a running request
(the model runner can rebuild its tables from scratch every step).
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}

    # ---- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

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

    # ---- changes -----------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table so it holds `num_tokens` tokens in all.

        All or nothing: returns False (and allocates nothing) when the free list is short,
        so the caller can preempt and retry without undoing half an allocation.
        """
        table = self.block_tables.setdefault(request_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra <= 0:
            return True
        if extra > len(self.free_block_ids):
            if not table:
                del self.block_tables[request_id]
            return False
        for _ in range(extra):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            table.append(block_id)
        return True

    def free(self, request_id: str) -> None:
        """Release the request's blocks (a no-op for a request that holds none)."""
        table = self.block_tables.pop(request_id, None)
        if not table:
            return
        # Freed in reverse so the tail (least likely shared later) is reused first.
        for block_id in reversed(table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
            elif self.ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")

    def check_invariants(self) -> None:
        """Every block is either free (ref 0) or referenced by exactly its table count."""
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                counts[block_id] += 1
        free = set(self.free_block_ids)
        if len(free) != len(self.free_block_ids):
            raise AssertionError("a block is on the free list twice")
        for block_id in range(self.num_blocks):
            if counts[block_id] != self.ref_counts[block_id]:
                raise AssertionError(f"block {block_id}: ref count {self.ref_counts[block_id]} != {counts[block_id]}")
            if (counts[block_id] == 0) != (block_id in free):
                raise AssertionError(f"block {block_id}: free-list membership disagrees with its ref count")
