"""Prefix caching and copy-on-write: block-manager invariants, then the engine end to end."""

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager, hash_block
from engine.request import Request

BLOCK_SIZES = [1, 16, 32]


def _request(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), None, 4, cache_salt=salt)


def _admit(bm, request):
    """What the scheduler does for a new request: look up, allocate, register."""
    hits = bm.find_cached_prefix(request)
    request.num_computed_tokens = len(hits) * bm.block_size
    assert bm.allocate_slots(request.request_id, request.num_tokens, hits, write_from=request.num_computed_tokens)
    bm.cache_blocks(request, request.num_tokens)
    return hits


def test_hash_chain_depends_on_parent_tokens_and_salt():
    root = hash_block(b"", [1, 2, 3])
    assert hash_block(b"", [1, 2, 3]) == root
    assert hash_block(b"", [1, 2, 4]) != root
    assert hash_block(root, [1, 2, 3]) != root
    assert hash_block(b"", [1, 2, 3], ("salt",)) != root
    assert len(root) == 32  # sha256


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_shared_prefix_hits_and_ref_counts_return_to_zero(block_size):
    bm = BlockManager(num_blocks=512, block_size=block_size)
    prefix = list(range(100, 100 + 3 * block_size))
    a = _request("a", prefix + [1, 2])
    b = _request("b", prefix + [7, 8, 9])
    assert _admit(bm, a) == []
    hits = _admit(bm, b)
    assert hits == bm.get_block_table("a")[:3]
    assert all(bm.ref_counts[x] == 2 for x in hits)
    assert b.num_computed_tokens == 3 * block_size
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 512 and all(c == 0 for c in bm.ref_counts)
    bm.check_invariants()


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_full_prompt_hit_still_computes_the_last_token(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size)
    tokens = list(range(1, 2 * block_size + 1))  # exactly two full blocks
    _admit(bm, _request("a", tokens))
    bm.free("a")
    warm = _request("b", tokens)
    hits = _admit(bm, warm)
    assert len(hits) == (len(tokens) - 1) // block_size
    assert warm.num_computed_tokens < len(tokens)


def test_salt_isolates_caches():
    bm = BlockManager(num_blocks=64, block_size=4)
    tokens = list(range(1, 13))
    _admit(bm, _request("a", tokens, salt="alice"))
    assert _admit(bm, _request("b", tokens, salt="bob")) == []
    assert len(_admit(bm, _request("c", tokens, salt="alice"))) == 2


def test_lru_eviction_order_tail_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    first = _request("old", list(range(1, 13)))  # 3 full blocks
    _admit(bm, first)
    old_table = list(bm.get_block_table("old"))
    bm.free("old")
    second = _request("new", list(range(50, 62)))
    _admit(bm, second)
    bm.free("new")
    # Allocating two blocks evicts the least recently freed: "old"'s tail, then its middle.
    assert bm.allocate_slots("x", 8)
    assert bm.get_block_table("x") == [old_table[2], old_table[1]]
    probe = _request("probe", list(range(1, 13)) + [99])
    assert bm.find_cached_prefix(probe) == [old_table[0]]
    bm.check_invariants()


def test_stale_hash_after_reuse_never_matches():
    bm = BlockManager(num_blocks=3, block_size=4)
    _admit(bm, _request("a", list(range(1, 13))))
    bm.free("a")
    # Reuse every block for other tokens: the old hashes must be gone.
    _admit(bm, _request("b", list(range(200, 212))))
    probe = _request("probe", list(range(1, 13)) + [5])
    assert bm.find_cached_prefix(probe) == []
    bm.check_invariants()


