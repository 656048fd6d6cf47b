"""The model side's one owner (engine/worker.py): what the start-up log says it loaded,
and the server reading model facts through AsyncEngine, never EngineCore."""

import ast
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # attention_fallback reads the Triton kernels' shapes: their module must import for the
    # interpreter, as every other test module that imports it does here.
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM  # noqa: E402
from kernels.cpu_kernels import cpu_has_native_bf16  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("quantization, expected", [
    (None, "none"),
    ("int8", "int8 weight-only RTN, per output channel (W8A16)"),
    ("int4", "int4 weight-only RTN, asymmetric, groups of up to 128 inputs (W4A16)"),
], ids=["float", "int8", "int4"])
def test_start_up_log_names_the_quantization(tiny_model_path, capfd, quantization, expected):
    llm = LLM(model=str(tiny_model_path), max_model_len=128, num_gpu_blocks_override=16, quantization=quantization)
    log = capfd.readouterr().err
    assert f"[pagoda] quantization: {expected}\n" in log
    # --dtype auto: bf16 where the CPU computes it natively, float32 elsewhere, said at start.
    native = cpu_has_native_bf16()
    dtype, size = ("bfloat16", 2) if native else ("float32", 4)
    assert f"[pagoda] dtype: {dtype} (--dtype auto: this CPU {'computes bf16 natively' if native else 'has no native bf16'})" in log
    assert f"[pagoda] kv_cache: {128 * size} bytes/token (2 x 2 layers x 2 KV heads x 16 x {size} bytes), 16 blocks" in log
    assert llm.engine_core.facts()["quantization"] == expected


def test_server_never_reaches_into_the_engine_core():
    """`AsyncEngine` is the server's surface: no `.core` attribute access under server/."""
    offenders = []
    for path in sorted((REPO / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "core":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


def test_fallbacks_name_the_attention_shapes_the_kernels_do_not_take():
    """On CUDA the Triton backend sends such calls to the torch reference (kernels/ops.py);
    the start-up log says so once (Worker.fallbacks), instead of nothing per call."""
    from engine.models.args import ModelArgs
    from engine.worker import attention_fallback

    def args(head_dim, heads, kv_heads):
        return ModelArgs(vocab_size=8, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                         tie_word_embeddings=True)

    assert attention_fallback(args(64, 4, 2)) is None
    assert attention_fallback(args(128, 32, 4)) is None  # GQA 8
    assert "head_dim 16 / GQA ratio 2" in attention_fallback(args(16, 4, 2))
    assert "head_dim 128 / GQA ratio 16" in attention_fallback(args(128, 32, 2))


def test_fallbacks_name_quantized_linears_on_a_reference(tmp_path, monkeypatch):
    import engine.quantization.linears as linears
    from engine.loader import load_model
    from engine.worker import quantized_linear_fallbacks
    from tiny_models import make_model_folder

    path = make_model_folder(tmp_path, "llama")
    cpu = torch.device("cpu")
    model = load_model(path, torch.float32, cpu, 64, quantization="int4")
    assert quantized_linear_fallbacks(model, cpu) == []  # a CPU int4 kernel and the int8 one here
    assert quantized_linear_fallbacks(model, torch.device("cuda")) == []  # the Triton kernels
    monkeypatch.setattr(linears, "gemv_enabled", lambda: False)  # neither Pagoda's int4 kernel
    monkeypatch.setattr(linears, "cpu_int4_mm_available", lambda: False)  # nor torch's
    model = load_model(path, torch.float32, cpu, 64, quantization="int4")
    (line,) = quantized_linear_fallbacks(model, cpu)
    assert line.startswith("8 INT4 linear(s) dequantize their weight every call")


@pytest.mark.parametrize("invariant", [None, True, False], ids=["default", "batch-invariant", "no-batch-invariant"])
@pytest.mark.parametrize("gemv", ["1", "0"])
def test_start_up_log_says_how_bf16_linears_run(tiny_model_path, capfd, monkeypatch, gemv, invariant):
    """bf16: where the C++ bf16 kernel runs, every linear runs it at every row count, said in
    the linears fact, and batch invariance is on unless --no-batch-invariant (the default
    on the C++ kernels); where it does not (PAGODA_CPU_GEMV=0, or no AVX512-BF16) one
    fallback line says so, and the batch_invariant fact says the invariance is not
    guaranteed there."""
    from kernels.cpu_kernels import bf16_gemv_available

    monkeypatch.setenv("PAGODA_CPU_GEMV", gemv)
    LLM(model=str(tiny_model_path), max_model_len=128, num_gpu_blocks_override=16, dtype="bfloat16",
        **({} if invariant is None else {"batch_invariant": invariant}))
    log = capfd.readouterr().err
    runs = gemv == "1" and bf16_gemv_available()
    assert ("float linears on the C++ bf16 kernel (one arithmetic at every row count: batch-invariant)" in log) == runs
    assert ("[pagoda] linears: oneDNN-packed" in log) == (not runs)
    assert ("[pagoda] batch_invariant: on" in log) == (runs and invariant is not False)
    assert ("[pagoda] batch_invariant: off (--no-batch-invariant)" in log) == (invariant is False)
    assert ("[pagoda] batch_invariant: not guaranteed on this path" in log) == (not runs and invariant is not False)
    assert ("[pagoda] fallback: the C++ bf16 linear kernel is off" in log) == (not runs)


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "default"])
def test_batch_invariant_reaches_the_quantized_linears(tiny_model_path, invariant):
    """--batch-invariant sets every INT8 linear's flag, which picks the Triton GEMM's one
    config at every row count (tests/quantization/test_triton_gemm_invariance.py)."""
    from engine.quantization.linears import Int8Linear

    llm = LLM(model=str(tiny_model_path), max_model_len=128, num_gpu_blocks_override=16, quantization="int8",
              batch_invariant=invariant)
    flags = [m.invariant for m in llm.engine_core.worker.model.modules() if isinstance(m, Int8Linear)]
    assert flags and all(flag is invariant for flag in flags)
