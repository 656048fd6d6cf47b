"""AutoAWQ / AutoGPTQ / Pagoda INT8 checkpoints load as they are (engine/loader.py, checkpoint.py).

The AutoAWQ and AutoGPTQ folders here are written by this file's own packer, bit loops
transcribed from how AutoAWQ's `WQLinear_GEMM.from_linear` and AutoGPTQ's
`QuantLinear.pack` lay the integers out (numpy uint32, AWQ's interleaved order, GPTQ's
stored `zero - 1`), not by engine code. Every loaded layer must stand for exactly the
weight the packer's integers and scales say, and the loaded model must serve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.loader import load_model
from engine.models.llama import Linear
from engine.quantization.calibration import LayerwiseCalibration
from engine.quantization.checkpoint import AWQ_ORDER, pack_nibbles, parse_quantization_config, unpack_nibbles
from engine.quantization.linears import Int4Linear, PermutedInputLinear
from engine.quantization.weights import replace_linears

CPU = torch.device("cpu")
GROUP = 32
UNFUSED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
         "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
         "mlp.up_proj": ("mlp.gate_up_proj", 1)}


# ---- the test's packer ---------------------------------------------------------------------------
def awq_pack_columns(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ: [rows, cols] -> [rows, cols / 8]; nibble i of column c holds col 8c + order[i]."""
    out = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(out.shape[1]):
        for i in range(8):
            out[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
    return out


def gptq_pack_rows(intweight: np.ndarray) -> np.ndarray:
    """AutoGPTQ qweight: [K, N] -> [K / 8, N]; nibble j of row i holds input row 8i + j."""
    out = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    for row in range(out.shape[0]):
        for j in range(8):
            out[row] |= intweight[row * 8 + j].astype(np.uint32) << (4 * j)
    return out


def gptq_pack_zero_columns(zeros: np.ndarray) -> np.ndarray:
    """AutoGPTQ qzeros: (zeros - 1) [G, N] -> [G, N / 8], sequential along N."""
    stored = (zeros - 1).astype(np.uint32)
    out = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    for col in range(out.shape[1]):
        for j in range(8):
            out[:, col] |= stored[:, col * 8 + j] << (4 * j)
    return out


def as_int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int32).copy())


