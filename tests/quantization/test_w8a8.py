"""W8A8: the runtime linear (engine/quantization/linears.py), SmoothQuant (w8a8.py), and the converted model.

The model tests use a tiny random Llama made here (transformers' init, head_dim 64: a shape
the Triton kernels take) with a word-level tokenizer over the built-in calibration text's
commonest words, so calibration sees real text statistics and nothing needs the bundled
model's packages (the GPU machine has neither them nor a network). Only the real model's
agreement test (slow tier) runs the bundled model.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_model_folder, prompts

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.loader import load_model
from engine.models.llama import Linear
from engine.quantization.affine import quantize_tensor
from engine.quantization.calibration import LayerwiseCalibration, calibration_token_ids, linear_input_absmax
from engine.quantization.linears import Int8Linear, W8A8Linear, w8a8_linear_module
from engine.quantization.rtn import quantize_weight
from engine.quantization.w8a8 import quantize_model_w8a8, smooth_model, smoothable_linears, smoothing_scales
from kernels.quant_linear import cpu_int_mm_available, w8a8_linear
from kernels.quant_reference import quantize_per_token_ref, w8a8_linear_ref

CPU = torch.device("cpu")
VOCAB = 512


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory) -> Path:
    """2 layers, hidden 64, 4 query heads on 2 KV heads of 64 dims, tied embeddings, the
    default init scale (0.02); tokenizer: '<unk>', '<s>', '</s>' and the 509 commonest words
    of the calibration text, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.quantization.calibration import calibration_text

    path = make_model_folder(tmp_path_factory.mktemp("tiny-llama-w8a8"), "llama", initializer_range=0.02)
    words = [w for w, _ in Counter(calibration_text("calib").split()).most_common(VOCAB - 3)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sharp_model_path(tmp_path_factory) -> Path:
    """tests/tiny_models.py's Llama (head_dim 64, weights at 10x the default scale): greedy
    tokens that change when attention or a GEMM is wrong (at 0.02 it repeats one token)."""
    return make_model_folder(tmp_path_factory.mktemp("tiny-llama-sharp"), "llama")


def all_logits(model, sequences: torch.Tensor) -> torch.Tensor:
    """Logits at every position of every sequence [S * L, vocab] (prefill, layer by layer)."""
    calib = LayerwiseCalibration(model, sequences)
    for i in range(model.args.num_hidden_layers):
        calib.advance(i)
    return model.compute_logits(model.model.norm(calib.hidden)).float()


def outlier_activations(tokens: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """LLM-like inputs: most channels ~N(0, 1), a few channels 50x larger on every token."""
    x = torch.randn(tokens, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:4]] *= 50.0
    return x


@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 576), (8, 33, 64), (130, 64, 1536)])
def test_w8a8_linear_equals_reference(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    module = w8a8_linear_module(quantize_weight(weight, "int8"), bias, CPU)
    qx, x_scale = quantize_per_token_ref(x)
    expected = w8a8_linear_ref(qx, x_scale, module.qweight, module.weight_scale, bias)
    # The CPU path (torch._int_mm when the probe passes) is exact in the integer part and
    # rescales in the reference's order: bit-equal.
    assert torch.equal(module(x), expected)
    # And it is what W8A8 should be: close to the float product.
    torch.testing.assert_close(module(x), F.linear(x, weight, bias), rtol=0, atol=0.02 * expected.abs().max().item())


def test_cpu_path_is_torch_int_mm_here() -> None:
    # The fast path was chosen by measurement (kernels/quant_linear.py); it must be live here.
    assert cpu_int_mm_available()


def test_smooth_divides_activations_at_run_time() -> None:
    gen = torch.Generator().manual_seed(1)
    x = outlier_activations(16, 64, gen)
    weight = torch.randn(32, 64, generator=gen) * 0.05
    s = smoothing_scales(x.abs().amax(0), weight, 0.5)
    folded = w8a8_linear_module(quantize_weight(weight * s, "int8"), None, CPU)
    runtime = w8a8_linear_module(quantize_weight(weight * s, "int8"), None, CPU, smooth=s)
    torch.testing.assert_close(runtime(x), folded(x / s), rtol=0, atol=0)


def test_rejects_asymmetric_or_grouped_weights() -> None:
    weight = torch.randn(8, 64)
    with pytest.raises(ValueError, match="symmetric"):
        w8a8_linear_module(quantize_tensor(weight, 8, "channel", symmetric=False), None, CPU)
    with pytest.raises(ValueError, match="per output channel"):
        w8a8_linear_module(quantize_tensor(weight, 8, 32, symmetric=True), None, CPU)
    with pytest.raises(ValueError, match="int8"):
        W8A8Linear(torch.zeros(8, 64), torch.ones(8), None)


def test_smoothing_scales_formula() -> None:
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    weight = torch.tensor([[1.0, -4.0, 2.0, 0.0], [-0.25, 1.0, 1.0, 0.0]])
    # s = max|X|^a / max|W|^(1-a): a = 0.5 -> sqrt(4 / 1), sqrt(1 / 4); channels with a zero max keep 1.
    assert smoothing_scales(act, weight, 0.5).tolist() == [2.0, 0.5, 1.0, 1.0]
    assert smoothing_scales(act, weight, 1.0).tolist() == [4.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="alpha"):
        smoothing_scales(act, weight, 1.5)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothing_reduces_w8a8_error_on_outlier_channels(alpha: float) -> None:
    gen = torch.Generator().manual_seed(2)
    x = outlier_activations(256, 512, gen)
    weight = torch.randn(256, 512, generator=gen) * 0.05
    exact = x @ weight.t()

    def w8a8_error(x_in: torch.Tensor, w: torch.Tensor) -> float:
        qt = quantize_weight(w, "int8")
        out = w8a8_linear(x_in, (qt.q - qt.zero).to(torch.int8), qt.scale.squeeze(1))
        return ((out - exact).norm() / exact.norm()).item()

    s = smoothing_scales(x.abs().amax(0), weight, alpha)
    plain, smoothed = w8a8_error(x, weight), w8a8_error(x / s, weight * s)
    # Measured: plain 4.0e-2 (the outliers set each token's step); smoothed 1.0e-2 (alpha 0.5), 1.9e-2 (0.8).
    assert smoothed < plain / 2, (plain, smoothed)


def test_smoothed_float_model_computes_the_same_function(tiny_model_path: Path) -> None:
    ref = load_model(tiny_model_path, torch.float32, CPU, 128)
    model = load_model(tiny_model_path, torch.float32, CPU, 128)
    seqs = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(3)
    stats = {}
    for name in smoothable_linears(model):  # synthetic statistics with outlier channels: large s
        k = model.get_submodule(name).weight.shape[1]
        stats[name] = outlier_activations(8, k, gen).abs().amax(0)
    smooth_model(model, stats, alpha=0.5)
    layer = model.model.layers[0]
    assert not torch.equal(layer.input_layernorm.weight, ref.model.layers[0].input_layernorm.weight)
    assert not torch.equal(layer.mlp.down_proj.weight, ref.model.layers[0].mlp.down_proj.weight)
    torch.testing.assert_close(all_logits(model, seqs), all_logits(ref, seqs), rtol=1e-4, atol=1e-4)


def test_smooth_model_rejects_unsmoothable_linears(tiny_model_path: Path) -> None:
    model = load_model(tiny_model_path, torch.float32, CPU, 128)
    with pytest.raises(ValueError, match="cannot smooth"):
        smooth_model(model, {"model.layers.0.self_attn.o_proj": torch.ones(64)})


def test_converted_model_holds_int8_and_stays_close(tiny_model_path: Path) -> None:
    ref = load_model(tiny_model_path, torch.float32, CPU, 128)
    model = load_model(tiny_model_path, torch.float32, CPU, 128, quantization="w8a8")
    decoder = [m for n, m in model.named_modules() if n.startswith("model.layers.") and isinstance(m, (Linear, W8A8Linear))]
    assert len(decoder) == 2 * 4 and all(isinstance(m, W8A8Linear) for m in decoder)
    assert all(m.qweight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32 for m in decoder)
    assert isinstance(model.lm_head, Int8Linear) and model.model.embed_tokens.weight.dtype == torch.float32
    seqs = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    expected, got = all_logits(ref, seqs), all_logits(model, seqs)
    assert ((got - expected).norm() / expected.norm()) < 0.03


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton W8A8 kernels run on CUDA tensors")
def test_cuda_w8a8_linear_runs_the_triton_kernels() -> None:
    from kernels import triton_w8a8

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 576, generator=gen).cuda().bfloat16()
    module = w8a8_linear_module(quantize_weight(torch.randn(96, 576, generator=gen) * 0.05, "int8"), None, x.device)
    qx, x_scale = triton_w8a8.quantize_per_token(x)
    expected = triton_w8a8.w8a8_linear(qx, x_scale, module.qweight, module.weight_scale, out_dtype=torch.bfloat16)
    assert torch.equal(module(x), expected)


