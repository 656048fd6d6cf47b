"""SmoothQuant W8A8: int8 weights x int8 activations, with SmoothQuant's difficulty migration.

Weights: symmetric per output channel, the same int8 RTN as `--quantization int8`
(`rtn.quantize_weight`). Activations: quantized per token at run time (`W8A8Linear` in
linears.py: one scale per row, absmax / 127, then one int8 x int8 -> int32 GEMM,
`kernels.quant_linear.w8a8_linear`: Triton on CUDA, `torch._int_mm` on CPU). The LM head stays INT8 weight-only (activations
unquantized, as under `int8`): it is the largest GEMM at batch 1 either way, and the
logits are the most error-sensitive output.

SmoothQuant (`smooth_model`): an input channel j with outliers forces a coarse scale on
every token; dividing the activation by s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) and
multiplying the weight column by s_j leaves X W^T unchanged while moving part of the range
into the (per-channel quantized) weight. The division is folded into the op that produces
X, so nothing runs at serving time:
- qkv_proj: into input_layernorm's weight; gate_up_proj: into post_attention_layernorm's;
- down_proj: into the up half of gate_up_proj (its input is silu(gate) * up, linear in up,
  and per-output-channel int8 of gate_up does not care how its rows are scaled);
- o_proj: not smoothed. Its input is the attention output, linear in v_proj's rows, but
  with grouped-query attention each v channel feeds `num_heads / num_kv_heads` o_proj
  channels, so one s would have to serve a whole group; o_proj keeps plain per-token.
Measured on SmolLM2-135M (16 x 128 calibration tokens, 4 x 128 held-out tokens,
teacher-forced next-token agreement with float): RTN W8A8 0.893; smoothed without
down_proj 0.916 (alpha 0.5) / 0.928 (0.8); with down_proj 0.936 (0.5) / 0.902 (0.8);
hence down_proj is smoothed and alpha defaults to 0.5 (the test on the default model
guards the level).

Entry points: `quantize_model_w8a8(model, tokenizer, ...)` (calibrate, smooth, convert)
and `smooth_model`. RTN W8A8 without calibration (`--quantization w8a8`) is
`rtn.convert_model(model, "w8a8")`; a checkpoint's W8A8 linear is served through
`weights.runtime_module`. A converted model's `state_dict()` is its whole checkpoint: per decoder linear `qweight` int8 [N, K],
`weight_scale` float32 [N] (and `bias`), the smoothed RMSNorm weights as ordinary float
parameters (down_proj's smoothing is inside gate_up_proj's integers), the INT8 head's
`qweight` + `scales`.
"""

from __future__ import annotations

import torch

from engine.models.llama import Linear, LlamaForCausalLM, RMSNorm
from engine.quantization.calibration import calibration_token_ids, linear_input_absmax
from engine.quantization.rtn import convert_model

DEFAULT_ALPHA = 0.5


def smoothing_scales(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) per input channel j (1 where either max is 0)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    x_max = act_absmax.float().to(weight.device)
    w_max = weight.float().abs().amax(dim=0)
    if x_max.shape != w_max.shape:
        raise ValueError(f"activation statistics of {tuple(x_max.shape)} channels for a weight of {tuple(weight.shape)}")
    s = x_max.pow(alpha) / w_max.pow(1.0 - alpha)
    return torch.where((x_max > 0) & (w_max > 0) & torch.isfinite(s), s, torch.ones_like(s))


def smoothable_linears(model: LlamaForCausalLM) -> list[str]:
    """Names of the linears `smooth_model` can smooth, layer by layer."""
    return [
        f"model.layers.{i}.{leaf}"
        for i in range(len(model.model.layers))
        for leaf in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]


@torch.no_grad()
def smooth_model(model: LlamaForCausalLM, act_absmax: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA) -> LlamaForCausalLM:
    """Migrate quantization difficulty from activations to weights (float model, in place).

    `act_absmax`: {linear name: max |x| per input channel [K]} for any of
    `smoothable_linears(model)` (e.g. `calibration.linear_input_absmax`); linears not in
    it are left alone. The float function is unchanged up to rounding.
    """
    unknown = sorted(set(act_absmax) - set(smoothable_linears(model)))
    if unknown:
        raise ValueError(f"cannot smooth {unknown[:3]}: only qkv_proj, gate_up_proj and down_proj of decoder layers")
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        pairs: list[tuple[str, Linear, RMSNorm]] = [
            ("self_attn.qkv_proj", layer.self_attn.qkv_proj, layer.input_layernorm),
            ("mlp.gate_up_proj", layer.mlp.gate_up_proj, layer.post_attention_layernorm),
        ]
        for leaf, linear, norm in pairs:
            if prefix + leaf in act_absmax:
                s = smoothing_scales(act_absmax[prefix + leaf], linear.weight, alpha)
                linear.weight.mul_(s.to(linear.weight.dtype))
                norm.weight.div_(s.to(norm.weight.dtype))
        if prefix + "mlp.down_proj" in act_absmax:
            down, gate_up = layer.mlp.down_proj, layer.mlp.gate_up_proj
            s = smoothing_scales(act_absmax[prefix + "mlp.down_proj"], down.weight, alpha)
            down.weight.mul_(s.to(down.weight.dtype))
            gate_up.shard(gate_up.weight, 1).div_(s.to(gate_up.weight.dtype)[:, None])
            if gate_up.bias is not None:
                gate_up.shard(gate_up.bias, 1).div_(s.to(gate_up.bias.dtype))
    return model


def quantize_model_w8a8(
    model: LlamaForCausalLM, tokenizer, num_samples: int = 32, seq_len: int = 256, alpha: float = DEFAULT_ALPHA
) -> LlamaForCausalLM:
    """SmoothQuant W8A8 of a float model, in place: calibrate on the built-in English text
    (`num_samples` x `seq_len` tokens), smooth, convert."""
    sequences = calibration_token_ids(tokenizer, num_samples, seq_len)
    act_absmax = linear_input_absmax(model, sequences, smoothable_linears(model))
    smooth_model(model, act_absmax, alpha)
    return convert_model(model, "w8a8")
