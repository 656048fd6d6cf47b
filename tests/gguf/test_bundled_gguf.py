"""The bundled SmolLM2 served from its own GGUF file (Q4_1) instead of its float conversion."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.default_model import DEFAULT_MODEL_NAME, _gguf_path, resolve_model_path
from engine.quantization.linears import Int4Linear

MAX_TOKENS = 24
# Per prompt token, |logprob(INT4 kept) - logprob(dequantized)| in nats. Measured on these
# prompts (float32, CPU int4 kernel): mean 0.021, max 0.134; the bounds leave about 2x.
MAX_LOGPROB_GAP = 0.3
MEAN_LOGPROB_GAP = 0.05

_TEA = ("The history of tea spans several millennia and many cultures. It began in southwest China, "
        "where it was first drunk as a medicine, and spread along trade routes to Japan, Korea, India "
        "and Europe. ")


def prompts(tokenizer) -> list[list[int]]:
    chat = lambda text: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    texts = ["The", "Hello, my name is", "def fibonacci(n):", chat("What is the capital of France?"),
             chat("Write a haiku about the sea."), "1, 2, 3, 4, 5,", _TEA * 2 + "In summary,",
             "import numpy as np\n\ndef softmax(x):"]
    return [tokenizer.encode(t) for t in texts]


def generate(model: str, ids: list[list[int]], **kwargs):
    llm = LLM(model=model, dtype="float32", max_model_len=1024, **kwargs)
    try:
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=0))
        return llm, outs
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def float_folder_run(default_model_path):
    """The prompts and what the float HF folder (the default way to serve the model) gives."""
    from transformers import AutoTokenizer

    ids = prompts(AutoTokenizer.from_pretrained(str(default_model_path)))
    return ids, generate(str(default_model_path), ids)[1]


def test_gguf_metadata_gives_the_float_folders_tokenizer_template_and_stops(default_model_path):
    from transformers import AutoTokenizer, GenerationConfig

    folder = resolve_model_path(str(_gguf_path()))
    assert folder.name == DEFAULT_MODEL_NAME  # the same served model name
    ours, theirs = AutoTokenizer.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(default_model_path))
    assert ours.chat_template == theirs.chat_template
    assert prompts(ours) == prompts(theirs)
    assert (ours.eos_token, ours.bos_token) == (theirs.eos_token, theirs.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert GenerationConfig.from_pretrained(str(folder)).eos_token_id == 2


def test_dequantized_gguf_gives_the_float_folders_greedy_tokens(float_folder_run):
    ids, expected = float_folder_run
    _, outs = generate(str(_gguf_path()), ids, load_format="dequantize")
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp.outputs[0].token_ids, f"prompt {i} ({len(ids[i])} tokens)"


def test_int4_gguf_prompt_logprobs_stay_close_to_the_dequantized_ones(float_folder_run):
    """Served as it is (Q4_1 -> INT4 group 32): the logprob of every prompt token within
    MAX_LOGPROB_GAP of the float weights' (the dequantized Q4_1, i.e. the float folder)."""
    ids, reference = float_folder_run
    llm, outs = generate(str(_gguf_path()), ids)
    assert isinstance(llm.engine_core.worker.model.model.layers[0].mlp.down_proj, Int4Linear)
    gaps = torch.tensor([
        abs(out.prompt_logprobs[p][seq[p]].logprob - ref.prompt_logprobs[p][seq[p]].logprob)
        for seq, out, ref in zip(ids, outs, reference) for p in range(1, len(seq))
    ])
    assert gaps.max() <= MAX_LOGPROB_GAP and gaps.mean() <= MEAN_LOGPROB_GAP, (gaps.max(), gaps.mean())
