"""`--quantization int8|int4`: the converted model stores only integers + scales, and
its outputs stay close to the float model's (tiny random Llama, then the real model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.loader import load_model
from engine.models.llama import Linear, LlamaForCausalLM
from engine.quantization.linears import Int4Linear, Int8Linear
from engine.quantization.rtn import int4_group_size
from kernels.ops import get_ops

CPU = torch.device("cpu")
BLOCK_SIZE = 16


def prefill_logits(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position of one sequence, one prefill over a paged KV cache."""
    n = input_ids.shape[0]
    num_blocks = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
    spec = KVCacheSpec.from_model(model.args, torch.float32, BLOCK_SIZE)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        logits_indices=torch.arange(n, dtype=torch.int64),
    )
    hidden = model(input_ids, torch.arange(n), allocate_kv_cache(spec, num_blocks, CPU), meta, get_ops("torch", CPU))
    return model.compute_logits(hidden).float()


def linear_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the decoder linears' stored tensors, and of everything else: each storage once,
    whole (a C++ kernel's packed weight is a view of part of its storage)."""
    out = {"linears": 0, "rest": 0}
    seen: set[int] = set()
    for name, module in model.named_modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        key = "linears" if name.startswith("model.layers.") and isinstance(module, (Linear, Int8Linear, Int4Linear)) else "rest"
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen and not name.endswith("rope"):
                seen.add(storage.data_ptr())
                out[key] += storage.nbytes()
    return out


def test_config_accepts_methods_and_rejects_unknown() -> None:
    assert ModelConfig(quantization="int8").quantization == "int8"
    assert ModelConfig(quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="awq-but-misspelled")


def test_int4_group_size_falls_back_when_128_does_not_divide() -> None:
    assert int4_group_size(1536) == 128
    assert int4_group_size(576) == 64
    assert int4_group_size(96) == 32
    with pytest.raises(ValueError):
        int4_group_size(100)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tiny_model_converts_and_stays_close(tiny_model_path: Path, method: str) -> None:
    ref = load_model(tiny_model_path, torch.float32, CPU, 128)
    model = load_model(tiny_model_path, torch.float32, CPU, 128, quantization=method)
    kinds = {type(m) for n, m in model.named_modules() if n.startswith("model.layers.")}
    assert Linear not in kinds and (Int8Linear if method == "int8" else Int4Linear) in kinds
    # The tied head gets its own int8 copy; the embedding table stays float for the lookup.
    assert isinstance(model.lm_head, Int8Linear) and model.model.embed_tokens.weight.dtype == torch.float32

    # Bytes: hidden 64, intermediate 128, 2 layers: qkv 128x64, o 64x64, gate_up 256x64, down 64x128.
    shapes = [(128, 64), (64, 64), (256, 64), (64, 128)]
    weights = 2 * sum(n * k for n, k in shapes)
    fp32 = linear_weight_bytes(ref)
    quant = linear_weight_bytes(model)
    assert fp32["linears"] == 4 * weights
    vocab, hidden = 49152, 64
    assert quant["rest"] == fp32["rest"] + vocab * hidden + 2 * vocab  # + int8 head, bf16 row scales
    if method == "int8":  # 1 byte per weight + one bf16 scale per output row
        assert quant["linears"] == weights + 2 * 2 * sum(n for n, _ in shapes)
    else:  # half a byte per weight + (scale, offset) in bf16 per group of 64 (K = 64, 128 -> 64, 128)
        groups = 2 * sum(n * (k // int4_group_size(k)) for n, k in shapes)
        int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
        marker = 64 if int4[0].kernel else 0  # the C++ int4 kernel's packed weight ends in a 64-byte marker
        assert quant["linears"] == weights // 2 + 4 * groups + marker * len(int4)

    ids = torch.randint(0, 49152, (37,), generator=torch.Generator().manual_seed(0))
    expected = prefill_logits(ref, ids)
    got = prefill_logits(model, ids)
    rel = (got - expected).norm() / expected.norm()
    assert rel < (0.02 if method == "int8" else 0.15), rel.item()


def test_engine_generates_with_quantization(tiny_model_path: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for method in ("int8", "int4"):
        out = LLM(model=str(tiny_model_path), quantization=method, kv_cache_memory=0.05).generate(["Hello"], params)
        assert len(out[0].outputs[0].token_ids) == 8


PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Once upon a time, there was a little girl named Emma who loved to play in the garden with her",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes it boils at",
]


@pytest.mark.slow
def test_default_model_quality(default_model_path: Path) -> None:
    """Teacher-forced over a few prompts, against the float model.

    INT8 (measured: argmax agreement 1.00, last-position cosine >= 0.995): the bf16
    activations + per-channel int8 weights move logits by well under 1%, which flips only
    near-ties. INT4 RTN at group 128/64 is much coarser on this 135M model (measured: mean
    cosine 0.855 over all positions, argmax agreement 0.69; symmetric or clip-searched
    variants measured no better) — the bounds below guard that level, and AWQ/GPTQ are
    the methods meant to close the gap. A wrong layout or scale gives cosine ~0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_path))
    models = {m: load_model(default_model_path, torch.float32, CPU, 256, quantization=m) for m in (None, "int8", "int4")}
    agree: dict[str, list[float]] = {"int8": [], "int4": []}
    cosine: dict[str, list[float]] = {"int8": [], "int4": []}
    for prompt in PROMPTS:
        ids = torch.tensor(tok(prompt)["input_ids"])
        logits = {m: prefill_logits(model, ids) for m, model in models.items()}
        for m in ("int8", "int4"):
            agree[m].append((logits[m].argmax(-1) == logits[None].argmax(-1)).float().mean().item())
            cosine[m].append(torch.nn.functional.cosine_similarity(logits[m], logits[None], dim=-1).mean().item())
        last = torch.nn.functional.cosine_similarity(logits["int8"][-1], logits[None][-1], dim=0)
        assert last > 0.99, (prompt, last.item())
    mean = {m: sum(v) / len(v) for m, v in cosine.items()}
    assert sum(agree["int8"]) / len(PROMPTS) >= 0.95, agree
    assert mean["int8"] > 0.995, mean
    assert sum(agree["int4"]) / len(PROMPTS) >= 0.6, agree
    assert mean["int4"] > 0.8, mean