def _greedy_tokens(path: Path, method: str, device: str, **engine_args) -> tuple[LLM, list[list[int]]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), quantization=method, lm_head_quantization="int8", device=device, dtype="float32",
              max_model_len=128, kv_cache_memory=0.05, **engine_args)
    return llm, [out.outputs[0].token_ids for out in llm.generate(prompts((1, 23, 61), seed=2), params)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["w8a8", "int4", "int8"])
def test_cuda_engine_with_triton_quantized_linears_equals_the_reference(
    sharp_model_path: Path, method: str, monkeypatch
) -> None:
    """The CUDA engine (Triton attention, CUDA graphs, the Triton W8A8 / W4A16 / W8A16 GEMMs
    and the INT8 head through W8A16) gives the greedy tokens of the same quantized model on
    the CPU with every reference op: the torch attention and the dequantizing (or float64,
    exact-integer W8A8) GEMMs in float32."""
    import engine.quantization.linears as linears
    import kernels.quant_linear as quant_linear

    llm, got = _greedy_tokens(sharp_model_path, method, "cuda")
    core = llm.engine_core
    assert core.ops.backend == "triton" and core.runner.decode_graphs is not None
    assert core.worker.fallbacks() == []
    # The CPU reference: no bf16-rounding CPU kernels, the references' float32 (W8A8: exact ints):
    # neither torch's int8/int4 kernels nor Pagoda's (the int4 layout, the int8 packed copy).
    import engine.models.llama as llama

    for module in (linears, quant_linear):
        monkeypatch.setattr(module, "cpu_int8_mm_available", lambda: False)
    monkeypatch.setattr(linears, "cpu_int4_mm_available", lambda: False)
    monkeypatch.setattr(linears, "gemv_enabled", lambda: False)
    monkeypatch.setattr(llama, "gemv_enabled", lambda: False)
    _, expected = _greedy_tokens(sharp_model_path, method, "cpu", kernel_backend="torch")
    assert got == expected
    assert len({t for tokens in expected for t in tokens}) > 6  # not one repeated token


