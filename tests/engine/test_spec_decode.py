"""Prompt-lookup speculative decoding (engine/spec_decode.py): the proposals, the exactness
of greedy outputs against transformers with preemption, chunked prefill and prefix caching
forced, the sampled distribution (chi-square), the scheduler's limits and the KV it frees."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.spec_decode import DraftRow, num_accepted, propose_ngram
from tiny_models import hf_greedy, make_model_folder

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "disable_by_batch_size": None}


# ---- proposals and acceptance -----------------------------------------------------------------
def test_the_longest_suffix_match_proposes_what_followed_its_latest_occurrence():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # Suffix [6, 7]: occurrences at 1 and 6; the latest (6) was followed by 3, 4, 6.
    assert propose_ngram(tokens, 3, 2, 4) == [3, 4, 6]
    # A longer suffix wins over a later shorter one: [9, 1, 6, 7] occurs once, followed by 3.
    tokens2 = [9, 1, 6, 7, 3, 2, 6, 7, 8, 9, 1, 6, 7]
    assert propose_ngram(tokens2, 2, 2, 4) == [3, 2]
    assert propose_ngram(tokens2, 2, 2, 2) == [8, 9]  # only 2-grams: the latest [6, 7] at 6


def test_no_proposal_without_a_match_of_the_minimum_length():
    assert propose_ngram([1, 2, 3, 4, 5], 3, 2, 4) == []
    assert propose_ngram([1, 2, 3, 9, 3], 3, 2, 4) == []  # [9, 3] never occurs earlier
    assert propose_ngram([1, 2, 3, 9, 3], 3, 1, 4) == [9, 3]  # a 1-gram [3] does, at 2
    assert propose_ngram([7], 3, 1, 4) == []


def test_proposals_stop_at_k_and_at_the_end_of_the_tokens():
    tokens = [1, 2, 3, 4, 1, 2]
    assert propose_ngram(tokens, 1, 2, 4) == [3]
    assert propose_ngram(tokens, 10, 2, 4) == [3, 4, 1, 2]


def test_acceptance_keeps_the_agreeing_prefix():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4, 5, 6], [1, 5, 6, 7]) == 0


@pytest.mark.parametrize("raw, message", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min (5) > prompt_lookup_max (3)"),
    ('{"num_speculative_tokens": 2, "draft_model": "x"}', "unsupported key(s) ['draft_model']"),
    ("{not json", "not valid JSON"),
])
def test_a_bad_speculative_config_is_refused_naming_the_problem(raw, message):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_engine_args(speculative_config=raw)
    assert message in str(e.value)


def test_the_config_takes_vllms_json_and_a_dict():
    spec = SpeculativeConfig('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}').ngram
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (5, 3, 2)
    assert SpeculativeConfig(SPEC).ngram.disable_by_batch_size is None
    assert SpeculativeConfig().ngram is None


# ---- the sampled distribution -----------------------------------------------------------------
def test_sampled_speculation_emits_the_target_distribution_at_every_position():
    """Position j's logits are fixed (as if from a model); drafts [a, b]. The first emitted
    token must follow p0; given it equals a, the second must follow p1 (a presence penalty
    on a included: row 1 sees draft a as output); given a, b, the bonus follows p2. Pearson
    chi-square against the exact target at each position, over 12000 verifications."""
    from engine.request import Request
    from engine.sampler import Sampler
    from engine.sampling_params import SamplingParams

    vocab, trials, drafts = 6, 12000, [1, 3]
    base = torch.tensor([[1.0, 1.5, 0.2, 0.8, -0.5, 0.3], [0.4, 0.1, 0.9, 1.6, 0.0, -1.0], [0.5, 0.5, 0.5, 1.0, 0.0, 0.2]])
    penalty = 0.7
    params = SamplingParams(temperature=1.0, max_tokens=8, presence_penalty=penalty)
    requests = [Request(str(i), [0, 4], params, eos_token_id=None, max_tokens=8) for i in range(trials)]
    rows, logits = [], []
    for r in requests:
        rows += [r, DraftRow(r, drafts[:1]), DraftRow(r, drafts[:2])]
        logits.append(base)
    sampled = Sampler(seed=123)(torch.cat(logits), rows).token_ids

    # The target at position j: the presence penalty counts the output so far (drafts before j).
    targets = []
    for j in range(3):
        row = base[j].clone()
        for t in set(drafts[:j]):
            row[t] -= penalty
        targets.append(torch.softmax(row, dim=-1))
    emitted = [[], [], []]  # the token emitted at position j, for verifications that reached j
    for i in range(trials):
        tokens = sampled[3 * i: 3 * i + 3]
        accepted = num_accepted(drafts, tokens)
        for j in range(accepted + 1):
            emitted[j].append(tokens[j])
    assert len(emitted[2]) > 1000  # enough verifications accept both drafts to test the bonus
    for j in range(3):
        counts = torch.bincount(torch.tensor(emitted[j]), minlength=vocab).double()
        expected = targets[j].double() * len(emitted[j])
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        # 5 degrees of freedom: P(chi2 > 20.5) = 0.001.
        assert chi2 < 20.5, f"position {j}: chi-square {chi2:.1f}, counts {counts.tolist()}, expected {expected.tolist()}"


# ---- exact greedy output on a real forward pass ------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("spec-llama"), "llama")


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that quote themselves, so proposals exist and some are accepted; two share a
    prefix (a prefix-cache hit for whichever is admitted later)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 512, (10,), generator=g).tolist()
    return [base * 3, base * 2 + base[:5], [7] + base * 2]


def _spec_counts(core) -> dict[str, int]:
    counts = {"drafts": 0, "accepted": 0}

    def on_step(stats):
        counts["drafts"] += stats.spec_num_draft_tokens
        counts["accepted"] += stats.spec_num_accepted_tokens

    core.on_step = on_step
    return counts


def test_greedy_with_speculation_equals_transformers_with_preemption_chunking_and_prefix_caching(
    tiny_llama, record_schedules
):
    from engine import LLM, SamplingParams

    prompts = _repetitive_prompts()
    expected = hf_greedy(tiny_llama, prompts, 24)
    # 20 blocks of 4 tokens cannot hold all three (preemption, then recomputation from the
    # prefix cache); a 16-token budget chunks the prompts beside verifications.
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=20, kernel_backend="torch", speculative_config=SPEC)
    core = llm.engine_core
    counts = _spec_counts(core)
    steps = record_schedules(core)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert core.scheduler.num_preemptions > 0
    assert any(partial for _, partial in steps), "no prefill was split into chunks"
    assert counts["accepted"] > 0 and counts["drafts"] > counts["accepted"], counts  # accepted and rejected drafts
    assert core.block_manager.prefix_cache_hits > 0
    assert core.block_manager.num_free_blocks == core.num_blocks

    # n > 1 greedy samples and a second round served from the prefix cache: the same tokens.
    outs = llm.generate(prompts[:1], SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True))
    assert [c.token_ids for c in outs[0].outputs] == [expected[0], expected[0]]
    assert core.block_manager.num_free_blocks == core.num_blocks


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_llama):
    """A seeded row's noise depends on (seed, output position, token) only, and a draft row
    samples its position with the same context as a decode would: so even sampled output is
    the same token for token (and drafts are accepted and rejected along the way)."""
    from engine import LLM, SamplingParams

    prompts = _repetitive_prompts()
    llm = LLM(model=str(tiny_llama), dtype="float32", kernel_backend="torch", speculative_config=SPEC)
    core = llm.engine_core
    counts = _spec_counts(core)
    params = [SamplingParams(temperature=t, top_p=0.9, max_tokens=24, ignore_eos=True, seed=11 + i)
              for i, t in enumerate((0.5, 0.8, 1.0))]
    with_spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert counts["accepted"] > 0 and counts["drafts"] > counts["accepted"], counts
    core.scheduler.speculation = None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == with_spec


def test_stops_and_max_tokens_see_exactly_the_accepted_tokens(tiny_llama):
    """A stop token or max_tokens reached inside an accepted run ends the output there, as
    without speculation; logprobs come one per emitted token."""
    from engine import LLM, SamplingParams

    prompts = _repetitive_prompts()
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=4, kernel_backend="torch", speculative_config=SPEC)
    counts = _spec_counts(llm.engine_core)
    reference = hf_greedy(tiny_llama, prompts, 24)
    for max_tokens in (1, 2, 5, 11):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1))
        for out, ref in zip(outs, reference):
            assert out.outputs[0].token_ids == ref[:max_tokens]
            assert len(out.outputs[0].logprobs) == max_tokens
            assert all(out.outputs[0].token_ids[i] in lp for i, lp in enumerate(out.outputs[0].logprobs))
    # Each distinct token of a reference as the stop token: the output ends at its first
    # occurrence, wherever that falls in a run of accepted drafts.
    for prompt, ref in zip(prompts, reference):
        for stop in dict.fromkeys(ref):
            out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop]))
            assert out[0].outputs[0].token_ids == ref[: ref.index(stop) + 1]
            assert out[0].outputs[0].finish_reason == "stop"
    assert counts["accepted"] > 0
    assert llm.engine_core.block_manager.num_free_blocks == llm.engine_core.num_blocks


def test_streamed_deltas_concatenate_to_the_final_text_and_aborts_free_the_kv(tiny_llama):
    from engine.async_engine import AsyncEngine
    from engine.sampling_params import SamplingParams

    prompt = _repetitive_prompts()[0]
    config = EngineConfig.from_engine_args(model=str(tiny_llama), dtype="float32", kernel_backend="torch",
                                           speculative_config=SPEC)

    async def run():
        engine = AsyncEngine(config)
        engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            deltas, final = [], None
            async for out in engine.generate("a", prompt, params):
                # Outputs of several steps can arrive merged: one completion per step.
                deltas.extend(c.delta_text for c in out.outputs)
                final = out.outputs[-1]
            agen = engine.generate("b", prompt, params)
            await agen.__anext__()
            await agen.aclose()  # the client went away mid-stream: aborted
            for _ in range(100):
                if engine.core.block_manager.num_free_blocks == engine.core.num_blocks:
                    break
                await asyncio.sleep(0.02)
            return deltas, final, engine.core.block_manager.num_free_blocks, engine.core.num_blocks
        finally:
            engine.shutdown()

    deltas, final, free, total = asyncio.run(run())
    assert len(deltas) < 24  # tokens arrived several per step
    assert "".join(deltas) == final.text and final.token_ids == hf_greedy(tiny_llama, [prompt], 24)[0]
    assert free == total


# ---- the scheduler ---------------------------------------------------------------------------
def _scheduler(k=3, disable=None, budget=64, num_blocks=64):
    from engine.block_manager import BlockManager
    from engine.config import SchedulerConfig
    from engine.scheduler import Scheduler

    spec = SpeculativeConfig({"num_speculative_tokens": k, "disable_by_batch_size": disable}).ngram
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), BlockManager(num_blocks, 4), speculation=spec)


def _decoding(request_id: str, tokens: list[int], max_tokens: int = 50):
    from engine.request import Request
    from engine.sampling_params import SamplingParams

    r = Request(request_id, tokens[:-1], SamplingParams(max_tokens=max_tokens), eos_token_id=None, max_tokens=max_tokens)
    r.output_token_ids.append(tokens[-1])
    return r


def _run_prefill(scheduler, *requests):
    """Admit `requests` and compute all but their last token (the newest output token)."""
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [r.num_tokens for r in requests] and not out.spec_tokens
    for request in requests:
        request.num_computed_tokens = request.num_tokens - 1


def test_the_scheduler_schedules_one_plus_k_with_their_slots_within_the_limits():
    s = _scheduler(k=3)
    r = _decoding("a", [1, 2, 3, 4, 1, 2])
    _run_prefill(s, r)
    out = s.schedule()
    assert out.spec_tokens == {"a": [3, 4, 1]} and out.num_scheduled_tokens == [4]
    assert len(s.block_manager.get_block_table("a")) == s.block_manager.blocks_needed(r.num_tokens + 3)
    # One token left before max_tokens: no draft (the emitted token is the last).
    s2 = _scheduler(k=3)
    r2 = _decoding("b", [1, 2, 3, 4, 1, 2], max_tokens=2)  # one output token of 2
    _run_prefill(s2, r2)
    assert not s2.schedule().spec_tokens
    # Two left: one draft + the token it yields.
    s3 = _scheduler(k=3)
    r3 = _decoding("c", [1, 2, 3, 4, 1, 2], max_tokens=3)
    _run_prefill(s3, r3)
    assert s3.schedule().spec_tokens == {"c": [3]}


def test_speculation_is_off_at_the_batch_size_cutoff_and_trimmed_by_a_grammar():
    s = _scheduler(k=2, disable=2)
    a, b = _decoding("a", [1, 2, 3, 1, 2]), _decoding("b", [4, 5, 6, 4, 5])
    _run_prefill(s, a, b)
    assert len(s.running) == 2 and not s.schedule().spec_tokens

    s = _scheduler(k=2)
    g = _decoding("g", [1, 2, 3, 1, 2])
    allowed = []
    # A grammar that allows one more token of whatever it is asked about.
    matcher = SimpleNamespace(num_allowed_prefix=lambda tokens: allowed.append(list(tokens)) or 1)
    g.grammar = SimpleNamespace(is_ready=True, matcher=matcher)
    _run_prefill(s, g)
    assert s.schedule().spec_tokens == {"g": [3]} and allowed == [[3, 1]]


def test_drafts_give_way_before_anyone_is_preempted():
    # 3 blocks of 4: the request's 8 tokens fill two, its drafts would need a fourth (the
    # other request holds the third); the drafts are dropped instead of preempting anyone.
    s = _scheduler(k=3, num_blocks=3)
    a = _decoding("a", [1, 2, 3, 4, 1, 2, 3, 4])
    other = _decoding("o", [5, 6, 7])
    _run_prefill(s, a, other)
    out = s.schedule()
    assert not out.spec_tokens and not out.preempted and out.num_scheduled_tokens == [1, 1]


def test_metrics_count_drafts_and_acceptance_per_position():
    from engine.stats import StepStats
    from server.metrics import Metrics

    metrics = Metrics("m")
    stats = StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.0, kv_cache_tail_waste_tokens=0,
                      num_scheduled_tokens=4, spec_num_drafts=2, spec_num_draft_tokens=6, spec_num_accepted_tokens=3,
                      spec_accepted_per_position=[0, 1, 0])
    metrics.on_step(stats)
    text = metrics.render()[0].decode()
    assert 'pagoda:spec_decode_num_draft_tokens_total{model_name="m"} 6.0' in text
    assert 'pagoda:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0' in text
    assert 'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0' in text


# ---- under a grammar ----------------------------------------------------------------------------
def test_grammar_requests_speculate_within_the_grammar_and_keep_their_output(tiny_model_path):
    """Drafts are trimmed to what the grammar allows and each draft position samples under
    its own matcher copy: greedy output equals the output without speculation, sampled
    output still matches the grammar, and the request's matcher ends where the text does."""
    import re

    from engine import LLM, SamplingParams
    from engine.structured_output import StructuredOutputSpec

    pattern = r"((foo|bar|baz) ){16}"
    spec = StructuredOutputSpec.regex(pattern)
    llm = LLM(model=str(tiny_model_path), max_model_len=256, num_gpu_blocks_override=64, speculative_config=SPEC)
    core = llm.engine_core
    counts = _spec_counts(core)
    prompts = ["foo bar baz foo bar baz foo", "bar bar foo"]
    greedy = SamplingParams(structured_output=spec, max_tokens=96, temperature=0)
    with_spec = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    assert counts["accepted"] > 0, counts
    speculation, core.scheduler.speculation = core.scheduler.speculation, None
    without = [o.outputs[0].text for o in llm.generate(prompts, greedy)]
    core.scheduler.speculation = speculation
    assert with_spec == without
    sampled = llm.generate(prompts, SamplingParams(structured_output=spec, max_tokens=96, temperature=1.0, seed=7, n=2))
    for text in with_spec + [c.text for o in sampled for c in o.outputs]:
        assert re.fullmatch(pattern, text), text
    assert core.block_manager.num_free_blocks == core.num_blocks and not core.requests


def test_tensor_parallel_ranks_run_the_verification_chunks(tiny_llama, monkeypatch):
    """Two ranks: rank 0 proposes and schedules, every rank runs the verification chunks;
    the tokens are transformers' greedy ones."""
    from engine import LLM, SamplingParams

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on two cores (the worker reads it)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    prompts = _repetitive_prompts()
    llm = LLM(model=str(tiny_llama), dtype="float32", kernel_backend="torch", tensor_parallel_size=2,
              speculative_config=SPEC)
    try:
        counts = _spec_counts(llm.engine_core)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(tiny_llama, prompts, 24)
    assert counts["accepted"] > 0, counts
