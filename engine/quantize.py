"""`pagoda quantize`: a float Hugging Face folder -> a quantized folder `pagoda serve --model` loads.

The driver of engine/quantization (which it sits outside of): load, calibrate, quantize,
pack, write; server/cli.py's `quantize` subcommand calls `quantize_checkpoint`.

    method  bits  algorithm                                   written layout (checkpoint.py)
    rtn     8     round to nearest, symmetric per channel     Pagoda "int8" (+ INT8 LM head)
    rtn     4     round to nearest, asymmetric per group      AutoAWQ (zero_point, gemm)
    awq     4     AWQ scales + clipping (quantization/awq.py) AutoAWQ
    gptq    4     GPTQ, asymmetric (--act-order: desc_act)    AutoGPTQ ("gptq" v1, sym false)
    w8a8    8     SmoothQuant (alpha 0.5) + int8 RTN          Pagoda "w8a8" (+ INT8 weight-only LM head)

One group size holds for the whole checkpoint (both layouts have one `group_size`): the
requested one if it divides every linear's input features, else the largest of 64/32
that does (SmolLM2's K = 576 and 1536 give 64 for a requested 128); the output folder's
config.json says which. In the INT4 layouts the LM head stays float, as AutoAWQ/AutoGPTQ
write it. Calibration (awq, gptq, w8a8): `calib_samples` x `seq_len` tokens of the built-in
text (quantization/calibration.py), recorded in `quantization_config["quantizer"]`; RTN
uses none and records none. The folder gets config.json (+ quantization_config), one
model.safetensors, and the tokenizer / generation files of the source.

What to do is one `QuantizeRecipe` (method, bits, group size, calibration size, act-order),
checked when it is built: `quantize_checkpoint(model_dir, out_dir, recipe)`.

Progress goes to `log` (stderr by default): each phase, and for AWQ and GPTQ each decoder
layer with the time so far and an estimate of the time left (minutes on CPU).

What it writes is readable by every user (`default_model.make_readable`: files 0644,
folders 0755, whatever the umask), so that a different, unprivileged serving user can load
it: the output folder, and the folders above it that it creates.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from engine.default_model import make_readable
from engine.loader import load_model
from engine.models.llama import STACKED_PARAMS, Linear, LlamaForCausalLM
from engine.quantization.awq import awq_quantize_model
from engine.quantization.calibration import DECODER_LINEARS, calibration_token_ids, linear_input_absmax
from engine.quantization.checkpoint import (
    CheckpointQuantization,
    pack,
    parse_quantization_config,
    quantization_config,
    split_shards,
)
from engine.quantization.gptq import gptq_quantize_model
from engine.quantization.rtn import int4_group_size, quantize_weight
from engine.quantization.w8a8 import smooth_model, smoothable_linears
from engine.quantization.weights import QuantizedLinear, quantize_groups

METHOD_BITS = {"rtn": (4, 8), "awq": (4,), "gptq": (4,), "w8a8": (8,)}
CALIBRATED = ("awq", "gptq", "w8a8")
_UNFUSED = {(fused, index): leaf for leaf, (fused, index) in STACKED_PARAMS.items()}


def layout_of(method: str, bits: int) -> str:
    if method not in METHOD_BITS:
        raise ValueError(f"method must be one of {sorted(METHOD_BITS)}, got {method!r}")
    if bits not in METHOD_BITS[method]:
        raise ValueError(f"--method {method} supports --bits {' or '.join(map(str, METHOD_BITS[method]))}, got {bits}")
    if method == "w8a8":
        return "w8a8"
    return "int8" if bits == 8 else ("gptq" if method == "gptq" else "awq")


@dataclass(frozen=True)
class QuantizeRecipe:
    """What `pagoda quantize` does to a float checkpoint; the flags of the subcommand, checked once.

    method         "rtn", "awq", "gptq" or "w8a8" (the table above). "awq" and "gptq" are the
                   algorithms of AutoAWQ and AutoGPTQ, and write their formats, which vLLM also loads.
    bits           weight bits: 4 or 8, as the method allows (AutoGPTQ `bits`, AutoAWQ `w_bit`).
    group_size     input columns that share one scale / zero point at 4 bits (AutoGPTQ and vLLM
                   `group_size`, AutoAWQ `q_group_size`); smaller is more accurate and larger on
                   disk. A request, not a promise: `checkpoint_group_size` falls back to 64 or 32
                   when it does not divide every linear's input features. Unused at 8 bits.
    calib_samples  calibration sequences of the built-in text that awq, gptq and w8a8 run through
                   the model (AutoAWQ `max_calib_samples`, the examples given to AutoGPTQ);
                   more gives better activation statistics and takes longer. RTN uses none.
    seq_len        tokens in each calibration sequence (AutoAWQ `max_calib_seq_len`; the CLI's
                   --calib-seq-len), also the maximum length the float model is loaded with.
    act_order      GPTQ only: quantize columns by decreasing Hessian diagonal, which is more
                   accurate (AutoGPTQ and vLLM `desc_act`; the CLI's --act-order).

    Building one raises ValueError (the message the CLI prints) for a method it does not know,
    bits the method does not support, or act_order with a method other than gptq.
    """

    method: str
    bits: int
    group_size: int = 128
    calib_samples: int = 64
    seq_len: int = 256
    act_order: bool = False

    def __post_init__(self) -> None:
        layout_of(self.method, self.bits)  # ValueError for a bad method or method / bits pair
        if self.act_order and self.method != "gptq":
            raise ValueError("--act-order is a GPTQ option")

    @property
    def layout(self) -> str:
        """The checkpoint layout written (`layout_of`): "int8", "awq", "gptq" or "w8a8"."""
        return layout_of(self.method, self.bits)


def decoder_linear_names(model: LlamaForCausalLM) -> list[str]:
    return [f"model.layers.{i}.{leaf}" for i in range(model.args.num_hidden_layers) for leaf in DECODER_LINEARS]


def checkpoint_group_size(model: LlamaForCausalLM, requested: int) -> int:
    """`requested` if it divides every decoder linear's K, else the largest of 64/32 that does."""
    ks = {model.get_submodule(name).weight.shape[1] for name in decoder_linear_names(model)}
    return int4_group_size(reduce(math.gcd, ks), requested)


def _int8(linear: Linear) -> QuantizedLinear:
    bias = None if linear.bias is None else linear.bias.data.clone()
    return QuantizedLinear(quantize_weight(linear.weight.data, "int8"), None, bias)


def log_stderr(message: str) -> None:
    print(f"[pagoda] {message}", file=sys.stderr, flush=True)


def format_seconds(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


class LayerProgress:
    """`on_layer(done, total)` for AWQ / GPTQ: one line per decoder layer with the time so far
    and the time left at the mean pace of the layers done (they are all the same size)."""

    def __init__(self, what: str, log: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.log, self.clock = what, log, clock
        self.start = clock()

    def __call__(self, done: int, total: int) -> None:
        elapsed = self.clock() - self.start
        left = elapsed / done * (total - done)
        self.log(f"{self.what}: layer {done}/{total} done, {format_seconds(elapsed)} so far,"
                 f" about {format_seconds(left)} left")


@torch.no_grad()
def quantize_linears(
    model: LlamaForCausalLM,
    tokenizer,
    recipe: QuantizeRecipe,
    log: Callable[[str], None] = log_stderr,
) -> dict[str, QuantizedLinear]:
    """{module name: QuantizedLinear} of every decoder linear (and, at 8 bits, the LM head).
    The float model is modified in place (folded scales; fake-quantized weights)."""
    method, bits, layout = recipe.method, recipe.bits, recipe.layout
    calib_samples, seq_len = recipe.calib_samples, recipe.seq_len
    names = decoder_linear_names(model)
    if method in CALIBRATED:
        sequences = calibration_token_ids(tokenizer, calib_samples, seq_len)
        log(f"{method}: calibrating on {calib_samples} x {seq_len} tokens of the built-in text")
    if bits == 4:
        group = checkpoint_group_size(model, recipe.group_size)
        if method == "awq":
            return awq_quantize_model(model, sequences, 4, group, on_layer=LayerProgress("awq", log))
        if method == "gptq":
            return gptq_quantize_model(model, sequences, 4, group, symmetric=False, act_order=recipe.act_order,
                                       on_layer=LayerProgress("gptq", log))
        results = {}
        for name in names:
            linear = model.get_submodule(name)
            results[name] = ql = quantize_groups(linear.weight.data, 4, group)
            ql.bias = None if linear.bias is None else linear.bias.data.clone()
        return results
    if layout == "w8a8":
        smooth_model(model, linear_input_absmax(model, sequences, smoothable_linears(model)))
    return {name: _int8(model.get_submodule(name)) for name in [*names, "lm_head"]}


def checkpoint_tensors(model: LlamaForCausalLM, results: dict[str, QuantizedLinear], spec: CheckpointQuantization) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized checkpoint, under Hugging Face's (unfused) names."""
    tensors: dict[str, torch.Tensor] = {}
    quantized_params = {f"{name}.{attr}" for name in results for attr in ("weight", "bias")}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():  # tied parameters are listed once
        if name in quantized_params or (tied and name == "lm_head.weight"):
            continue
        module_name, _, attr = name.rpartition(".")
        linear = model.get_submodule(module_name)
        if isinstance(linear, Linear) and len(linear.shard_sizes) > 1:
            parent, _, fused = module_name.rpartition(".")
            for index in range(len(linear.shard_sizes)):
                tensors[f"{parent}.{_UNFUSED[fused, index]}.{attr}"] = linear.shard(param.data, index).contiguous()
        else:
            tensors[name] = param.data.contiguous()
    for name, ql in results.items():
        linear = model.get_submodule(name)
        parent, _, fused = name.rpartition(".")
        shards = split_shards(ql, linear.shard_sizes)
        for index, shard in enumerate(shards):
            prefix = f"{parent}.{_UNFUSED[fused, index]}" if len(shards) > 1 else name
            tensors.update({f"{prefix}.{k}": v.contiguous() for k, v in pack(shard, spec).items()})
            if shard.bias is not None:
                tensors[f"{prefix}.bias"] = shard.bias.contiguous()
    return tensors


def write_checkpoint(
    model: LlamaForCausalLM,
    results: dict[str, QuantizedLinear],
    spec: CheckpointQuantization,
    quantization_config: dict,
    source_dir: Path,
    out_dir: Path,
) -> None:
    """model.safetensors + config.json (with `quantization_config`) + the source's tokenizer
    files; the folder, and the folders above it that it creates, readable by every user."""
    top = out_dir  # the outermost folder this creates (or out_dir itself)
    while not top.parent.exists():
        top = top.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model, results, spec), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source_dir.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.startswith("model") and path.suffix != ".safetensors":
            shutil.copy(path, out_dir / path.name)
    make_readable(top)  # not the umask's modes, nor (copies) the source's


def quantize_checkpoint(
    model_dir: Path,
    out_dir: Path,
    recipe: QuantizeRecipe,
    log: Callable[[str], None] = log_stderr,
) -> dict:
    """Quantize the float folder `model_dir` into `out_dir` as `recipe` says; returns the
    written quantization_config."""
    from transformers import AutoTokenizer

    method, bits = recipe.method, recipe.bits
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must differ from --model")
    start = time.monotonic()
    log(f"quantize: loading {model_dir}")
    model = load_model(model_dir, torch.float32, torch.device("cpu"), recipe.seq_len)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    group = checkpoint_group_size(model, recipe.group_size) if bits == 4 else None
    config = quantization_config(recipe.layout, bits, group, sym=False, desc_act=recipe.act_order)
    spec = parse_quantization_config(config)
    config["quantizer"] = {"tool": "pagoda", "method": method}
    if method in CALIBRATED:  # RTN uses no calibration text: it records none
        config["quantizer"] |= {"calib_samples": recipe.calib_samples, "seq_len": recipe.seq_len}
    log(f"quantize: {method} {bits}-bit of {model.args.num_hidden_layers} decoder layers")
    results = quantize_linears(model, tokenizer, recipe, log)
    log(f"quantize: writing {out_dir}")
    write_checkpoint(model, results, spec, config, model_dir, out_dir)
    log(f"quantize: done in {format_seconds(time.monotonic() - start)}")
    return config
