"""Greedy tokens of the real default model equal Hugging Face `generate`, prompt by prompt."""

import pytest

from engine import LLM, SamplingParams

MAX_NEW_TOKENS = 24

_PARAGRAPH = (
    "The history of tea spans several millennia and many cultures. It began in southwest China, "
    "where it was first drunk as a medicine, and spread along trade routes to Japan, Korea, India "
    "and Europe. Each place built its own rituals, vessels and ways of brewing the leaves. "
)


def _prompts(tokenizer) -> list[list[int]]:
    chat = lambda text: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    texts = [
        "The",  # one token
        "Hello, my name is",
        "def fibonacci(n):",
        chat("What is the capital of France?"),
        chat("Write a haiku about the sea."),
        "1, 2, 3, 4, 5,",
        _PARAGRAPH * 3 + "In summary,",
        _PARAGRAPH * 6 + "Question: where did tea begin? Answer:",
    ]
    ids = [tokenizer.encode(t) for t in texts]
    assert len(ids[0]) == 1 and max(len(i) for i in ids) > 300
    return ids


@pytest.fixture(scope="module")
def hf_reference(default_model_path):
    from tiny_models import hf_greedy
    from transformers import AutoTokenizer

    prompts = _prompts(AutoTokenizer.from_pretrained(str(default_model_path)))
    return prompts, hf_greedy(default_model_path, prompts, MAX_NEW_TOKENS, ignore_eos=False)


@pytest.mark.slow
def test_batched_greedy_equals_hf_generate(default_model_path, hf_reference):
    prompts, expected = hf_reference
    llm = LLM(model=str(default_model_path), dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS))
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens)"
    assert llm.engine_core.block_manager.num_free_blocks == llm.engine_core.num_blocks


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching, speculation", [(True, None), (False, None), (True, NGRAM)],
                         ids=["prefix-cache", "no-prefix-cache", "prefix-cache-ngram-speculation"])
def test_preemption_and_chunked_prefill_keep_hf_tokens(
    default_model_path, hf_reference, prefix_caching, speculation, record_schedules
):
    """With speculation too (engine/spec_decode.py): drafts verified beside prefill chunks,
    rejected ones rolled back, recomputation after preemption from the prefix cache."""
    prompts, expected = hf_reference
    # Room for the longest request plus two blocks: the eight together cannot fit, so
    # preemption must happen (with the prefix cache, recompute mostly hits it). A 64-token
    # budget splits every long prompt into chunks mixed with decodes.
    num_blocks = -(-(max(map(len, prompts)) + MAX_NEW_TOKENS) // 16) + 2
    llm = LLM(
        model=str(default_model_path), dtype="float32", block_size=16, enable_prefix_caching=prefix_caching,
        num_gpu_blocks_override=num_blocks, max_num_batched_tokens=64, speculative_config=speculation,
    )
    core = llm.engine_core
    steps = record_schedules(core)
    accepted = []
    core.on_step = lambda stats: accepted.append(stats.spec_num_accepted_tokens)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS))
    if speculation is not None:
        assert sum(accepted) > 0, "no draft was accepted"
    assert core.scheduler.num_preemptions > 0
    assert any(partial for _, partial in steps), "no prefill was split into chunks"
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens)"
    assert core.block_manager.num_free_blocks == core.num_blocks
    core.block_manager.check_invariants()
