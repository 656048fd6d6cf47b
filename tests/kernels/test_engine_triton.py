"""End to end: the engine on the Triton kernels gives Hugging Face `generate`'s greedy tokens.

On CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set before they
are imported); on CUDA compiled. A tiny random-weight Llama whose head_dim (64) the
kernels support, with its own word-level tokenizer; a small token budget splits prompts
into chunks and a small cache forces preemption, and the test asserts both happened.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, SamplingParams  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

MAX_NEW_TOKENS = 8
BLOCK_SIZE = 4


VOCAB_SIZE = 512


def _save_word_level_tokenizer(path) -> None:
    """A 512-word tokenizer ("w0".."w511"): the engine loads one from the model folder, and
    this keeps the test free of any downloaded or converted model (it runs on the GPU box)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB_SIZE)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2", pad_token="w2"
    ).save_pretrained(path)


@pytest.fixture(scope="module")
def triton_model_path(tmp_path_factory):
    """2 layers, 4 query heads on 2 KV heads of 64 dims (a head_dim the kernels take)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-hd64")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        # Weights ~10x the default scale: attention scores far from uniform, so a wrong
        # score, mask or softmax changes the tokens (at 0.02 a 20% scale error did not).
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    _save_word_level_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def prompts_and_hf_tokens(triton_model_path):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (1, 23, 61)]
    model = AutoModelForCausalLM.from_pretrained(str(triton_model_path), dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
            )
            expected.append(out[0, len(ids):].tolist())
    return prompts, expected


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
