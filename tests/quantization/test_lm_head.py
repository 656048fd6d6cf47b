"""The LM head under `--quantization` (`--lm-head-quantization`, engine/quantization/rtn.py):
INT8 weight-only or the compute dtype, `auto` per method and device."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model_folder

from engine import LLM
from engine.config import ModelConfig
from engine.loader import load_model
from engine.models.llama import Linear
from engine.quantization.linears import Int4Linear, Int8Linear
from engine.quantization.rtn import lm_head_int8

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("tiny-llama-head"), "llama")


@pytest.mark.parametrize(("method", "setting", "device", "int8"), [
    ("int4", "auto", CUDA, False),  # as AutoAWQ / AutoGPTQ keep it
    ("int4", "auto", CPU, True),  # torch's int8 CPU kernel is the faster head (docs/BENCHMARKS.md)
    ("int8", "auto", CUDA, True),
    ("w8a8", "auto", CUDA, True),
    ("int8", "auto", CPU, True),
    ("int4", "int8", CUDA, True),
    ("int4", "none", CPU, False),
    ("int8", "none", CUDA, False),
])
def test_auto_decides_per_method_and_device(method, setting, device, int8) -> None:
    assert lm_head_int8(method, setting, device) is int8


def test_config_refuses_unknown_values_and_int8_without_quantization() -> None:
    assert ModelConfig(quantization="int4", lm_head_quantization="int8").lm_head_quantization == "int8"
    with pytest.raises(ValueError, match="lm_head_quantization must be one of"):
        ModelConfig(quantization="int4", lm_head_quantization="int4")
    with pytest.raises(ValueError, match="applies with --quantization"):
        ModelConfig(lm_head_quantization="int8")


@pytest.mark.parametrize("setting", ["none", "int8"])
def test_int4_model_head_follows_the_setting(model_path, setting) -> None:
    ref = load_model(model_path, torch.float32, CPU, 64)
    model = load_model(model_path, torch.float32, CPU, 64, quantization="int4", lm_head_quantization=setting)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    hidden = torch.randn(5, model.args.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = ref.compute_logits(hidden)
    got = model.compute_logits(hidden)
    if setting == "none":
        # The compute dtype: the float model's own head, bit for bit.
        assert type(model.lm_head) is Linear
        assert torch.equal(got, expected)
    else:
        assert isinstance(model.lm_head, Int8Linear)
        assert not torch.equal(got, expected)
        torch.testing.assert_close(got, expected, rtol=0, atol=0.02 * expected.abs().max().item())


def test_engine_reports_the_head(model_path, capfd) -> None:
    llm = LLM(model=str(model_path), dtype="float32", quantization="int4", lm_head_quantization="none",
              max_model_len=64, num_gpu_blocks_override=8)
    assert llm.engine_core.facts()["lm_head"] == "float32"
    assert "[pagoda] lm_head: float32\n" in capfd.readouterr().err
    llm = LLM(model=str(model_path), dtype="float32", quantization="int8", max_model_len=64, num_gpu_blocks_override=8)
    assert llm.engine_core.facts()["lm_head"] == "int8 weight-only, per output channel (W8A16)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA default (a bf16 head under int4) needs CUDA")
def test_cuda_int4_keeps_a_bf16_head_and_int8_runs_the_w8a16_kernel(model_path) -> None:
    from kernels import triton_w8a16

    model = load_model(model_path, torch.bfloat16, CUDA, 64, quantization="int4")
    assert type(model.lm_head) is Linear and model.lm_head.weight.dtype == torch.bfloat16
    model = load_model(model_path, torch.bfloat16, CUDA, 64, quantization="int4", lm_head_quantization="int8")
    head = model.lm_head
    x = torch.randn(3, model.args.hidden_size, device=CUDA, dtype=torch.bfloat16)
    assert torch.equal(head(x), triton_w8a16.w8a16_linear(x, head.qweight, head.scales, head.bias))
