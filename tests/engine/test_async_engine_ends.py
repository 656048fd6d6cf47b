"""How AsyncEngine reports the end of each sample (`on_sample_end`) and ends one early
(`stop`): the server's per-endpoint metrics and its duplicate tool-call guard rest on these."""

from __future__ import annotations

import asyncio

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.stats import StepStats

PROMPT = [5, 6, 7, 8] * 6


def _run(tiny_model_path, scenario):
    """`scenario(engine, ends)` on a started engine; (its result, `ends`, the engine's own
    finished reasons from the step hook)."""
    config = EngineConfig.from_engine_args(model=str(tiny_model_path), dtype="float32", kernel_backend="torch",
                                           max_model_len=256, num_gpu_blocks_override=64)
    engine_reasons: list[str] = []

    def on_step(stats: StepStats) -> None:
        engine_reasons.extend(f.finish_reason for f in stats.finished)

    async def main():
        engine = AsyncEngine(config, on_step=on_step)
        engine.start()
        ends: dict[int, tuple[str | None, int]] = {}

        def on_sample_end(index, output):
            assert index not in ends, "one report per sample"
            ends[index] = (None, 0) if output is None else (output.finish_reason, len(output.token_ids))

        try:
            result = await scenario(engine, on_sample_end)
            for _ in range(200):  # the reports of aborts arrive a step later
                if len(ends) == 2 and not engine.core.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return result, ends
        finally:
            engine.shutdown()

    result, ends = asyncio.run(main())
    return result, ends, engine_reasons


def test_a_sample_that_finished_while_its_stream_closed_ends_as_finished(tiny_model_path):
    async def scenario(engine, on_sample_end):
        params = SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True)
        gen = engine.generate("r", PROMPT, params, on_sample_end=on_sample_end)
        await gen.__anext__()
        for _ in range(200):  # the engine finishes both samples while nobody reads them
            if not engine.core.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        await gen.aclose()  # the client leaves: the outputs it never read were final ones

    _, ends, engine_reasons = _run(tiny_model_path, scenario)
    assert ends == {0: ("length", 4), 1: ("length", 4)}
    assert sorted(engine_reasons) == ["length", "length"]


def test_leaving_mid_generation_ends_every_sample_as_aborted(tiny_model_path):
    async def scenario(engine, on_sample_end):
        params = SamplingParams(n=2, temperature=0, max_tokens=200, ignore_eos=True)
        gen = engine.generate("r", PROMPT, params, on_sample_end=on_sample_end)
        await gen.__anext__()
        await gen.aclose()

    _, ends, engine_reasons = _run(tiny_model_path, scenario)
    assert {index: reason for index, (reason, _) in ends.items()} == {0: "abort", 1: "abort"}
    assert sorted(engine_reasons) == ["abort", "abort"]


def test_stop_finishes_one_sample_as_stopped_and_its_stream_gets_the_last_output(tiny_model_path):
    async def scenario(engine, on_sample_end):
        params = SamplingParams(n=2, temperature=0, max_tokens=60, ignore_eos=True)
        finals = {}
        stopped = False
        async for out in engine.generate("r", PROMPT, params, on_sample_end=on_sample_end):
            if not stopped:
                engine.stop("r", 0)
                stopped = True
            for c in out.outputs:
                if c.finish_reason is not None:
                    finals[c.index] = (c.finish_reason, len(c.token_ids))
        return finals

    finals, ends, engine_reasons = _run(tiny_model_path, scenario)
    assert finals == ends
    assert finals[0][0] == "stop" and finals[0][1] < 60
    assert finals[1] == ("length", 60)
    assert sorted(engine_reasons) == ["length", "stop"]
