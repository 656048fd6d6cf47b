"""GGUF tensors -> the Hugging Face names and layouts Pagoda's models load.

Names: llama.cpp's (`blk.3.attn_q.weight`) are mapped back through the `gguf` package's own
table (`get_tensor_name_map`, the one its converter wrote them with), queried with the
Hugging Face module names a decoder layer can have.

Layouts llama.cpp's converter changed, undone here:
- Llama (and Mistral, which llama.cpp files as `llama`): q and k rows are permuted per head
  from the halves order (rotate_half) to interleaved pairs; the inverse permutation of rows
  is applied to the float weight, or to the rows of quant blocks before decoding (blocks run
  along a row, so a row permutation moves whole blocks).
- Gemma 3: RMSNorm weights are stored as 1 + w; Hugging Face's (1 + w) norm wants w.

The embedding table is float whatever its type (a lookup, not a GEMM), and a tied LM head
shares it: the head computes with exactly the file's values at no extra memory
(`--quantization int8|int4` makes it INT8, as for any model).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

from engine.gguf.blocks import FLOAT_TYPES, KEPT_TYPES, decode, to_float
from engine.gguf.reader import GGUFFile
from engine.quantization.weights import QuantizedLinear


@dataclass(frozen=True, slots=True)
class Architecture:
    model_type: str  # the Hugging Face model_type its config.json gets
    permute_qk: bool = False  # llama.cpp permuted q/k rows (Llama-family files)
    norm_offset: float = 0.0  # subtracted from every RMSNorm weight (Gemma stores 1 + w)


ARCHITECTURES = {
    "llama": Architecture("llama", permute_qk=True),
    "qwen2": Architecture("qwen2"),
    "qwen3": Architecture("qwen3"),
    "gemma3": Architecture("gemma3_text", norm_offset=1.0),
}
"""GGUF `general.architecture` values whose tensors this package maps."""

_LAYER_MODULES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
    "self_attn.q_norm", "self_attn.k_norm",
)
_LINEARS = ("_proj", "lm_head")  # module names ending so are linear layers


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[name]


def hf_names(arch_name: str, num_layers: int) -> dict[str, str]:
    """{GGUF tensor name: Hugging Face parameter name} for a model of `num_layers` layers."""
    arch_id = next(key for key, value in MODEL_ARCH_NAMES.items() if value == arch_name)
    table = get_tensor_name_map(arch_id, num_layers)
    modules = ["model.embed_tokens", "model.norm", "lm_head"]
    modules += [f"model.layers.{i}.{m}" for i in range(num_layers) for m in _LAYER_MODULES]
    out = {}
    for module in modules:
        gguf_name = table.get_name(module)
        if gguf_name is not None:
            out[f"{gguf_name}.weight"] = f"{module}.weight"
            out[f"{gguf_name}.bias"] = f"{module}.bias"
    return out


def qk_row_order(rows: int, num_heads: int) -> torch.Tensor:
    """Row i of the Hugging Face q (or k) weight is row order[i] of llama.cpp's."""
    head_dim = rows // num_heads
    return torch.arange(rows).reshape(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(rows)


@dataclass(slots=True)
class GGUFWeights:
    floats: dict[str, torch.Tensor]  # Hugging Face parameter name -> float32 tensor
    quantized: dict[str, QuantizedLinear]  # Hugging Face linear module name -> the file's integers, as decoded
    types: dict[str, str]  # Hugging Face parameter name -> its GGUF type (F32, Q4_1, ...)
    keep_quantized: bool

    def dequantize(self, module: str) -> None:
        """Move a quantized linear to the float tensors."""
        self.floats[f"{module}.weight"] = self.quantized.pop(module).dequantize()

    def summary(self) -> str:
        """One line: which types were kept quantized, which dequantized."""
        kept = Counter(self.types[f"{m}.weight"] for m in self.quantized)
        floats = Counter(self.types[n] for n in self.floats if self.types[n] not in _FLOAT_NAMES)
        parts = [f"kept quantized: {_counts(kept, _KEPT_AS)}"] if kept else []
        if floats:
            why = ("no integer kernel for the type, not a linear layer, or in a fused q/k/v or gate/up "
                   "layer whose parts differ") if self.keep_quantized else "--load-format dequantize"
            parts.append(f"dequantized to float at load ({why}): {_counts(floats)}")
        return "; ".join(parts) or "float tensors only"


def read_weights(reader: GGUFFile, cfg, keep_quantized: bool) -> GGUFWeights:
    """Every tensor of the file under its Hugging Face name: Q4_0 / Q4_1 / Q8_0 linears kept
    as integers when `keep_quantized`, everything else float32. `cfg` is the model's HF config."""
    arch_name = str(reader.fields["general.architecture"].contents())
    arch = architecture(arch_name)
    names = hf_names(arch_name, cfg.num_hidden_layers)
    heads = {"self_attn.q_proj": cfg.num_attention_heads,
             "self_attn.k_proj": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads}
    weights = GGUFWeights({}, {}, {}, keep_quantized)
    for t in reader.tensors:
        if t.name not in names:
            if t.name == "rope_freqs.weight":  # Llama 3 RoPE divisors: the config's rope_scaling (folder.py)
                continue
            raise ValueError(f"unexpected tensor {t.name!r} in the GGUF file (architecture {arch_name!r})")
        name = names[t.name]
        module, _, _ = name.rpartition(".")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        qtype = GGMLQuantizationType(t.tensor_type)
        order = None  # q/k rows (weight and bias) of a permuting architecture
        for suffix, num_heads in heads.items():
            if arch.permute_qk and module.endswith(suffix):
                order = qk_row_order(shape[0], num_heads)
        weights.types[name] = qtype.name
        if keep_quantized and qtype in KEPT_TYPES and module.endswith(_LINEARS) and name.endswith(".weight"):
            data = t.data if order is None else t.data[order.numpy()]  # rows of blocks: permuted as bytes
            weights.quantized[module] = QuantizedLinear(decode(data, qtype, shape[0]))
            continue
        tensor = to_float(t.data, qtype, shape, t.name)
        if order is not None:
            tensor = tensor[order]
        if arch.norm_offset and module.endswith("norm"):
            tensor = tensor - arch.norm_offset
        weights.floats[name] = tensor
    return weights


_FLOAT_NAMES = {t.name for t in FLOAT_TYPES}
_KEPT_AS = {"Q4_0": "INT4 group 32", "Q4_1": "INT4 group 32", "Q8_0": "INT8, requantized per row"}


def _counts(counts: Counter[str], notes: dict[str, str] | None = None) -> str:
    """"210 Q4_1 (INT4 group 32), 9 Q6_K"."""
    return ", ".join(f"{n} {k}" + (f" ({notes[k]})" if notes and k in notes else "") for k, n in sorted(counts.items()))


def log(summary: str) -> None:
    print(f"[pagoda] GGUF tensors: {summary}", file=sys.stderr, flush=True)