def test_config_and_engine_accept_w8a8(tiny_model_path: Path) -> None:
    assert ModelConfig(quantization="w8a8").quantization == "w8a8"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = LLM(model=str(tiny_model_path), quantization="w8a8", kv_cache_memory=0.05).generate(["the"], params)
    assert len(out[0].outputs[0].token_ids) == 8


def test_quantize_model_w8a8_calibrates_on_builtin_text(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    ref = load_model(tiny_model_path, torch.float32, CPU, 128)
    model = quantize_model_w8a8(load_model(tiny_model_path, torch.float32, CPU, 128), tok, num_samples=2, seq_len=32)
    assert isinstance(model.model.layers[1].mlp.down_proj, W8A8Linear)
    # The norms carry the smoothing (folded), so nothing divides at run time.
    assert model.model.layers[0].self_attn.qkv_proj.smooth is None
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, ref.model.layers[0].input_layernorm.weight)
    seqs = calibration_token_ids(tok, 2, 24, split="heldout")
    expected, got = all_logits(ref, seqs), all_logits(model, seqs)
    assert ((got - expected).norm() / expected.norm()) < 0.03


@pytest.mark.slow
def test_default_model_next_token_agreement(default_model_path: Path) -> None:
    """Teacher-forced greedy next token of W8A8 vs float over held-out English text.

    Measured (4 x 64 held-out tokens): RTN W8A8 (`--quantization w8a8`) agrees on 0.89 of
    positions (mean NLL 3.573 vs float 3.539); SmoothQuant (alpha 0.5, 8 x 128 calibration
    tokens) on 0.95 (NLL 3.538); INT8 weight-only, for comparison, 0.96 (3.543). A wrong
    scale or layout agrees on ~0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_path))
    text = calibration_token_ids(tok, 4, 64, split="heldout")
    targets = text[:, 1:].reshape(-1)

    def agreement_and_nll(model) -> tuple[float, float]:
        logits = all_logits(model, text)
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        nll = F.cross_entropy(logits.view(4, 64, -1)[:, :-1].reshape(-1, logits.shape[-1]), targets).item()
        return agree, nll

    float_model = load_model(default_model_path, torch.float32, CPU, 512)
    reference = all_logits(float_model, text)
    rtn_agree, rtn_nll = agreement_and_nll(load_model(default_model_path, torch.float32, CPU, 512, quantization="w8a8"))
    smooth_agree, smooth_nll = agreement_and_nll(quantize_model_w8a8(float_model, tok, num_samples=8, seq_len=128))
    assert rtn_agree >= 0.85, rtn_agree
    assert smooth_agree >= 0.90, smooth_agree
    assert smooth_nll < rtn_nll, (smooth_nll, rtn_nll)
