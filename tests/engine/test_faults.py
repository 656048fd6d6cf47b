"""An exception inside a step fails that step's requests only; the engine keeps serving."""

import pytest

from engine import LLM, SamplingParams
from engine.engine_core import StepFailedError


def test_injected_fault_fails_the_step_and_the_engine_recovers(tiny_model_path, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = LLM(model=str(tiny_model_path), max_model_len=256, num_gpu_blocks_override=64)
    expected = reference.generate(["After the fault"], params)[0].outputs[0].token_ids

    monkeypatch.setenv("PAGODA_FAULT_AT_STEP", "3")
    llm = LLM(model=str(tiny_model_path), max_model_len=256, num_gpu_blocks_override=64)
    core = llm.engine_core
    core.add_request("a", [5, 6, 7, 8] * 9, params)
    core.add_request("b", [9, 10, 11] * 7, params)
    core.step()
    core.step()
    with pytest.raises(StepFailedError) as failure:
        core.step()
    assert sorted(failure.value.request_ids) == ["a", "b"]
    assert not core.has_unfinished_requests() and not core.requests
    assert core.block_manager.num_free_blocks == core.num_blocks
    assert core.block_manager.cached_blocks == {}  # possibly unwritten blocks are forgotten
    core.block_manager.check_invariants()
    # The next request is served normally, with the tokens of an engine that never failed.
    assert llm.generate(["After the fault"], params)[0].outputs[0].token_ids == expected
