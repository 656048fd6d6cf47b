"""Prompt logprobs through the chunked LM head (engine/prompt_logprobs.py): the same values
as one log-softmax over all rows, at most LOGITS_CHUNK_ROWS rows of logits at a time, one
transfer to the host per step; and the engine's prompt logprobs equal transformers'."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model_folder, prompts

from engine import LLM, SamplingParams
from engine.prompt_logprobs import PromptLogprobRows, chunked_logits

VOCAB, HIDDEN = 50, 8


def _head(calls: list[int]):
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 3

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return hidden @ weight.t()

    return compute_logits, weight


@pytest.mark.parametrize(("num_sampling", "num_prompt", "chunk"), [(3, 10, 4), (0, 7, 3), (5, 2, 16), (9, 0, 4)])
def test_chunks_equal_one_log_softmax(num_sampling, num_prompt, chunk) -> None:
    calls: list[int] = []
    compute_logits, weight = _head(calls)
    hidden = torch.randn(num_sampling + num_prompt, HIDDEN, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, VOCAB, (num_prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    ks = [k % 4 for k in range(num_prompt)]  # top-0 .. top-3
    prompt = PromptLogprobRows.of(targets, ks, torch.device("cpu")) if num_prompt else None
    logits = chunked_logits(compute_logits, hidden, prompt, chunk_rows=chunk)

    full = hidden @ weight.t()
    assert max(calls) <= chunk and sum(calls) == hidden.shape[0]  # the LM head, chunk by chunk
    torch.testing.assert_close(logits, full[:num_sampling], rtol=1e-5, atol=1e-5)  # a GEMM per chunk: last bits
    if prompt is None:
        return
    logprobs = torch.log_softmax(full[num_sampling:], dim=-1)
    for j, lp in enumerate(prompt.to_host()):
        row, target, k = logprobs[j], targets[j], ks[j]
        top = torch.topk(row, k)
        assert lp.token_ids == [target, *top.indices.tolist()]
        assert lp.logprobs == pytest.approx([row[target].item(), *top.values.tolist()], abs=1e-5)
        assert lp.ranks == [int((row > row[target]).sum()) + 1, *range(1, k + 1)]


def test_ranks_without_logits_run_the_same_chunks() -> None:
    """A tensor-parallel rank other than 0 (its LM head returns None) calls the head as
    often as rank 0 with prompt rows: the collectives inside it meet."""
    calls: list[int] = []
    hidden = torch.randn(11, HIDDEN)
    assert chunked_logits(lambda h: calls.append(h.shape[0]), hidden, None, chunk_rows=4) is None
    rank0: list[int] = []
    compute_logits, _ = _head(rank0)
    chunked_logits(compute_logits, hidden, PromptLogprobRows.of([1] * 6, [0] * 6, torch.device("cpu")), chunk_rows=4)
    assert calls == rank0 == [4, 4, 3]


def test_results_reach_the_host_in_one_transfer(monkeypatch) -> None:
    compute_logits, _ = _head([])
    prompt = PromptLogprobRows.of(list(range(20)), [2] * 20, torch.device("cpu"))
    chunked_logits(compute_logits, torch.randn(20, HIDDEN), prompt, chunk_rows=4)
    transfers = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: transfers.append(self.shape) or tolist(self))
    assert len(prompt.to_host()) == 20
    assert transfers == [torch.Size([20, 2 + 2 * 2])]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("tiny-llama-prompt-lp"), "llama")


def test_engine_prompt_logprobs_equal_transformers_with_small_chunks(model_path, monkeypatch) -> None:
    """Chunks of 5 rows across a 16-token step budget (prompt split over steps too): the
    prompt logprobs equal transformers' log-softmax of the same prompt."""
    from transformers import AutoModelForCausalLM

    import engine.prompt_logprobs

    monkeypatch.setattr(engine.prompt_logprobs, "LOGITS_CHUNK_ROWS", 5)
    ids = prompts((37,))[0]
    llm = LLM(model=str(model_path), dtype="float32", max_model_len=64, num_gpu_blocks_override=32,
              max_num_batched_tokens=16, block_size=4)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        row = expected[p - 1]
        assert entry[ids[p]].logprob == pytest.approx(row[ids[p]].item(), abs=1e-4)
        top = torch.topk(row, 2).indices.tolist()
        assert set(top) <= set(entry)
