"""Block manager invariants: all-or-nothing growth, ref counts, bounded tail waste."""

import pytest

from engine.block_manager import BlockManager

BLOCK_SIZES = [1, 16, 32]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_allocate_grows_table_to_hold_tokens(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size)
    for num_tokens in (1, block_size, block_size + 1, 3 * block_size - 1):
        assert bm.allocate_slots("a", num_tokens)
        assert len(bm.get_block_table("a")) == -(-num_tokens // block_size)
        assert 0 <= bm.tail_waste("a", num_tokens) <= block_size - 1
    bm.check_invariants()


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_table_is_append_only(block_size):
    bm = BlockManager(num_blocks=16, block_size=block_size)
    assert bm.allocate_slots("a", block_size + 1)
    before = list(bm.get_block_table("a"))
    assert bm.allocate_slots("a", 4 * block_size)
    assert bm.get_block_table("a")[: len(before)] == before


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_allocation_is_all_or_nothing(block_size):
    bm = BlockManager(num_blocks=4, block_size=block_size)
    assert bm.allocate_slots("a", 3 * block_size)
    assert not bm.allocate_slots("b", 2 * block_size)  # needs 2, only 1 free
    assert bm.num_free_blocks == 1
    assert bm.get_block_table("b") == []
    assert not bm.allocate_slots("a", 5 * block_size)
    assert len(bm.get_block_table("a")) == 3
    bm.check_invariants()


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_free_returns_every_block(block_size):
    bm = BlockManager(num_blocks=10, block_size=block_size)
    for i, n in enumerate((1, 2 * block_size, 3 * block_size + 1)):
        assert bm.allocate_slots(f"r{i}", n)
    assert bm.usage > 0
    for i in range(3):
        bm.free(f"r{i}")
    bm.free("r0")  # double free of a request is a no-op, never a negative ref count
    bm.free("never-allocated")
    assert bm.num_free_blocks == 10 and bm.usage == 0.0
    bm.check_invariants()


def test_blocks_are_reused_after_free():
    bm = BlockManager(num_blocks=2, block_size=16)
    assert bm.allocate_slots("a", 32)
    assert not bm.allocate_slots("b", 1)
    bm.free("a")
    assert bm.allocate_slots("b", 32)
    assert sorted(bm.get_block_table("b")) == [0, 1]


def test_invariant_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.allocate_slots("a", 20)
    bm.ref_counts[bm.get_block_table("a")[0]] = 2
    with pytest.raises(AssertionError):
        bm.check_invariants()


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_rejects_empty_cache(num_blocks):
    with pytest.raises(ValueError):
        BlockManager(num_blocks=num_blocks, block_size=16)
