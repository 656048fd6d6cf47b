"""AWQ (Lin et al. 2023): activation-aware INT4 weight quantization, as AutoAWQ runs it.

A few input channels carry much larger activations than the rest; their weights matter
more. AWQ multiplies those weight columns by s > 1 before quantizing (finer relative
steps for them) and divides the op that produces the input by s, so the float function
is unchanged: W x = (W diag(s)) (diag(s)^-1 x). Per decoder layer, four groups:

    linears scaled       op the 1/s folds into          output the loss is taken on
    qkv_proj             input_layernorm weight          the attention block
    o_proj               v rows of qkv_proj (*)          o_proj
    gate_up_proj         post_attention_layernorm        the MLP
    down_proj            up rows of gate_up_proj         down_proj
    (*) only without GQA (v's outputs must be o's inputs one to one), as in AutoAWQ.

Scales (AutoAWQ's `duo_scaling`): s = mean|x|^a / mean(w_norm)^(1-a), normalised by
sqrt(max s * min s), with w_norm = |w| / max|w| of its group; `a` on a grid of 20 in
[0, 1), picked by the squared error of the group's output with the weights quantized.
s = 1 (plain RTN) is also a candidate, so the search never does worse than RTN on the
calibration tokens. Then weight clipping: per output row and group, the range shrunk to
[max(min, -r m), min(max, r m)] (m = max|w|, r in 1, 0.95, .., 0.55) minimising the
error of that group's partial output on up to 512 calibration tokens; q and k rows are
not clipped (as in AutoAWQ: their error reaches the output through the q.k product, which
a per-row output error does not see). Finally INT4, asymmetric, per group, scales rounded
to float16 as the checkpoint stores them. Each layer's inputs come from the float layers
before it.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.models.llama import LlamaForCausalLM
from engine.quantization.calibration import DECODER_LINEARS, LayerwiseCalibration, quantize_layers
from engine.quantization.weights import QuantizedLinear, quantize_groups

N_GRID = 20
CLIP_RATIOS = tuple(1 - i / N_GRID for i in range(N_GRID // 2))  # 1.0 .. 0.55
CLIP_TOKENS = 512


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, r_min=None, r_max=None) -> torch.Tensor:
    """Quantize-dequantize [N, K] per group (asymmetric), optionally with clipped ranges [N, K / G]."""
    return quantize_groups(w, bits, group_size, r_min, r_max).dequantize().to(w.dtype)


def search_scale(x: torch.Tensor, weight: torch.Tensor, group_size: int, bits: int, output_error) -> torch.Tensor:
    """The per-input-channel scale [K] of the weight [N, K] (of all linears sharing input x
    [T, K]) with the lowest `output_error(scale)`; the ones vector is a candidate."""
    x_mean = x.abs().float().mean(0)
    w = weight.abs().float().reshape(-1, group_size)
    w_mean = (w / (w.amax(1, keepdim=True) + 1e-6)).reshape(weight.shape).mean(0)
    best_scale = torch.ones_like(x_mean)
    best_err = output_error(best_scale)
    for i in range(N_GRID):
        ratio = i / N_GRID
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(s)
        if err < best_err:
            best_err, best_scale = err, s
    return best_scale


def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int, bits: int, clip_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped ranges (r_min, r_max) [N, K / G] minimising each group's partial output error
    on a sample of tokens of x [T, K]; rows where `clip_rows` is False keep their full range."""
    n, k = weight.shape
    step = max(1, x.shape[0] // CLIP_TOKENS)
    xs = x[::step].float().reshape(-1, k // group_size, group_size)  # [T', groups, G]
    w = weight.float().reshape(n, k // group_size, group_size)
    w_min, w_max, m = w.amin(-1), w.amax(-1), w.abs().amax(-1)
    best = (w_min, w_max)
    best_err = None
    for ratio in CLIP_RATIOS:
        lo, hi = torch.maximum(w_min, -ratio * m), torch.minimum(w_max, ratio * m)
        dw = fake_quantize(weight.float(), bits, group_size, lo, hi).reshape(w.shape) - w
        err = torch.einsum("tgc,ngc->tng", xs, dw).pow(2).mean(0)  # [N, groups]
        if best_err is None:
            best_err = err
            continue
        better = (err < best_err) & clip_rows.unsqueeze(1)
        best_err = torch.where(better, err, best_err)
        best = (torch.where(better, lo, best[0]), torch.where(better, hi, best[1]))
    return best


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).pow(2).mean().item()


def _scale_group(linear, inp: torch.Tensor, evaluate, bits: int, group_size: int) -> torch.Tensor:
    """Search one group's scale s against `evaluate(inp)` (the float output) and multiply
    `linear`'s columns by it; the caller folds 1/s into the op before."""
    reference = evaluate(inp)
    original = linear.weight.detach().clone()

    def error(s: torch.Tensor) -> float:
        linear.weight.copy_(fake_quantize(original * s, bits, group_size) / s)
        err = _mse(evaluate(inp), reference)
        linear.weight.copy_(original)
        return err

    s = search_scale(inp, original, group_size, bits, error)
    linear.weight.mul_(s)
    return s


def _divide_rows(linear, shard: int, s: torch.Tensor) -> None:
    """Output rows of one shard of a fused linear (and their bias) divided by s."""
    linear.shard(linear.weight.data, shard).div_(s.unsqueeze(1))
    if linear.bias is not None:
        linear.shard(linear.bias.data, shard).div_(s)


@torch.no_grad()
def awq_quantize_layer(calib: LayerwiseCalibration, index: int, bits: int = 4, group_size: int = 128) -> dict[str, QuantizedLinear]:
    """AWQ of decoder layer `index` on the calibration tokens' current hidden states (and
    `calib` moved past it): {module name inside the layer: QuantizedLinear}."""
    layer = calib.layer(index)
    attn, mlp = layer.self_attn, layer.mlp
    x = calib.capture(index, list(DECODER_LINEARS))
    calib.advance(index)  # the next layer's inputs come from this float layer

    s = _scale_group(attn.qkv_proj, x["self_attn.qkv_proj"], lambda h: calib.attention(layer, h), bits, group_size)
    layer.input_layernorm.weight.div_(s)
    x["self_attn.qkv_proj"] = x["self_attn.qkv_proj"] / s
    if attn.kv_size == attn.q_size:
        s = _scale_group(attn.o_proj, x["self_attn.o_proj"], attn.o_proj, bits, group_size)
        _divide_rows(attn.qkv_proj, 2, s)
        x["self_attn.o_proj"] = x["self_attn.o_proj"] / s
    s = _scale_group(mlp.gate_up_proj, x["mlp.gate_up_proj"], mlp, bits, group_size)
    layer.post_attention_layernorm.weight.div_(s)
    x["mlp.gate_up_proj"] = x["mlp.gate_up_proj"] / s
    s = _scale_group(mlp.down_proj, x["mlp.down_proj"], mlp.down_proj, bits, group_size)
    _divide_rows(mlp.gate_up_proj, 1, s)
    x["mlp.down_proj"] = x["mlp.down_proj"] / s

    results = {}
    for name in DECODER_LINEARS:
        linear = layer.get_submodule(name)
        weight = linear.weight.detach()
        clip_rows = torch.ones(weight.shape[0], dtype=torch.bool)
        if name == "self_attn.qkv_proj":
            clip_rows[: attn.q_size + attn.kv_size] = False
        r_min, r_max = search_clip(x[name], weight, group_size, bits, clip_rows)
        results[name] = ql = quantize_groups(weight, bits, group_size, r_min, r_max)
        ql.bias = None if linear.bias is None else linear.bias.detach().clone()
        linear.weight.copy_(ql.dequantize().to(weight.dtype))
    return results


def awq_quantize_model(
    model: LlamaForCausalLM,
    sequences: torch.Tensor,  # [num_sequences, seq_len] calibration tokens
    bits: int = 4,
    group_size: int = 128,
    on_layer: Callable[[int, int], None] | None = None,
) -> dict[str, QuantizedLinear]:
    """AWQ of every decoder linear. Folds the scales into the norms / v / up rows of the
    model in place and leaves the linears fake-quantized; returns {module name: QuantizedLinear}.
    `on_layer(done, num_layers)` is called after each layer (progress)."""
    calib = LayerwiseCalibration(model, sequences)
    return quantize_layers(model, lambda index: awq_quantize_layer(calib, index, bits, group_size), on_layer)
