"""The offline Python API: `LLM(model=None, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sample `index` of an n > 1 request: one sample each, distinct seeds."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.config = EngineConfig.from_engine_args(model=model, **engine_args)
        self.engine_core = EngineCore(self.config)
        self.tokenizer = self.engine_core.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (with tensor_parallel_size > 1); the
        LLM cannot generate afterwards. They also end when this process exits."""
        self.engine_core.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); one RequestOutput per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")

        core = self.engine_core
        results: list[RequestOutput] = []
        children: dict[str, tuple[int, int]] = {}  # child request id -> (prompt index, sample index)
        for params in params_list:
            if params.structured_output is not None:
                # Compile errors (GrammarError) raise here, before any request is queued.
                core.structured_output.compile(params.structured_output).result()
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                results.append(RequestOutput(str(next(self._ids)), prompt if isinstance(prompt, str) else None, token_ids))
                results[-1].outputs = [None] * params.n  # type: ignore[list-item]
                for j in range(1 if params.use_beam_search else params.n):  # a beam search: one request, n outputs
                    child_id = f"{results[-1].request_id}-{j}"
                    core.add_request(
                        child_id, token_ids, params if params.use_beam_search else child_params(params, j),
                        fork_of=f"{results[-1].request_id}-0" if j else None,
                    )
                    children[child_id] = (i, j)
            pending = len(children)
            while pending:
                for out in core.step():
                    if out.finished:
                        i, j = children[out.request_id]
                        if params_list[i].use_beam_search:
                            results[i].outputs = out.outputs
                        else:
                            completion = out.outputs[0]
                            completion.index = j
                            results[i].outputs[j] = completion
                        if j == 0:
                            results[i].prompt_logprobs = out.prompt_logprobs
                            results[i].num_cached_tokens = out.num_cached_tokens
                        pending -= 1
        finally:
            for child_id in children:
                core.abort_request(child_id)  # no-op for finished ones; frees blocks on error
        for result in results:
            result.finished = True
        return results
