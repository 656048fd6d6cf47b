"""The GPU engine benchmark's pieces that do not need a GPU, on a tiny random model on CPU.

`python -m loadtest.bench_engine_gpu` itself needs CUDA (loadtest/gpu_suite.sh runs it on
an H200); here: the Hugging Face copy holds the same weights (same greedy tokens), the
batch runs count tokens and decode steps right, the bandwidth bound counts the bytes a
decode step reads, and the whole import chain works without the server's packages (the
GPU image has no fastapi, uvicorn or pydantic).
"""

from __future__ import annotations

import subprocess
import sys

from unittest import mock

import pytest
import torch
from transformers import LlamaConfig

from engine import LLM, SamplingParams
from engine.dummy_model import write_dummy_model_folder
from loadtest.bench_engine_gpu import build_hf_copy, decode_weight_bytes, hf_generate, random_prompts, run_batch

VOCAB_SIZE = 512


def _config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def _llm(tmp_path, tied: bool) -> LLM:
    path = write_dummy_model_folder(tmp_path / f"dummy-{tied}", _config(tied))
    # The bench runs on the GPU, where linears keep their dense weights. On CPU the runtime
    # packs them for oneDNN and drops the dense copies, which the HF copy and the byte
    # count read: run this CPU stand-in unpacked.
    with mock.patch("engine.worker.prepack_linears", lambda model, batch_invariant=False: (0, 0)):
        return _unpacked_llm(path)


def _unpacked_llm(path) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", load_format="dummy", block_size=4,
               num_gpu_blocks_override=64)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_copy_generates_the_engines_greedy_tokens(tmp_path, tied):
    llm = _llm(tmp_path, tied)
    prompts = random_prompts(3, 9, VOCAB_SIZE, seed=0)
    hf = build_hf_copy(llm.engine_core.model, _config(tied))
    _, hf_tokens = hf_generate(hf, prompts, 6)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    assert len({tuple(t) for t in hf_tokens}) > 1


def test_run_batch_counts_tokens_and_pure_decode_steps(tmp_path):
    core = _llm(tmp_path, tied=False).engine_core
    run = run_batch(core, random_prompts(3, 8, VOCAB_SIZE, seed=1), 5, "t")
    assert run.generated == 15
    # One step prefills all three prompts and samples their first tokens; 4 decode steps follow.
    assert run.decode_tokens == 12 and len(run.decode_step_ms) == 4
    assert core.block_manager.num_free_blocks == core.num_blocks


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_decode_weight_bytes_skip_only_what_a_step_does_not_read(tmp_path, tied):
    model = _llm(tmp_path, tied).engine_core.model
    params = dict(model.named_parameters())
    everything = sum(p.nbytes for p in params.values())
    embedding = params["model.embed_tokens.weight"].nbytes
    # Untied: the table is only looked up (one row a step). Tied: the LM head reads all of it.
    assert decode_weight_bytes(model) == (everything if tied else everything - embedding)


def test_bench_imports_without_the_server_packages():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('fastapi', 'uvicorn', 'pydantic', 'starlette'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import loadtest.bench_engine_gpu, loadtest.bench_kernels, loadtest.bench_offline\n"
        "import engine.engine_core, engine.llm, engine.cuda_graphs, engine.memory\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed where CUDA is absent")
def test_bench_without_cuda_says_so_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "loadtest.bench_engine_gpu"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    assert "CUDA is required" in out.stdout
