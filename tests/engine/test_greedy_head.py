"""The greedy LM head in the engine (kernels/greedy_head.py, `AttentionMetadata.argmax_only`):
on the bundled SmolLM2-135M-Instruct in bf16, a step whose 1-4 rows are greedy with nothing
but their argmax read takes the head's argmax from its int8 copy, and a step with any row
that reads more (logprobs, a penalty, a seeded sample) computes the whole head. Either way a
user sees the same tokens and logprobs as with the route off (PAGODA_CPU_GREEDY_HEAD=0)."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels import cpu_kernels

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the C++ head needs AVX512-BF16"),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colours of the rainbow:",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MIXED = [
    GREEDY,
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True, logprobs=1),
]


def outputs(llm: LLM, prompts: list[str], params) -> list[tuple]:
    results = llm.generate(prompts, params)
    return [(tuple(r.outputs[0].token_ids), repr(r.outputs[0].logprobs)) for r in results]


@pytest.fixture(scope="module")
def engines(default_model_path):
    """(the route on, the route off): the same model and settings otherwise."""
    on = LLM(str(default_model_path), dtype="bfloat16", kv_cache_memory=0.05, max_model_len=512)
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGODA_CPU_GREEDY_HEAD", "0")
    try:
        off = LLM(str(default_model_path), dtype="bfloat16", kv_cache_memory=0.05, max_model_len=512)
    finally:
        mp.undo()
    return on, off


def test_the_start_up_facts_say_which_head_runs(engines):
    on, off = engines
    assert on.engine_core.facts()["lm_head"].startswith("bfloat16; greedy steps of 1-4 rows read an int8 copy")
    assert off.engine_core.facts()["lm_head"] == "bfloat16"
    # Both read the layers' bf16 linears from their 12-bit copies at 1-2 rows (the bundled
    # model's 210 linears, 3/4 of their 212 MB): the token comparisons here run through them.
    if cpu_kernels.c12_available():
        fact = on.engine_core.facts()["decode_layers"]
        assert "steps of 1-2 rows read the bf16 linears' lossless 12-bit copy (153 MiB more" in fact, fact


@pytest.mark.parametrize("count", [1, 3, 4])
def test_greedy_requests_get_the_tokens_of_the_whole_head(engines, count):
    """1, 3 and 4 greedy requests at once (steps of 1-4 rows: the route)."""
    on, off = engines
    assert outputs(on, PROMPTS[:count], GREEDY) == outputs(off, PROMPTS[:count], GREEDY)


def test_a_step_with_a_row_that_reads_its_logits_computes_the_whole_head(engines):
    """A greedy request beside one with logprobs, one with a penalty and a seeded sample: the
    logprobs are the whole head's (a -inf logit where the route had skipped a token would
    change them), the penalty and the sample see every logit."""
    on, off = engines
    got = outputs(on, PROMPTS, MIXED)
    assert got == outputs(off, PROMPTS, MIXED)
    assert "-inf" not in got[1][1]
    for params in MIXED[1:]:  # and each alone: a step of one row that reads its logits
        assert outputs(on, PROMPTS[:1], params) == outputs(off, PROMPTS[:1], params)
