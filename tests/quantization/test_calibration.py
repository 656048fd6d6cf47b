"""Built-in calibration text and activation capture (engine/quantization/calibration.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.loader import load_model
from engine.quantization.calibration import (
    LayerwiseCalibration,
    calibration_text,
    calibration_token_ids,
    capture_linear_inputs,
    linear_input_absmax,
)
from kernels.ops import get_ops

CPU = torch.device("cpu")


def test_splits_are_english_prose_and_disjoint() -> None:
    calib, heldout = calibration_text("calib"), calibration_text("heldout")
    calib_paragraphs, heldout_paragraphs = calib.split("\n\n"), heldout.split("\n\n")
    assert len(calib_paragraphs) > 500 and len(heldout_paragraphs) > 150
    assert not set(calib_paragraphs) & set(heldout_paragraphs)
    assert calibration_text("calib") == calib  # deterministic
    for p in heldout_paragraphs:
        assert p[-1] in ".!?" and "::=" not in p and not p.startswith(">>>"), p
    with pytest.raises(ValueError, match="split"):
        calibration_text("train")  # type: ignore[arg-type]


def test_token_ids_are_fixed_length_rows_of_the_text(tiny_model_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    ids = calibration_token_ids(tok, 3, 50, split="heldout")
    assert ids.shape == (3, 50) and ids.dtype == torch.int64
    assert tok.decode(ids[0]) == calibration_text("heldout")[: len(tok.decode(ids[0]))]
    assert torch.equal(ids, calibration_token_ids(tok, 3, 50, split="heldout"))
    assert not torch.equal(ids, calibration_token_ids(tok, 3, 50, split="calib"))
    with pytest.raises(ValueError, match="fewer than"):
        calibration_token_ids(tok, 10_000, 512)


def test_layerwise_run_equals_the_model_forward(tiny_model_path: Path) -> None:
    model = load_model(tiny_model_path, torch.float32, CPU, 128)
    seqs = torch.randint(0, 49152, (3, 37), generator=torch.Generator().manual_seed(0))
    calib = LayerwiseCalibration(model, seqs)
    for i in range(model.args.num_hidden_layers):
        calib.advance(i)
    spec = KVCacheSpec.from_model(model.args, torch.float32, 16)
    meta = replace(calib.meta, logits_indices=torch.arange(seqs.numel()))
    expected = model(seqs.flatten(), calib.positions, allocate_kv_cache(spec, 9, CPU), meta, get_ops("torch", CPU))
    torch.testing.assert_close(model.model.norm(calib.hidden), expected, rtol=1e-5, atol=1e-5)


def test_captured_inputs_are_what_the_linears_see(tiny_model_path: Path) -> None:
    model = load_model(tiny_model_path, torch.float32, CPU, 128)
    seqs = torch.randint(0, 49152, (2, 20), generator=torch.Generator().manual_seed(1))
    names = ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"]
    got = capture_linear_inputs(model, seqs, names)
    layer0 = model.model.layers[0]
    torch.testing.assert_close(got[names[0]], layer0.input_layernorm(model.model.embed_tokens(seqs.flatten())))
    assert got[names[1]].shape == (40, 128)
    absmax = linear_input_absmax(model, seqs, names)
    assert torch.equal(absmax[names[1]], got[names[1]].abs().amax(0))
    with pytest.raises(ValueError, match="not a module inside a decoder layer"):
        capture_linear_inputs(model, seqs, ["lm_head"])
