"""`pagoda serve --model DIR` on a folder written by `pagoda quantize` (GPTQ, act-order).

The prompt logprobs the server returns (echo, max_tokens 0) must be those of the same
quantized folder loaded in-process, and it must generate.
"""

from __future__ import annotations

import httpx
import pytest
import torch


@pytest.fixture(scope="module")
def quantized_dir(tiny_model_path, tmp_path_factory):
    from engine.quantize import QuantizeRecipe, quantize_checkpoint

    out = tmp_path_factory.mktemp("quantized") / "tiny-gptq"
    quantize_checkpoint(tiny_model_path, out, QuantizeRecipe("gptq", 4, 32, calib_samples=4, seq_len=32, act_order=True))
    return out


@pytest.fixture(scope="module")
def quantized_server(start_server, quantized_dir):
    return start_server(["--model", str(quantized_dir), "--served-model-name", "tiny-gptq"])


def test_quantized_folder_serves_completions_and_prompt_logprobs(quantized_server, quantized_dir) -> None:
    from engine.loader import load_model
    from engine.quantization.calibration import LayerwiseCalibration

    prompt = "Quantized weights still answer the same questions."
    r = httpx.post(f"{quantized_server.url}/v1/completions", timeout=60, json={
        "model": "tiny-gptq", "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = httpx.post(f"{quantized_server.url}/tokenize", json={"model": "tiny-gptq", "prompt": prompt}, timeout=30).json()["tokens"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)

    model = load_model(quantized_dir, torch.float32, torch.device("cpu"), 128)
    calib = LayerwiseCalibration(model, torch.tensor([ids]))
    for i in range(model.args.num_hidden_layers):
        calib.advance(i)
    logprobs = torch.log_softmax(model.compute_logits(model.model.norm(calib.hidden)).float(), dim=-1)
    expected = [logprobs[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-3)

    r = httpx.post(f"{quantized_server.url}/v1/completions", timeout=60, json={
        "model": "tiny-gptq", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_start_up_log_and_info_metric_say_what_was_loaded(quantized_server, helpers) -> None:
    expected = "gptq checkpoint, 4-bit, groups of 32"
    assert f"[pagoda] quantization: {expected}" in quantized_server.log_tail(60000)
    r = httpx.get(f"{quantized_server.url}/metrics", timeout=10)
    info = [line for line in r.text.splitlines() if line.startswith("pagoda:engine_info{")]
    assert len(info) == 1 and f'quantization="{expected}"' in info[0] and info[0].endswith(" 1.0")