def random_module(n: int, k: int, layout: str, gen: torch.Generator, g_idx: torch.Tensor | None):
    """Random integers and fp16 scales of one module -> (checkpoint tensors, expected float weight [N, K])."""
    q = torch.randint(0, 16, (n, k), generator=gen).numpy()
    low = 0 if layout == "awq" else 1  # GPTQ v1 cannot store a zero point of 0
    zeros = torch.randint(low, 16, (k // GROUP, n), generator=gen).numpy()
    scales = (torch.rand(k // GROUP, n, generator=gen) * 0.02 + 0.001).half()
    groups = np.arange(k) // GROUP if g_idx is None else g_idx.numpy()
    expected = (torch.from_numpy(q - zeros[groups].T).float() * scales.float()[groups].T)  # [N, K]
    if layout == "awq":
        tensors = {"qweight": as_int32(awq_pack_columns(q.T)), "qzeros": as_int32(awq_pack_columns(zeros)), "scales": scales}
    else:
        tensors = {"qweight": as_int32(gptq_pack_rows(q.T)), "qzeros": as_int32(gptq_pack_zero_columns(zeros)),
                   "scales": scales, "g_idx": torch.from_numpy(groups.astype(np.int32))}
    return tensors, expected


def write_packed_checkpoint(src: Path, dst: Path, layout: str, act_order: bool) -> dict[str, torch.Tensor]:
    """The float tiny model with every decoder linear replaced by packed random integers;
    returns {our fused module name: expected float weight}."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    expected: dict[str, list[torch.Tensor]] = {}
    for i in range(config["num_hidden_layers"]):
        g_idx = {}  # act-order: one column order per input (q/k/v share theirs, gate/up theirs)
        for name in UNFUSED:
            prefix = f"model.layers.{i}.{name}"
            n, k = tensors.pop(f"{prefix}.weight").shape
            fused, _ = FUSED.get(name, (name, 0))
            if act_order and fused not in g_idx:
                g_idx[fused] = torch.randperm(k, generator=gen) // GROUP
            packed, weight = random_module(n, k, layout, gen, g_idx.get(fused))
            tensors.update({f"{prefix}.{key}": value for key, value in packed.items()})
            expected.setdefault(f"model.layers.{i}.{fused}", []).append(weight)
    save_file(tensors, str(dst / "model.safetensors"))
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if layout == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False}
    )
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, dst / f.name)
    return {name: torch.cat(parts) for name, parts in expected.items()}


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position of one sequence (one prefill)."""
    calib = LayerwiseCalibration(model, ids[None])
    for i in range(model.args.num_hidden_layers):
        calib.advance(i)
    return model.compute_logits(model.model.norm(calib.hidden)).float()


# ---- tests -----------------------------------------------------------------------------------------
def test_nibble_orders_by_hand() -> None:
    row = torch.arange(8, dtype=torch.int32)[None]  # values 0..7 in columns 0..7
    assert pack_nibbles(row, AWQ_ORDER).item() == 0x75316420  # nibbles hold columns 0,2,4,6,1,3,5,7
    assert pack_nibbles(row, tuple(range(8))).item() == 0x76543210
    high = torch.full((1, 8), 15, dtype=torch.int32)
    assert pack_nibbles(high, AWQ_ORDER).item() == -1  # 0xFFFFFFFF as int32
    values = torch.randint(0, 16, (3, 24), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    assert torch.equal(unpack_nibbles(pack_nibbles(values, AWQ_ORDER), AWQ_ORDER), values)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_nibbles(row + 9, AWQ_ORDER)


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "only 4-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "only AWQ version 'gemm'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ({"quant_method": "bitsandbytes"}, "not supported"),
        ({"quant_method": "pagoda", "format": "int3"}, "format must be one of"),
    ],
    ids=["gptq-3bit", "awq-gemv", "gptq-marlin", "bnb", "pagoda-unknown"],
)
def test_unsupported_quantization_configs_are_refused(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(cfg)


def test_gptq_zero_offset_follows_checkpoint_format() -> None:
    assert parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128}).zero_offset == 1
    v2 = {"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"}
    assert parse_quantization_config(v2).zero_offset == 0 and parse_quantization_config(v2).group_size is None


@pytest.mark.parametrize(
    "layout, act_order", [("awq", False), ("gptq", False), ("gptq", True)], ids=["awq", "gptq", "gptq-act-order"]
)
def test_packed_checkpoint_loads_exactly_and_serves(tiny_model_path: Path, tmp_path: Path, layout: str, act_order: bool) -> None:
    from engine.loader import _quantized_modules, checkpoint_quantization, read_quantized_linears

    ckpt = tmp_path / layout
    expected = write_packed_checkpoint(tiny_model_path, ckpt, layout, act_order)
    assert len(expected) == 8
    files = [ckpt / "model.safetensors"]
    qlinears = read_quantized_linears(files, _quantized_modules(files), checkpoint_quantization(ckpt))
    for name, weight in expected.items():
        assert torch.equal(qlinears[name].dequantize(), weight), name

    model = load_model(ckpt, torch.float32, CPU, 128)
    kinds = {type(m) for n, m in model.named_modules() if n.startswith("model.layers.")}
    assert Linear not in kinds and Int4Linear in kinds
    assert (PermutedInputLinear in kinds) is act_order
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    for name, weight in expected.items():
        if weight.shape[1] == 64:  # the runtime kernel (bf16 activations) against x @ W^T
            got = model.get_submodule(name)(x)
            torch.testing.assert_close(got, x @ weight.t(), rtol=2e-2, atol=2e-2)

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = LLM(model=str(ckpt), kv_cache_memory=0.05).generate(["The capital of France is"], params)
    assert len(out[0].outputs[0].token_ids) == 6

    # The same integers converted in memory give the same model: identical logits, and
    # the engine's greedy tokens are their argmax (up to near-ties between decode and prefill numerics).
    in_memory = replace_linears(load_model(tiny_model_path, torch.float32, CPU, 128), qlinears)
    ids = torch.tensor(out[0].prompt_token_ids + out[0].outputs[0].token_ids)
    expected_logits = prefill_logits(in_memory, ids)
    assert torch.equal(prefill_logits(model, ids), expected_logits)
    num_prompt = len(out[0].prompt_token_ids)
    for pos, token in enumerate(out[0].outputs[0].token_ids):
        row = expected_logits[num_prompt - 1 + pos]
        assert row[token] >= row.max() - 1e-3, (pos, token, row.argmax().item())


def test_g_idx_with_unequal_groups_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "bad"
    write_packed_checkpoint(tiny_model_path, ckpt, "gptq", act_order=False)
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.g_idx"
    g_idx = tensors[name].clone()
    g_idx[0] = 1  # group 0 now has GROUP - 1 columns, group 1 has GROUP + 1
    tensors[name] = g_idx
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj: g_idx does not split the 64 input columns into groups of 32"):
        load_model(ckpt, torch.float32, CPU, 128)
