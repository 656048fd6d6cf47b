"""End to end: the engine on the Triton kernels gives Hugging Face `generate`'s greedy tokens.

On CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set before they
are imported); on CUDA compiled. Tiny random-weight folders (tests/tiny_models.py, each
with its own word-level tokenizer): a Llama, and Qwen2, Qwen3, Mistral and Gemma 3 with
head_dim 64, 128 and 256 and sliding windows shorter than the prompts. A small token
budget splits prompts into chunks and a small cache forces preemption, and the tests
assert both happened.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from tiny_models import ARCHITECTURES, check_engine_equals_hf, hf_greedy, make_model_folder, prompts  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

MAX_NEW_TOKENS = 8
BLOCK_SIZE = 4
PROMPTS = prompts((1, 23, 61))


@pytest.fixture(scope="module")
def triton_model_path(tmp_path_factory):
    """2 layers, 4 query heads on 2 KV heads of 64 dims (a head_dim the kernels take), tied
    embeddings, weights ~10x the default scale: attention scores far from uniform, so a
    wrong score, mask or softmax changes the tokens (at 0.02 a 20% scale error did not)."""
    return make_model_folder(tmp_path_factory.mktemp("tiny-llama-hd64"), "llama")


@pytest.fixture(scope="module")
def prompts_and_hf_tokens(triton_model_path):
    return PROMPTS, hf_greedy(triton_model_path, PROMPTS, MAX_NEW_TOKENS, ignore_eos=False)


def test_triton_engine_greedy_equals_hf_with_chunked_prefill_and_preemption(triton_model_path, prompts_and_hf_tokens, record_schedules):
    prompts, expected = prompts_and_hf_tokens
    # 20 blocks of 4 tokens hold the longest request (69 tokens) but not all three: preemption.
    # A 16-token budget splits the 23- and 61-token prompts into chunks mixed with decodes.
    llm = LLM(
        model=str(triton_model_path), dtype="float32", kernel_backend="triton", block_size=BLOCK_SIZE,
        num_gpu_blocks_override=20, max_num_batched_tokens=16, max_model_len=128,
    )
    core = llm.engine_core
    assert core.ops.backend == "triton"
    steps = record_schedules(core)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS))
    assert core.scheduler.num_preemptions > 0
    assert any(partial for _, partial in steps), "no prefill was split into chunks"
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens)"
    assert core.block_manager.num_free_blocks == core.num_blocks


def test_triton_forked_samples_equal_torch_backend(triton_model_path, prompts_and_hf_tokens, record_schedules):
    """n > 1 forks share the prompt's blocks and copy-on-write the partial one (triton_copy);
    the seeded samples equal the torch backend's."""
    prompt = prompts_and_hf_tokens[0][1]  # 23 tokens: its last token sits inside a shared block of 4
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(model=str(triton_model_path), dtype="float32", kernel_backend=backend, block_size=BLOCK_SIZE,
                  num_gpu_blocks_override=64, max_model_len=128)
        steps = record_schedules(llm.engine_core)
        outs[backend] = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
        assert any(out.blocks_to_copy for out, _ in steps), "the forks never copied a shared block"
        assert llm.engine_core.block_manager.num_free_blocks == llm.engine_core.num_blocks
    assert outs["triton"] == outs["torch"]
    assert len({tuple(t) for t in outs["triton"]}) > 1


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "llama"])
def test_triton_architectures_equal_hf_with_chunked_prefill_and_preemption(tmp_path, arch, record_schedules):
    """The other architectures (tests/engine/test_architectures.py on the torch backend)."""
    path = make_model_folder(tmp_path, arch)
    arch_prompts = prompts((1, 23, 41))
    expected = hf_greedy(path, arch_prompts, MAX_NEW_TOKENS)
    # 14 blocks of 4 tokens hold the longest request (49 tokens) but not all three.
    check_engine_equals_hf(
        path, arch_prompts, expected, record_schedules, kernel_backend="triton", num_gpu_blocks_override=14,
        max_model_len=64,
    )
