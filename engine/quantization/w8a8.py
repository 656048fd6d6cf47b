"""W8A8: int8 weights x int8 activations, with SmoothQuant's difficulty migration.

Weights: symmetric per output channel, the same int8 RTN as `--quantization int8`
(`rtn.quantize_weight`). Activations: quantized per token at run time (one scale per row,
absmax / 127), then one int8 x int8 -> int32 GEMM (`kernels.quant_linear.w8a8_linear`:
Triton on CUDA, `torch._int_mm` on CPU). The LM head stays INT8 weight-only (activations
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

Entry points: `quantize_model_w8a8(model, tokenizer, ...)` (calibrate, smooth, convert),
`smooth_model`, `convert_model_w8a8` (RTN W8A8 without calibration: `--quantization
w8a8`), `w8a8_module` (a checkpoint's `QuantizedLinear` -> `W8A8Linear`). A converted
model's `state_dict()` is its whole checkpoint: per decoder linear `qweight` int8 [N, K],
`weight_scale` float32 [N] (and `bias`), the smoothed RMSNorm weights as ordinary float
parameters (down_proj's smoothing is inside gate_up_proj's integers), the INT8 head's
`qweight` + `scales`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import Linear, LlamaForCausalLM, RMSNorm
from engine.quantization.affine import QuantizedTensor
from engine.quantization.calibration import calibration_token_ids, linear_input_absmax
from engine.quantization.rtn import convert_model, quantize_weight
from engine.quantization.weights import QuantizedLinear
from kernels.quant_linear import w8a8_linear

DEFAULT_ALPHA = 0.5


class W8A8Linear(nn.Module):
    def __init__(
        self,
        qweight: torch.Tensor,  # [N, K] int8
        weight_scale: torch.Tensor,  # [N]
        bias: torch.Tensor | None,  # [N]
        smooth: torch.Tensor | None = None,  # [K]: x / smooth when not folded into the previous op
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be int8 [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", bias)
        self.register_buffer("smooth", smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.smooth is not None:
            x = x / self.smooth
        return w8a8_linear(x, self.qweight, self.weight_scale, self.bias)


def w8a8_linear_module(
    qt: QuantizedTensor, bias: torch.Tensor | None, device: torch.device, smooth: torch.Tensor | None = None
) -> W8A8Linear:
    """The serving module of a symmetric per-channel int8 weight (zero point 128 folded into int8)."""
    if qt.bits != 8 or qt.group_size != qt.q.shape[1] or not bool((qt.zero == 128).all()):
        raise ValueError("W8A8 weights must be 8-bit, symmetric (zero point 128), one scale per output channel")
    qweight = (qt.q - qt.zero).to(torch.int8)
    return W8A8Linear(qweight.to(device), qt.scale.squeeze(1).to(device), bias, smooth)


def w8a8_module(ql: QuantizedLinear, dtype: torch.dtype, device: torch.device) -> W8A8Linear:
    """The serving module of a W8A8 linear read from a checkpoint."""
    if ql.g_idx is not None:
        raise ValueError("W8A8 weights have no act-order (g_idx)")
    bias = None if ql.bias is None else ql.bias.to(device, dtype)
    smooth = None if ql.smooth is None else ql.smooth.to(device, dtype)
    return w8a8_linear_module(ql.qt, bias, device, smooth)


@torch.no_grad()
def convert_model_w8a8(model: nn.Module) -> nn.Module:
    """Every decoder-layer `Linear` -> `W8A8Linear`, the LM head -> INT8 weight-only; in place."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear) and n.startswith("model.layers.")]
    for name, linear in targets:
        parent, _, leaf = name.rpartition(".")
        weight = linear.weight.data
        bias = None if linear.bias is None else linear.bias.data
        setattr(model.get_submodule(parent), leaf, w8a8_linear_module(quantize_weight(weight, "int8"), bias, weight.device))
    return convert_model(model, "int8")  # only the head is still a float Linear


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
    return convert_model_w8a8(model)
