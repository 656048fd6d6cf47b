"""A reasoning model's thinking, told apart on token ids (engine/thinking.py), and the
DeepSeek-R1 form end to end through the engine (the chat routes: tests/server/test_reasoning.py)."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.thinking import Part, ThinkingSpec, ThinkingState
from server.reasoning import reasoning_parser

T, A, B, E1, E2, S = 1, 10, 11, 7, 8, 5  # think start, two words, a two-token end tag, a start tag


def classify(spec: ThinkingSpec, tokens: list[int]) -> tuple[list[Part], list[int]]:
    state = ThinkingState(spec)
    parts, thinking = [], []
    for token in tokens:
        part, released = state.advance(token)
        parts.append(part)
        thinking += released
    return parts, thinking


def test_a_two_token_end_tag_is_held_until_it_completes_or_breaks():
    spec = ThinkingSpec(end_token_ids=(E1, E2))
    # E1 then A: not the tag after all, so E1 was thinking (released with A); E1 E1 E2: the
    # first E1 breaks off, the second starts the tag that completes.
    parts, thinking = classify(spec, [A, E1, A, E1, E1, E2, B])
    assert thinking == [A, E1, A, E1]
    assert parts == [Part.THINKING, Part.TAG, Part.THINKING, Part.TAG, Part.TAG, Part.TAG, Part.ANSWER]


def test_a_required_start_tag_missing_means_no_thinking():
    spec = ThinkingSpec(end_token_ids=(E1,), start_token_ids=(S,), start_required=True)
    assert classify(spec, [A, E1, B]) == ([Part.ANSWER] * 3, [])
    assert classify(spec, [S, A, E1, B]) == ([Part.TAG, Part.THINKING, Part.TAG, Part.ANSWER], [A])


def test_an_optional_start_tag_is_skipped_when_present():
    spec = ThinkingSpec(end_token_ids=(E1,), start_token_ids=(S,), start_required=False)
    assert classify(spec, [A, E1, B])[1] == [A]
    assert classify(spec, [S, A, E1, B])[1] == [A]


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_budget_forces_the_whole_end_tag_after_that_many_thinking_tokens(budget):
    state = ThinkingState(ThinkingSpec(end_token_ids=(E1, E2), start_token_ids=(S,), start_required=True,
                                       budget=budget))
    assert state.forced_token() is None  # the model decides whether it thinks at all
    state.advance(S)
    emitted = []
    while not state.answering:
        token = state.forced_token() or A  # the model would think on
        emitted.append(token)
        state.advance(token)
    assert emitted == [A] * budget + [E1, E2]
    assert state.num_thinking_tokens == budget and state.num_tokens == budget + 3
    assert state.forced_token() is None


@pytest.fixture(scope="module")
def thinking_llm(thinking_model_path):
    return LLM(str(thinking_model_path), dtype="float32", kv_cache_memory=0.02)


def test_deepseek_r1_form_thinking_opened_by_the_prompt(thinking_llm):
    # DeepSeek-R1's template ends the prompt with <think>: the output has no opening tag,
    # only the end one, and everything before it is thinking.
    tokenizer = thinking_llm.tokenizer
    parser = reasoning_parser("deepseek_r1", tokenizer, None)
    prompt = tokenizer.encode("Hi <think>", add_special_tokens=False)
    spec = parser.thinking_spec(tokenizer, prompt, None)
    [out] = thinking_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, thinking=spec))[0].outputs
    assert parser.start_token_ids[0] not in out.token_ids and parser.end_token_ids[0] in out.token_ids
    assert (out.reasoning_text, out.text) == (" ok so well", " The answer")
    assert out.num_reasoning_tokens == 4


def test_deepseek_r1_form_without_the_end_tag_is_all_thinking(thinking_llm):
    tokenizer = thinking_llm.tokenizer
    parser = reasoning_parser("deepseek_r1", tokenizer, None)
    prompt = tokenizer.encode("Hi <think>", add_special_tokens=False)
    spec = parser.thinking_spec(tokenizer, prompt, None)
    [out] = thinking_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, thinking=spec))[0].outputs
    assert (out.reasoning_text, out.text, out.finish_reason) == (" ok so", "", "length")
