"""Engine behaviour a user of `LLM.generate` notices, on a tiny random-weight model."""

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    return LLM(model=str(tiny_model_path), max_model_len=256, num_gpu_blocks_override=64)


def _free(llm):
    core = llm.engine_core
    return core.block_manager.num_free_blocks == core.num_blocks and not core.requests


PROMPTS = ["Hello there", "The quick brown fox", "1 2 3", "A much longer prompt that goes on for a while"]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], seeded)[0].outputs[0].token_ids
    again = llm.generate(["Once upon a time"], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, max_tokens=13, ignore_eos=True),
    ]
    mixed = llm.generate(PROMPTS[:1] + ["Once upon a time"] + PROMPTS[1:3], [others[0], seeded, others[1], others[2]])
    assert len(alone) == 20
    assert alone == again
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone
    assert _free(llm)


def test_n_samples_come_back_indexed_and_distinct(llm):
    out = llm.generate(["Tell me a story"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True))
    completions = out[0].outputs
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) == 3
    assert _free(llm)


def test_greedy_is_batch_independent(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batch):
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_stop_string_truncates_text_and_reports_reason(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["Hello there"], params)[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "pick a non-blank stop string"
    cut = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    expected_text = full.text[: full.text.index(stop)]
    assert cut.text == expected_text
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    kept = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == expected_text + stop
    assert _free(llm)


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate(["1 2 3"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate(["1 2 3"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_max_tokens_none_fills_the_context_and_zero_generates_nothing(llm):
    prompt = llm.tokenizer.encode("Count with me")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == 256 and out.finish_reason == "length"
    zero = llm.generate([prompt], SamplingParams(max_tokens=0))[0].outputs[0]
    assert zero.token_ids == [] and zero.finish_reason == "length"
    assert _free(llm)


def test_token_id_prompts_equal_text_prompts(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_text = llm.generate(["The quick brown fox"], params)[0].outputs[0].token_ids
    by_ids = llm.generate([llm.tokenizer.encode("The quick brown fox")], params)[0].outputs[0].token_ids
    assert by_text == by_ids


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([5] * 250, SamplingParams(max_tokens=10), "maximum context length is 256"),
        ([5] * 300, SamplingParams(max_tokens=1), "maximum context length is 256"),
        ([], SamplingParams(max_tokens=1), "at least one token"),
        ([49152], SamplingParams(max_tokens=1), "token ids must be in"),
    ],
    ids=["prompt-plus-max-tokens", "prompt-alone", "empty", "out-of-vocab"],
)
def test_bad_requests_raise_clear_errors_and_leak_nothing(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)
    assert _free(llm)


def test_request_that_can_never_fit_the_cache_is_rejected(tiny_model_path):
    small = LLM(model=str(tiny_model_path), max_model_len=256, block_size=16, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[5] * 60], SamplingParams(max_tokens=10))
    # 64 tokens fit exactly.
    out = small.generate([[5] * 54], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 10


def test_abort_frees_blocks_mid_generation(llm):
    core = llm.engine_core
    for i in range(3):
        core.add_request(f"abort-{i}", [5] * (30 + i), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        core.step()
    assert core.block_manager.num_free_blocks < core.num_blocks
    outs = [core.abort_request(f"abort-{i}") for i in range(3)]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert core.abort_request("abort-0") is None
    assert not core.has_unfinished_requests()
    assert _free(llm)


@pytest.mark.parametrize("budget", [512, 7], ids=["whole-prompt", "chunked-prefill"])
def test_prompt_logprobs_equal_hf_forward(tiny_model_path, budget):
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(tiny_model_path), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              max_num_batched_tokens=budget)  # float32: compared with HF's float32 forward to 1e-4
    prompt = llm.tokenizer.encode("The history of tea spans several millennia and many cultures.")
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        token = prompt[pos]
        assert entry[token].logprob == pytest.approx(expected[pos - 1, token].item(), abs=1e-4)
        top2 = torch.topk(expected[pos - 1], 2).indices.tolist()
        assert set(top2) <= set(entry), f"position {pos}"
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert _free(llm)


def test_every_eos_id_of_the_generation_config_stops(tiny_model_path, tmp_path, llm):
    import json
    import shutil

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(["1 2 3"], params)[0].outputs[0].token_ids
    second_eos = full[3]
    folder = tmp_path / "multi-eos"
    shutil.copytree(tiny_model_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, second_eos]}))
    multi = LLM(model=str(folder), max_model_len=256, num_gpu_blocks_override=64)
    out = multi.generate(["1 2 3"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert out.token_ids == full[: full.index(second_eos) + 1] and out.finish_reason == "stop"
    ignored = multi.generate(["1 2 3"], params)[0].outputs[0]
    assert ignored.token_ids == full