def test_cache_hit_never_uses_more_than_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    _admit(bm, _request("a", list(range(1, 9))))  # 2 blocks, cached
    bm.free("a")
    assert bm.allocate_slots("hog", 8)  # takes the 2 never-used blocks
    big = _request("big", list(range(1, 9)) + list(range(30, 42)))  # hits 2, needs 3 more
    hits = bm.find_cached_prefix(big)
    assert len(hits) == 2
    assert not bm.allocate_slots("big", big.num_tokens, hits, write_from=8)
    assert bm.get_block_table("big") == [] and bm.num_free_blocks == 2
    bm.check_invariants()


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_fork_then_write_copies_the_shared_block(block_size):
    bm = BlockManager(num_blocks=64, block_size=block_size)
    assert bm.allocate_slots("parent", 2 * block_size + 1)
    bm.fork("parent", "child", 3)
    shared = bm.get_block_table("parent")
    assert bm.get_block_table("child") == shared and bm.ref_counts[shared[2]] == 2
    # The child rewrites position 2*block_size (block 2): it gets a private copy first.
    assert bm.allocate_slots("child", 2 * block_size + 1, write_from=2 * block_size)
    child = bm.get_block_table("child")
    assert child[:2] == shared[:2] and child[2] != shared[2]
    assert bm.pending_copies == [(shared[2], child[2])]
    assert bm.ref_counts[shared[2]] == 1
    bm.free("child")
    bm.free("parent")
    assert bm.num_free_blocks == 64
    bm.check_invariants()


# ---- end to end on the tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_model_path):
    # float32: the warm/cold logprob comparison below is to 1e-5 (bf16 would round the
    # attention output differently on the cached and the recomputed path).
    return LLM(model=str(tiny_model_path), dtype="float32", max_model_len=512, block_size=16, num_gpu_blocks_override=256)


SYSTEM = "You are a careful assistant. Answer briefly and precisely. " * 6


def test_warm_prompt_matches_cold_and_reports_cached_tokens(llm):
    prompt = SYSTEM + "What is the tallest mountain?"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0
    n = len(cold.prompt_token_ids)
    assert warm.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    for a, b in zip(warm.outputs[0].logprobs, cold.outputs[0].logprobs):
        assert {t: lp.logprob for t, lp in a.items()} == pytest.approx({t: lp.logprob for t, lp in b.items()}, abs=1e-5)
    other = llm.generate([SYSTEM + "Name a prime number."], params)[0]
    assert other.num_cached_tokens > 0  # the shared system prompt


def test_prefix_caching_off_caches_nothing(tiny_model_path):
    off = LLM(model=str(tiny_model_path), max_model_len=512, num_gpu_blocks_override=64, enable_prefix_caching=False)
    prompt = SYSTEM + "Hello"
    off.generate([prompt], SamplingParams(max_tokens=2))
    assert off.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens == 0
    assert off.engine_core.block_manager.cached_blocks == {}


def test_n_samples_equal_separate_seeded_requests_and_share_prompt_blocks(llm, tiny_model_path, record_schedules):
    prompt = llm.tokenizer.encode(SYSTEM + "Tell me a story.")
    assert len(prompt) % 16, "the prompt must end in a partial block to exercise copy-on-write"
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    together = llm.generate([prompt], params)[0].outputs
    separate = LLM(model=str(tiny_model_path), max_model_len=512, num_gpu_blocks_override=256, enable_prefix_caching=False)
    alone = [separate.generate([prompt], SamplingParams(temperature=1.0, seed=11 + j, max_tokens=10, ignore_eos=True))[0].outputs[0]
             for j in range(4)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in together}) > 1

    # Through the block manager: after the forks, the samples hold the same full prompt
    # blocks and private copies of the partial one.
    core = llm.engine_core
    core.block_manager.cached_blocks.clear()  # cold, so sharing comes from the fork alone
    for j in range(4):
        core.add_request(f"fork-{j}", prompt, SamplingParams(temperature=1.0, seed=5 + j, max_tokens=10, ignore_eos=True),
                         fork_of="fork-0" if j else None)
    steps = record_schedules(core)
    try:
        while any(core.requests[f"fork-{j}"].num_output_tokens < 2 for j in range(4)):
            core.step()
        tables = [core.block_manager.get_block_table(f"fork-{j}") for j in range(4)]
        full = len(prompt) // 16
        assert all(t[:full] == tables[0][:full] for t in tables)
        assert len({t[full] for t in tables}) == 4  # each sample's own partial block
        assert sum(len(out.blocks_to_copy) for out, _ in steps) >= 3  # the three forks copied the shared partial block
    finally:
        for j in range(4):
            core.abort_request(f"fork-{j}")
    assert core.block_manager.num_free_blocks == core.num_blocks


def test_prompt_logprobs_request_computes_its_whole_prompt(llm):
    prompt = SYSTEM + "Which river is the longest?"
    llm.generate([prompt], SamplingParams(max_tokens=1))  # warm the cache
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(entry is not None for entry in out.prompt_logprobs[1:])
