"""Beam search (engine/beam_search.py): the beams equal Hugging Face's `generate(num_beams=n)`
in float32, they share their prefix blocks through the paged KV cache, and every block goes
back afterwards (finished, aborted, or squeezed by a small cache)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model_folder, prompts

from engine import LLM, SamplingParams

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("beam-llama"), "llama")


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", block_size=4)


def hf_beams(model, ids: list[int], n: int, length_penalty: float, max_new_tokens: int,
             eos_token_ids: list[int] | None = None, min_new_tokens: int = 0) -> list[list[int]]:
    """transformers' n best beams (best first), each cut after its stop token (the rest is padding)."""
    eos = eos_token_ids if eos_token_ids is not None else [model.generation_config.eos_token_id]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            num_beams=n, num_return_sequences=n, length_penalty=length_penalty, max_new_tokens=max_new_tokens,
            eos_token_id=eos, pad_token_id=1, min_new_tokens=min_new_tokens,
        )
    beams = []
    for row in out[:, len(ids):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos and i >= min_new_tokens), len(row))
        beams.append(row[:end])
    return beams


# A stop token the greedy path emits early, so beams finish at different lengths and the
# length penalty decides between them; with min_tokens, the stop is masked at first.
CASES = {
    "n1": dict(n=1, length_penalty=1.0),
    "n4": dict(n=4, length_penalty=1.0),
    "n3-stop-penalty-1": dict(n=3, length_penalty=1.0, stop=True),
    "n3-stop-penalty-0": dict(n=3, length_penalty=0.0, stop=True),
    "n3-stop-penalty-0.5": dict(n=3, length_penalty=0.5, stop=True),
    "n3-stop-penalty-minus-1": dict(n=3, length_penalty=-1.0, stop=True),
    "n2-stop-min-tokens": dict(n=2, length_penalty=1.0, stop=True, min_tokens=4),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("prompt_len", [5, 23])
def test_beams_equal_hf_generate_on_a_tiny_llama(llm, hf_model, case, prompt_len):
    c = CASES[case]
    [ids] = prompts((prompt_len,))
    stop_ids: list[int] = []
    eos_id = hf_model.generation_config.eos_token_id
    plain = hf_beams(hf_model, ids, c["n"], c["length_penalty"], MAX_NEW_TOKENS, [eos_id])
    tokens = list(dict.fromkeys(t for beam in plain for t in beam[1:]))
    for stop in tokens if c.get("stop") else [None]:
        # With a stop: the first token of the unstopped beams that ends a returned beam early.
        stop_ids = [] if stop is None else [stop]
        eos = [eos_id, *stop_ids]
        expected = hf_beams(hf_model, ids, c["n"], c["length_penalty"], MAX_NEW_TOKENS, eos, c.get("min_tokens", 0))
        if stop is None or any(len(b) < MAX_NEW_TOKENS for b in expected):
            break
    else:
        pytest.fail("no stop token makes a returned beam finish early: the case tests nothing")
    params = SamplingParams(
        n=c["n"], use_beam_search=True, length_penalty=c["length_penalty"], max_tokens=MAX_NEW_TOKENS,
        stop_token_ids=stop_ids, min_tokens=c.get("min_tokens", 0),
    )
    [out] = llm.generate([ids], params)
    assert [o.token_ids for o in out.outputs] == expected
    assert [o.index for o in out.outputs] == list(range(c["n"]))
    for o in out.outputs:
        assert o.finish_reason == ("stop" if o.token_ids[-1] in eos else "length")
        # As a sampled request's text: the word-level tokenizer puts a space before each word.
        assert o.text == " " + llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
    core = llm.engine_core
    assert core.block_manager.num_free_blocks == core.num_blocks and not core.requests


def test_beams_share_prefix_blocks_and_give_them_back(tiny_llama, record_schedules):
    """n beams hold the prompt's blocks once: the peak is well under n x one beam's blocks;
    forks copy only a partly filled block (copy-on-write), and everything is free after."""
    n, block_size = 4, 4
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=block_size)
    core = llm.engine_core
    core.debug_invariants = True  # BlockManager.check_invariants after every step
    steps = record_schedules(core)
    peak = 0
    original = core.runner.execute

    def execute(sched):
        nonlocal peak
        peak = max(peak, core.block_manager.num_used_blocks)
        return original(sched)

    core.runner.execute = execute
    [ids] = prompts((41,))
    [out] = llm.generate([ids], SamplingParams(n=n, use_beam_search=True, max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    assert len(out.outputs) == n and all(len(o.token_ids) == MAX_NEW_TOKENS for o in out.outputs)
    one_beam = -(-(len(ids) + MAX_NEW_TOKENS) // block_size)  # 14 blocks
    shared_prompt = len(ids) // block_size  # 10 full blocks, held once
    assert peak < n * one_beam
    assert peak <= shared_prompt + n * (-(-(MAX_NEW_TOKENS + 1) // block_size) + 1)
    assert any(sched.blocks_to_copy for sched, _ in steps), "no fork ever copied a shared partial block"
    # The prompt was computed once; every later step computes one token per beam.
    assert sum(s.total_num_scheduled_tokens for s, _ in steps) <= len(ids) + n * MAX_NEW_TOKENS
    assert core.block_manager.num_free_blocks == core.num_blocks and not core.requests


def test_abort_mid_search_frees_every_block(llm):
    core = llm.engine_core
    [ids] = prompts((23,))
    core.add_request("beams", ids, SamplingParams(n=3, use_beam_search=True, max_tokens=MAX_NEW_TOKENS))
    for _ in range(4):
        assert core.step() == []  # nothing comes out before the end
    assert core.block_manager.num_used_blocks > 0
    out = core.abort_request("beams")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert core.block_manager.num_free_blocks == core.num_blocks and not core.requests
    core.block_manager.check_invariants()


def test_searches_squeezed_by_a_small_cache_keep_their_beams(tiny_llama, hf_model):
    """Four searches and two sampled requests in a cache that holds one search's worst case:
    beams park for their siblings, searches stall each other until the parked beams of all
    but one are released, requests are preempted and recomputed; the beams are still
    Hugging Face's and every block comes back."""
    all_ids = prompts((23, 17, 30, 21, 19, 25), seed=3)
    n = 3
    need = n * -(-(max(map(len, all_ids)) + MAX_NEW_TOKENS) // 4)  # one search, nothing shared
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=4, num_gpu_blocks_override=need, max_num_seqs=8,
              max_num_batched_tokens=16)
    core = llm.engine_core
    core.debug_invariants = True
    beam = SamplingParams(n=n, use_beam_search=True, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    params = [beam, beam, greedy, beam, beam, greedy]
    outs = llm.generate(all_ids, params)
    assert core.scheduler.num_preemptions > 0
    for ids, p, out in zip(all_ids, params, outs):
        if p.use_beam_search:
            assert [o.token_ids for o in out.outputs] == hf_beams(hf_model, ids, n, 1.0, MAX_NEW_TOKENS, eos_token_ids=[])
        else:
            assert len(out.outputs[0].token_ids) == MAX_NEW_TOKENS
    assert core.block_manager.num_free_blocks == core.num_blocks and not core.requests


def test_logprobs_and_prompt_logprobs_follow_the_chosen_tokens(llm):
    [ids] = prompts((9,))
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    [out] = llm.generate([ids], params)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for token, entry in zip(o.token_ids, o.logprobs):
            assert next(iter(entry)) == token  # the chosen token first, then the top 3
            assert len(entry) in (3, 4)
    # Two beams that share a first token agree on its logprob.
    best, second = out.outputs
    if best.token_ids[0] == second.token_ids[0]:
        assert best.logprobs[0] == second.logprobs[0]


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.7), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1), ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5), ("repetition_penalty", 1.2), ("logit_bias", {5: 1.0}), ("stop", ["x"]),
    ("max_tokens", 0),
])
def test_fields_beam_search_cannot_honour_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(n=2, use_beam_search=True, **{field: value})


def test_length_penalty_without_beam_search_is_refused():
    with pytest.raises(ValueError, match="^length_penalty"):
        SamplingParams(length_penalty=2.0)
    SamplingParams(n=2, use_beam_search=True, temperature=1.0, seed=3)  # temperature 1 is the raw distribution


@pytest.fixture(scope="module")
def default_model_pair(default_model_path):
    """The bundled model in the engine and in transformers, both float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(default_model_path), dtype=torch.float32).eval()
    llm = LLM(model=str(default_model_path), dtype="float32", num_gpu_blocks_override=64)
    return llm, model, AutoTokenizer.from_pretrained(str(default_model_path))


@pytest.mark.parametrize("chat, length_penalty", [(False, 1.0), (True, 0.5)], ids=["text-penalty-1", "chat-penalty-0.5"])
def test_best_beams_equal_hf_generate_on_the_default_model(default_model_pair, chat, length_penalty):
    llm, model, tokenizer = default_model_pair
    text = "The capital of France is"
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True,
                                             tokenize=False)
    ids = tokenizer.encode(text)
    expected = hf_beams(model, ids, 3, length_penalty, 10, [model.generation_config.eos_token_id])
    [out] = llm.generate([ids], SamplingParams(n=3, use_beam_search=True, length_penalty=length_penalty, max_tokens=10))
    assert [o.token_ids for o in out.outputs] == expected
    assert llm.engine_core.block_manager.num_free_blocks == llm.engine_core.num_blocks
