"""kernels/linear.py: the oneDNN-packed CPU linear and the sliced-GEMV fallback equal F.linear,
and the serving runtime (not calibration) packs the model's float linears."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams
from kernels.linear import linear, pack_weight

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 32, 65])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(dtype, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=g).to(dtype)
    bias = torch.randn(200, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(dtype)
    packed = pack_weight(weight)
    assert packed is not None, "oneDNN packing is available on this CPU build"
    got = linear(x, weight, bias, packed)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (rows, 200)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_sliced_gemv_fallback_equals_f_linear():
    g = torch.Generator().manual_seed(1)
    weight, x, bias = torch.randn(64, 48, generator=g), torch.randn(2, 48, generator=g), torch.randn(64, generator=g)
    assert torch.allclose(linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_pack_weight_refuses_what_onednn_does_not_take():
    assert pack_weight(torch.randn(8, 4, dtype=torch.float64)) is None
    assert pack_weight(torch.randn(2, 8, 4)) is None


def _bf16_dummy_llm(tmp_path, batch_invariant: bool, **config):
    """A random-weight bf16 Llama (4 heads, 2 KV heads) through `LLM`, and its `Linear`s;
    skips where the CPU has no AVX512-BF16 (the C++ kernel's routes are what is tested)."""
    from transformers import LlamaConfig

    from engine.dummy_model import write_dummy_model_folder
    from engine.llm import LLM
    from engine.models.llama import Linear
    from kernels import cpu_kernels

    if not cpu_kernels.bf16_gemv_available():
        pytest.skip("the CPU has no AVX512-BF16")
    folder = write_dummy_model_folder(tmp_path / "m", LlamaConfig(
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **config))
    llm = LLM(model=str(folder), load_format="dummy", dtype="bfloat16", kv_cache_memory=0.01,
              batch_invariant=batch_invariant)
    return llm, [m for m in llm.engine_core.model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_bf16_runner_runs_every_row_count_through_the_cpp_kernel(tmp_path, batch_invariant):
    """bf16 with AVX512-BF16, with or without `--batch-invariant` (it picks attention's
    routes only): no oneDNN copy and no dense weight, each linear's packed weight through the
    C++ kernel at every row count, and a row's outputs are the same bits alone as among 1 to
    70 rows (K not a multiple of 32, N not of 32: the kernel's masked tails)."""
    _, linears = _bf16_dummy_llm(tmp_path, batch_invariant=batch_invariant, vocab_size=250, hidden_size=80,
                                 intermediate_size=150, num_hidden_layers=1, tie_word_embeddings=False)
    assert linears and all(m.packed is None and m.weight is None and m.kernel_weight is not None for m in linears)
    g = torch.Generator().manual_seed(0)
    for m in linears:
        x = torch.randn(70, m.kernel_weight.shape[1], generator=g).bfloat16()
        alone = torch.cat([m(x[i : i + 1]) for i in range(70)])
        for rows in (2, 4, 5, 8, 9, 11, 12, 13, 32, 64, 65, 70):
            assert torch.equal(m(x[:rows]), alone[:rows]), f"{rows} rows"


def test_runner_packs_the_models_linears(tmp_path):
    from transformers import LlamaConfig

    from engine.dummy_model import write_dummy_model_folder
    from engine.llm import LLM
    from engine.models.llama import Linear

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    folder = write_dummy_model_folder(tmp_path / "m", config)
    llm = LLM(model=str(folder), load_format="dummy", dtype="float32", kv_cache_memory=0.01)
    model = llm.engine_core.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # Each weight held once: packed layers drop the dense weight; the LM head, tied to the
    # embeddings, is packed too but the dense table stays for the embedding lookup.
    decoder = [m for m in linears if m is not model.lm_head]
    assert decoder and all(m.packed is not None and m.weight is None for m in decoder)
    assert model.lm_head.packed is not None and model.lm_head.weight is model.model.embed_tokens.weight
    assert llm.generate(["a b"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids


def test_bf16_runner_kernel_equals_onednn_and_fuses_the_mlp(tmp_path, monkeypatch):
    """bf16 on a CPU with AVX512-BF16 (the default): the linears hold only the C++ kernel's
    packed weight (a tied LM head keeps the embedding's dense table); each linear's outputs
    at 1, 8 and 40 rows equal oneDNN's packed GEMM of the same weight within bf16 rounding;
    every forward runs each MLP as one C++ call; greedy decoding gives the same tokens as
    with `PAGODA_CPU_GEMV=0` (oneDNN's copy for every linear)."""
    from kernels import cpu_kernels

    if not cpu_kernels.bf16_gemv_available():
        pytest.skip("the CPU has no AVX512-BF16")
    monkeypatch.setenv("PAGODA_CPU_GEMV", "0")
    onednn_llm, onednn_linears = _bf16_dummy_llm(tmp_path / "a", batch_invariant=False, vocab_size=256, hidden_size=64,
                                                 intermediate_size=160, num_hidden_layers=2, tie_word_embeddings=True)
    assert all(m.packed is not None and m.kernel_weight is None for m in onednn_linears)
    monkeypatch.setenv("PAGODA_CPU_GEMV", "1")
    llm, linears = _bf16_dummy_llm(tmp_path / "b", batch_invariant=False, vocab_size=256, hidden_size=64,
                                   intermediate_size=160, num_hidden_layers=2, tie_word_embeddings=True)
    model = llm.engine_core.model
    assert linears and all(m.packed is None and m.kernel_weight is not None for m in linears)
    assert all(m.weight is None for m in linears if m is not model.lm_head)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the lookup's dense table
    g = torch.Generator().manual_seed(0)
    for m, ref in zip(linears, onednn_linears):
        for rows in (1, 8, 40):
            x = torch.randn(rows, m.kernel_weight.shape[1], generator=g).bfloat16()
            got, want = m(x).double(), ref(x).double()
            assert torch.allclose(got, want, rtol=2**-7, atol=2e-3 * float(want.abs().max())), rows

    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    import engine.models.llama as llama

    fused_calls = []  # every forward runs each MLP as one C++ call (linear, SiLU-and-mul, linear)
    fused = llama.bf16_silu_mlp
    monkeypatch.setattr(llama, "bf16_silu_mlp", lambda *a: fused_calls.append(1) or fused(*a))
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d"], params)]
    assert len(fused_calls) >= 2 * 8  # 2 layers x the prefill and 7 decode steps (the fused decode call aside)
    without = [o.outputs[0].token_ids for o in onednn_llm.generate(["a b c", "d"], params)]
    assert with_kernel == without
