"""`pagoda quantize` (engine/quantize.py): every method writes a folder that
loads into the same model as quantizing in memory, and serves."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.loader import load_model
from engine.quantization.calibration import LayerwiseCalibration
from engine.quantization.linears import Int4Linear, Int8Linear, PermutedInputLinear, W8A8Linear
from engine.quantization.w8a8 import quantize_model_w8a8
from engine.quantization.weights import replace_linears
from engine.quantize import (
    LayerProgress,
    QuantizeRecipe,
    checkpoint_group_size,
    layout_of,
    quantize_checkpoint,
    quantize_linears,
)

CPU = torch.device("cpu")
REPO_ROOT = Path(__file__).resolve().parents[2]
CALIB = {"calib_samples": 4, "seq_len": 32}


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    calib = LayerwiseCalibration(model, ids[None])
    for i in range(model.args.num_hidden_layers):
        calib.advance(i)
    return model.compute_logits(model.model.norm(calib.hidden)).float()


def test_method_bits_and_group_size_rules(tiny_model_path: Path) -> None:
    assert [layout_of(*mb) for mb in [("rtn", 4), ("rtn", 8), ("awq", 4), ("gptq", 4), ("w8a8", 8)]] == [
        "awq", "int8", "awq", "gptq", "w8a8"]
    with pytest.raises(ValueError, match="supports --bits 4"):
        layout_of("awq", 8)
    with pytest.raises(ValueError, match="method must be one of"):
        layout_of("smoothquant", 8)
    model = load_model(tiny_model_path, torch.float32, CPU, 64)  # K = 64 and 128
    assert checkpoint_group_size(model, 128) == 64
    assert checkpoint_group_size(model, 32) == 32


def test_recipe_is_checked_when_built() -> None:
    recipe = QuantizeRecipe("gptq", 4, act_order=True)
    assert (recipe.layout, recipe.group_size, recipe.calib_samples, recipe.seq_len) == ("gptq", 128, 64, 256)
    assert QuantizeRecipe("rtn", 8).layout == "int8"
    with pytest.raises(ValueError, match="^--act-order is a GPTQ option$"):
        QuantizeRecipe("awq", 4, act_order=True)
    with pytest.raises(ValueError, match="--method awq supports --bits 4, got 8"):
        QuantizeRecipe("awq", 8)
    with pytest.raises(ValueError, match="method must be one of"):
        QuantizeRecipe("smoothquant", 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.bits = 8  # type: ignore[misc]


CASES = {
    "rtn-int4": ("rtn", 4, False, "awq", Int4Linear),
    "rtn-int8": ("rtn", 8, False, "pagoda", Int8Linear),
    "awq": ("awq", 4, False, "awq", Int4Linear),
    "gptq-act-order": ("gptq", 4, True, "gptq", PermutedInputLinear),
    "w8a8": ("w8a8", 8, False, "pagoda", None),
}


@pytest.mark.parametrize(("method", "bits", "act_order", "quant_method", "kind"), list(CASES.values()), ids=list(CASES))
def test_quantized_folder_equals_in_memory_quantization(
    tiny_model_path: Path, tmp_path: Path, method: str, bits: int, act_order: bool, quant_method: str, kind
) -> None:
    out = tmp_path / method
    messages: list[str] = []
    recipe = QuantizeRecipe(method, bits, 128, act_order=act_order, **CALIB)
    config = quantize_checkpoint(tiny_model_path, out, recipe, log=messages.append)
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    assert written == config and written["quant_method"] == quant_method
    # What was used, and only that: RTN reads no calibration text.
    calibration = {"calib_samples": CALIB["calib_samples"], "seq_len": CALIB["seq_len"]}
    assert written["quantizer"] == {"tool": "pagoda", "method": method, **({} if method == "rtn" else calibration)}
    # AWQ and GPTQ report each layer, with an estimate of the time left.
    layer_lines = [m for m in messages if f"{method}: layer " in m]
    if method in ("awq", "gptq"):
        assert [m.split(" done")[0] for m in layer_lines] == [f"{method}: layer 1/2", f"{method}: layer 2/2"], messages
        assert all("left" in m for m in layer_lines), messages
    else:
        assert layer_lines == [], messages
    assert messages[-1].startswith("quantize: done in"), messages
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    if bits == 4:  # (at 8 bits the tiny model's extra int8 LM head outweighs its tiny linears)
        assert (out / "model.safetensors").stat().st_size < (tiny_model_path / "model.safetensors").stat().st_size

    loaded = load_model(out, torch.float32, CPU, 128)
    if method == "w8a8":
        kind = W8A8Linear
        tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
        in_memory = quantize_model_w8a8(load_model(tiny_model_path, torch.float32, CPU, 128), tok, **{
            "num_samples": CALIB["calib_samples"], "seq_len": CALIB["seq_len"]})
    else:
        model = load_model(tiny_model_path, torch.float32, CPU, 128)
        tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
        results = quantize_linears(model, tok, recipe)
        in_memory = replace_linears(model, results)
    # (act-order: only down_proj, K = 128, has two groups of 64 whose column order matters)
    assert kind in {type(m) for m in loaded.model.layers.modules()}
    assert isinstance(loaded.lm_head, Int8Linear) is (bits == 8)

    ids = torch.randint(0, 49152, (23,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(prefill_logits(loaded, ids), prefill_logits(in_memory, ids))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    generated = LLM(model=str(out), kv_cache_memory=0.05).generate(["Hello there"], params)
    assert len(generated[0].outputs[0].token_ids) == 5


def test_rtn_int8_folder_equals_load_time_int8(tiny_model_path: Path, tmp_path: Path) -> None:
    """`pagoda quantize --method rtn --bits 8` stores exactly what `--quantization int8` computes."""
    quantize_checkpoint(tiny_model_path, tmp_path / "q", QuantizeRecipe("rtn", 8))
    ids = torch.randint(0, 49152, (19,), generator=torch.Generator().manual_seed(1))
    stored = prefill_logits(load_model(tmp_path / "q", torch.float32, CPU, 128), ids)
    at_load = prefill_logits(load_model(tiny_model_path, torch.float32, CPU, 128, quantization="int8"), ids)
    assert torch.equal(stored, at_load)
    with pytest.raises(ValueError, match="already quantized"):
        load_model(tmp_path / "q", torch.float32, CPU, 128, quantization="int4")


def test_layer_progress_estimates_the_time_left() -> None:
    now = [100.0]
    lines: list[str] = []
    progress = LayerProgress("awq", lines.append, clock=lambda: now[0])
    for seconds in (6.0, 7.0, 5.0):  # 18 s for 3 of 30 layers: 6 s a layer, 27 left
        now[0] += seconds
    progress(3, 30)
    now[0] += 102.0
    progress(30, 30)
    assert lines == ["awq: layer 3/30 done, 18 s so far, about 2 min 42 s left",
                     "awq: layer 30/30 done, 2 min 00 s so far, about 0 s left"]


def test_written_folder_is_readable_by_every_user(tiny_model_path: Path, tmp_path: Path) -> None:
    """0644 files and 0755 folders whatever the umask, and whatever the source files' modes
    (a different, unprivileged user serves the folder)."""
    source = tmp_path / "private-source"
    shutil.copytree(tiny_model_path, source)
    for path in source.iterdir():
        path.chmod(0o600)
    out = tmp_path / "new" / "nested" / "q"
    old_umask = os.umask(0o077)
    try:
        quantize_checkpoint(source, out, QuantizeRecipe("rtn", 4), log=lambda _: None)
    finally:
        os.umask(old_umask)
    files = sorted(out.iterdir())
    assert {p.name for p in files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: "0o644" for p in files}
    for folder in (tmp_path / "new", tmp_path / "new" / "nested", out):
        assert oct(stat.S_IMODE(folder.stat().st_mode)) == "0o755", folder


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", "quantize", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_writes_a_folder_and_rejects_bad_combinations(tiny_model_path: Path, tmp_path: Path) -> None:
    ok = run_cli("--model", str(tiny_model_path), "--method", "gptq", "--bits", "4", "--group-size", "32",
                 "--calib-samples", "2", "--calib-seq-len", "16", "--out", str(tmp_path / "g"))
    assert ok.returncode == 0, ok.stderr
    assert "gptq: layer 1/2 done" in ok.stderr and "gptq: layer 2/2 done" in ok.stderr, ok.stderr
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["group_size"], cfg["sym"], cfg["desc_act"]) == ("gptq", 32, False, False)

    bad = run_cli("--model", str(tiny_model_path), "--method", "awq", "--bits", "8", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--method awq supports --bits 4" in bad.stderr, bad.stderr
    assert not (tmp_path / "x").exists()
