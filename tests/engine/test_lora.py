"""LoRA adapters (engine/lora.py) on a tiny random Llama: greedy tokens under each adapter
equal transformers + peft's `generate` in float32, in one batch that mixes adapters and the
base under a --max-loras smaller than the adapters in play, and two adapters never share
cached KV blocks."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

MAX_NEW_TOKENS = 6
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (seed, rank, alpha, rsLoRA, target modules)
ADAPTERS = {
    "full-r8": (1, 8, 16, False, TARGETS),
    "rs-r4": (2, 4, 8, True, TARGETS),
    "qv-r2": (3, 2, 4, False, ["q_proj", "v_proj"]),  # some shards of the fused linears only
}


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    from peft import PeftModel
    from tiny_models import make_lora_adapter, make_model_folder, prompts
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    base = make_model_folder(root / "base", "llama")
    paths = {name: make_lora_adapter(base, root / name, *spec) for name, spec in ADAPTERS.items()}
    prompt_ids = prompts((5, 19))
    expected: dict[str | None, list[list[int]]] = {}
    for name in [None, *paths]:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(paths[name]))
        model.eval()
        model.generation_config.eos_token_id = None
        with torch.inference_mode():
            expected[name] = [
                model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
                for ids in prompt_ids
            ]
    for name in paths:  # else the test could not tell an adapter from the base
        assert expected[name] != expected[None], name
    return base, paths, prompt_ids, expected


@pytest.fixture(scope="module")
def llm(lora_setup):
    base, paths, _, _ = lora_setup
    return LLM(model=str(base), dtype="float32", block_size=4, max_loras=3,
               lora_modules=[f"{name}={path}" for name, path in paths.items()])


def _run_mixed_batch(lora_setup, llm, monkeypatch) -> list[int]:
    """Every prompt under the base and each adapter, in one generate call: each row gets its
    own adapter's tokens. Returns the number of adapters in each step."""
    _, paths, prompt_ids, expected = lora_setup
    loras = llm.engine_core.loras
    adapters_per_step: list[int] = []
    begin_step = loras.begin_step

    def recording_begin_step(scheduled, num_rows):
        begin_step(scheduled, num_rows)
        adapters_per_step.append(len(loras.groups))

    monkeypatch.setattr(loras, "begin_step", recording_begin_step)
    rows = [(name, i) for name in [None, *paths] for i in range(len(prompt_ids))]
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                             lora_request=None if name is None else loras.request_for(name)) for name, _ in rows]
    outs = llm.generate([prompt_ids[i] for _, i in rows], params)
    for (name, i), out in zip(rows, outs):
        assert out.outputs[0].token_ids == expected[name][i], f"adapter {name}, prompt {i}"
    core = llm.engine_core
    assert core.block_manager.num_free_blocks == core.num_blocks
    return adapters_per_step


def test_mixed_adapter_batch_equals_peft_generate(lora_setup, llm, monkeypatch):
    assert max(_run_mixed_batch(lora_setup, llm, monkeypatch)) == 3  # three adapters (and the base) in one step


def test_max_loras_caps_the_adapters_of_a_step(lora_setup, llm, monkeypatch):
    # Two slots for three adapters: requests for the third wait, and adapters swap (LRU).
    core = llm.engine_core
    monkeypatch.setattr(core.scheduler, "max_loras", 2)
    monkeypatch.setattr(core.loras, "max_loras", 2)
    core.block_manager.reset_prefix_cache()
    assert max(_run_mixed_batch(lora_setup, llm, monkeypatch)) == 2


