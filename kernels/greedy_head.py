"""The int8 copy of a bf16 LM head that lets a greedy decode step read half of it.

At a decode step of one row the LM head is a large share of the weight bytes the step
reads (the bundled model's 49,152 x 576 bf16 head is 57 MB of ~270), and a greedy row
with nothing else asked of its logits needs only their argmax. With this copy the C++ call
(csrc/cpu_kernels.cpp `argmax_head_logits_impl`) computes every token's logit from int8
weights, bounds how far each can be from the bf16 head's own logit, and computes exactly
(with the head's own kernel: the same bits) only the tokens that can still be the argmax;
the others' logits are -inf. The argmax is the whole head's, from about half its bytes.

Per output row n of the head W [V, K]: the scale s_n is the smallest bf16 >= max |W[n]| /
127, q = round(W[n] / s_n) in [-127, 127], and e_n = max |W[n] - s_n q| is measured here
(float64), so the bound rests on what the copy holds, not on how rounding is expected to
behave. The copy costs V x K bytes (half the head) plus 6 bytes a row.
"""

from __future__ import annotations

import torch

from kernels import cpu_kernels
from kernels.cpu_kernels import unpack_bf16_weight

_ROWS_PER_CHUNK = 4096  # head rows quantized at a time: a float64 copy of 4,096 x 2,048 is 64 MB


def _bf16_at_least(value: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 >= each (positive, finite) float32 value."""
    rounded = value.to(torch.bfloat16)
    low = rounded.float() < value
    if bool(low.any()):
        bits = rounded.view(torch.int16)
        rounded = torch.where(low, (bits + 1).view(torch.bfloat16), rounded)  # the next bf16 up (positive)
    return rounded


def greedy_head_copy(packed_head: torch.Tensor) -> list[torch.Tensor]:
    """[q8 packed by `pack_int8_weight`, bf16 scales [V], float32 errors [V]] of a bf16 head
    packed by `pack_bf16_weight` (see the module's docstring), as `bf16_decode_layers`'
    `argmax_head` and `argmax_head_logits` take them."""
    weight = unpack_bf16_weight(packed_head)
    v = weight.shape[0]
    q8 = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(v, dtype=torch.bfloat16)
    errors = torch.empty(v, dtype=torch.float32)
    for lo in range(0, v, _ROWS_PER_CHUNK):
        w = weight[lo:lo + _ROWS_PER_CHUNK].double()
        amax = w.abs().amax(dim=1)
        s = _bf16_at_least(torch.where(amax > 0, amax / 127, torch.ones_like(amax)).float())
        sd = s.double()[:, None]
        q = torch.round(w / sd).clamp_(-127, 127)
        err = (w - sd * q).abs().amax(dim=1)
        q8[lo:lo + _ROWS_PER_CHUNK] = q.to(torch.int8)
        scales[lo:lo + _ROWS_PER_CHUNK] = s
        errors[lo:lo + _ROWS_PER_CHUNK] = torch.nextafter(err.float(), torch.tensor(float("inf")))  # rounded up
    return [cpu_kernels.pack_int8_weight(q8), scales, errors]