def test_two_adapters_never_share_cached_blocks(lora_setup, llm):
    _, paths, prompt_ids, expected = lora_setup
    loras, bm = llm.engine_core.loras, llm.engine_core.block_manager
    bm.reset_prefix_cache()
    prompt = prompt_ids[1]  # 19 tokens: 4 full blocks

    def run(name: str | None, expected_tokens: list[int]) -> int:
        """Prompt tokens served from the prefix cache for one request under `name`."""
        hits = bm.prefix_cache_hits
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                                lora_request=None if name is None else loras.request_for(name))
        out = llm.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == expected_tokens, name
        return bm.prefix_cache_hits - hits

    assert run("full-r8", expected["full-r8"][1]) == 0
    assert run("rs-r4", expected["rs-r4"][1]) == 0  # the same tokens, another adapter: nothing shared
    assert run(None, expected[None][1]) == 0  # nor with the base
    assert run("full-r8", expected["full-r8"][1]) == 16  # while the same adapter does reuse its blocks
    # A name reloaded with other weights gets a new id: none of the old adapter's blocks either.
    assert loras.remove("full-r8")
    loras.add("full-r8", paths["rs-r4"])
    assert run("full-r8", expected["rs-r4"][1]) == 0


def test_bad_adapters_are_refused_by_name(lora_setup, llm, tmp_path):
    from engine.lora import LoraError, load_adapter

    _, paths, _, _ = lora_setup
    loras = llm.engine_core.loras
    with pytest.raises(LoraError, match="rank 8, above --max-lora-rank 4"):
        load_adapter(paths["full-r8"], "big", 99, llm.engine_core.model.args, 4, torch.float32)
    with pytest.raises(LoraError, match="adapter_config.json"):
        loras.add("empty", tmp_path)
    with pytest.raises(LoraError, match="already loaded"):
        loras.add("qv-r2", paths["qv-r2"])
    assert "empty" not in loras.names()


def test_bf16_adapters_run_in_the_fused_decode_call_and_are_batch_invariant(lora_setup, monkeypatch):
    """bf16 on the C++ kernels (AVX512-BF16): the deltas are one C++ call per linear
    (`lora_add`), in the per-layer forward and inside the fused decode call alike. Decode
    steps with adapter rows run the fused call, given their deltas, with the tokens and
    logprobs of the per-layer forward (fused off); each request's output is the same bits
    alone and in one batch mixing the three adapters and the base; the adapters change the
    tokens."""
    base, paths, prompt_ids, _ = lora_setup
    llm = LLM(model=str(base), dtype="bfloat16", block_size=4, enable_prefix_caching=False,
              lora_modules=[f"{name}={path}" for name, path in paths.items()])
    model, loras = llm.engine_core.model, llm.engine_core.loras
    if model.fused_decode is None or not loras.kernel:
        pytest.skip("the fused decode call and the C++ deltas do not run here (no AVX512-BF16)")
    names = [None, *paths]

    def params(name):
        return SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=2,
                              lora_request=None if name is None else loras.request_for(name))

    def result(out):
        c = out.outputs[0]
        return c.token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in c.logprobs]

    fused_type = type(model.fused_decode)
    calls_with_lora = []
    original = fused_type.__call__

    def spy(self, *args, **kwargs):
        calls_with_lora.append(kwargs.get("lora") is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fused_type, "__call__", spy)
    alone = {name: result(llm.generate([prompt_ids[0]], params(name))[0]) for name in names}
    assert any(calls_with_lora), "decode steps with adapter rows should run the fused call with their deltas"
    assert not loras._logged_fused_fallback
    assert len({tuple(alone[name][0]) for name in names}) == len(names)
    mixed = llm.generate([prompt_ids[0]] * len(names) + [prompt_ids[1]] * len(names), [params(n) for n in names] * 2)
    for name, out in zip(names, mixed):
        assert result(out) == alone[name], name
    monkeypatch.setattr(model, "fused_decode", None)
    for name in names:
        assert result(llm.generate([prompt_ids[0]], params(name))[0]) == alone[name], name


def test_beam_search_runs_its_beams_under_the_adapter(lora_setup, llm):
    """Beams are requests of their own (engine/beam_search.py): they carry the search's
    adapter. A width-1 search is greedy: the adapter's greedy tokens."""
    _, _, prompt_ids, expected = lora_setup
    params = SamplingParams(use_beam_search=True, n=1, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                            temperature=0, lora_request=llm.engine_core.loras.request_for("rs-r4"))
    [out] = llm.generate([prompt_ids[0]], params)
    assert out.outputs[0].token_ids == expected["rs-r4"][0]
