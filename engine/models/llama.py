"""Llama-family decoder in plain torch over a flattened (varlen) batch of tokens, and the
building blocks the other architectures (engine/models/) share.

RMSNorm, RoPE (default / linear / llama3 scaling), grouped-query attention through the
paged-KV ops in `kernels/` (optional q/k norms and per-layer sliding window), gated MLP,
tied or untied embeddings. transformers is used for the config only, never for the
forward pass.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.huge_pages import onto_huge_pages
from engine.models.args import ModelArgs, rope_inv_freq
from kernels import cpu_kernels
from kernels.cpu_kernels import bf16_linear, bf16_silu_mlp, pack_bf16_weight, pack_int8_weight
from kernels.elementwise import rms_norm, rotate_half
from kernels.linear import gemv_enabled, gemv_takes, linear, pack_weight, packed_linear
from kernels.ops import KernelOps

# Checkpoint tensors that load into a slice of a fused parameter: (fused name, shard index).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(args)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] of these positions."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """Rotate q and k heads side by side ([T, H + Hkv, D], one pass): their columns are
        adjacent in the fused QKV projection, and both turn by the same angles."""
        return rotate_half(qk, *self.cos_sin(positions))

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 cos and sin tables [max_positions, head_dim / 2]."""
        return self.cos, self.sin

    def at(self, positions: torch.Tensor) -> "RotaryAt":
        """This rotation with the cos/sin of `positions` looked up once, for all the layers of a forward."""
        return RotaryAt(self, positions)


class RotaryAt:
    """A `RotaryEmbedding` bound to one forward's positions (what every layer rotates by)."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rope = rope
        self.positions = positions
        # Looked up on first use: a backend that rotates in place from the tables
        # (KernelOps.rotate_qk_) never needs it.
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not self.positions:
            return self.rope.cos_sin(positions)
        if self._cos_sin is None:
            self._cos_sin = self.rope.cos_sin(positions)
        return self._cos_sin

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.tables()

    rotate_qk = RotaryEmbedding.rotate_qk  # the same rotation, through this cos_sin


class Linear(nn.Module):
    """`x @ weight.T + bias`; `out_features` as a list makes a fused layer of row shards."""

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool) -> None:
        super().__init__()
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        total = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None
        # oneDNN's blocked copy of `weight` (kernels/linear.py), set by `prepack_linears`
        # once the weights are final, which then drops `weight` (None): the packed copy is
        # the only one. A plain attribute, outside the state dict.
        self.packed: torch.Tensor | None = None
        # Or, for a bf16 weight on an AVX512-BF16 CPU, the C++ bf16 kernel's copy
        # (`cpu_kernels.pack_bf16_weight`, set by `prepack_linears` instead of `packed`):
        # every bf16 call runs that kernel, at any row count.
        self.kernel_weight: torch.Tensor | None = None

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        start = sum(self.shard_sizes[:index])
        return param.narrow(0, start, self.shard_sizes[index])

    def kernel_runs(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` runs the C++ bf16 linear kernel (bf16 x, a packed `kernel_weight`)."""
        return self.kernel_weight is not None and x.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_runs(x):
            return bf16_linear(x, self.kernel_weight, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias)


def prepack_linears(model: nn.Module) -> tuple[int, int]:
    """Give every float `Linear` of a model whose weights will no longer change (the
    serving runtime, not calibration, sharding or quantization, which read the dense
    weight) the one copy of its weight the CPU kernels read, and drop the dense one: each
    weight is held once.

    bf16 where the C++ kernel runs (`kernels.linear.gemv_enabled`: AVX512-BF16): the bf16
    kernel's packed copy (`kernel_weight`). That kernel serves every row count with one
    arithmetic per output, so a row's result does not depend on the other rows of the
    call (batch invariance: docs/ARCHITECTURE.md, "Same request, same tokens"), at oneDNN's
    speed on prefill-sized calls and faster at decode (docs/BENCHMARKS.md).
    `PAGODA_CPU_GEMV=0` gives such linears oneDNN's copy instead (not batch-invariant).

    Otherwise (float32, a CPU without AVX512-BF16): oneDNN's packed copy (`packed`).

    The exception to "held once" is a weight another module also reads: an LM head tied to
    the embeddings. The lookup needs the dense table's rows, which neither packed layout
    gives, and the head through the dense weight is ~30% slower per call than packed (it
    streams the largest matrix of a small model every step; docs/BENCHMARKS.md), so such a
    head is packed and the dense table kept: one extra copy of the vocabulary matrix.

    INT8 weight-only linears (`Int8Linear`) on such a CPU get the C++ int8 kernel's packed copy
    (`kernel_weight`: the same loops, batch-invariant) beside their int8 weight, which
    tensor-parallel sharding and the references read; they are not counted below.

    Returns how many float linears were packed (either way; none off the CPU: both copies are
    CPU-only) and how many of those keep a dense weight because it is shared."""
    from engine.quantization.linears import Int8Linear

    # By storage, not by Parameter: tensor parallelism re-wraps the tied table's data.
    shared = {
        param.untyped_storage().data_ptr() for module in model.modules() if not isinstance(module, Linear)
        for param in module.parameters(recurse=False)
    }
    packed = kept_shared = 0
    kernel = None  # whether the C++ bf16 kernel runs here: asked once, and only for a bf16 model
    for module in model.modules():
        if isinstance(module, Int8Linear) and module.qweight.device.type == "cpu":
            # W8A16 on CPU: the C++ int8 kernel at every row count (its packed copy beside the
            # int8 weight, which tensor-parallel sharding and the references read).
            if kernel is None:
                kernel = gemv_enabled()
            if kernel:
                module.kernel_weight = onto_huge_pages(pack_int8_weight(module.qweight))
            continue
        if not isinstance(module, Linear) or module.weight is None:
            continue
        takes = gemv_takes(module.weight, module.bias)
        if takes and kernel is None:
            kernel = gemv_enabled()
        if takes and kernel:
            module.kernel_weight = onto_huge_pages(pack_bf16_weight(module.weight))
        else:
            module.packed = pack_weight(module.weight)
            if module.packed is None:
                continue
        packed += 1
        if module.weight.untyped_storage().data_ptr() in shared:
            kept_shared += 1  # the embedding still reads it
        else:
            module.weight = None  # the packed copy is the only one from here on
    return packed, kept_shared


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # HF LlamaRMSNorm's order of operations

    def add_norm(self, x: torch.Tensor, add: torch.Tensor | None, ops: KernelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + add, x + add) in one op where the backend fuses them; the sum
        may be written into x (kernels/elementwise.py), so x must be a residual stream the
        caller owns."""
        return ops.add_rms_norm(x, add, self.weight, self.eps)


# The gated MLP's activation by Hugging Face name (`hidden_act` / `hidden_activation`).
ACTIVATIONS = {
    "silu": F.silu,  # SwiGLU: Llama, Mistral, Qwen
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GeGLU: Gemma
}


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache: fused QKV projection, optional
    per-head q/k RMSNorm (`args.qk_norm`), RoPE, this layer's sliding window."""

    def __init__(self, args: ModelArgs, layer: int = 0, norm_class: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = args.attention_scale
        self.sliding_window = args.sliding_window(layer)
        # One GEMM for Q, K and V; the checkpoint's q/k/v_proj load into its row shards.
        self.qkv_proj = Linear(
            args.hidden_size, [self.q_size, self.kv_size, self.kv_size], args.attention_bias or args.qkv_bias
        )
        self.o_proj = Linear(self.q_size, args.hidden_size, args.attention_bias)
        # One weight of head_dim shared by every head: replicated, not split, under tensor parallelism.
        self.q_norm = norm_class(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm_class(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding | RotaryAt,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        # q and k rotate in one pass: their columns are adjacent in the fused projection.
        if ops.rotate_qk_ is not None:
            ops.rotate_qk_(qk, *rope.tables(), positions)
        else:
            qk = rope.rotate_qk(positions, qk)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        o = ops.paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
            sliding_window=self.sliding_window,
        )
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up in one fused GEMM."""

    # The LoRA manager whose hooks add deltas to this MLP's linears (engine/lora.py); None: LoRA off.
    lora = None

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.act = ACTIVATIONS[args.hidden_act]
        self.gate_up_proj = Linear(args.hidden_size, [args.intermediate_size] * 2, args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        kernel_mlp = (self.act is F.silu and type(gate_up) is Linear and gate_up.kernel_runs(x)
                      and down.kernel_weight is not None)
        lora_rows = self.lora is not None and self.lora.active
        if (kernel_mlp and type(down) is Linear and gate_up.bias is None and down.bias is None
                and not lora_rows):  # the one C++ call has no LoRA hook points
            # bf16 rows where both linears run the C++ kernel: the whole MLP in one C++ call, at
            # any row count (its SiLU-and-multiply is one arithmetic for every row: batch-
            # invariant; the eager ops below round the same way, their float exp is torch's).
            return bf16_silu_mlp(x, gate_up.kernel_weight, down.kernel_weight)
        if kernel_mlp and lora_rows and self.lora.kernel:
            # A step with LoRA rows on the C++ kernels: the linears' hooks add their deltas
            # (`lora_add`) around the activation bf16_silu_mlp computes (as the fused decode call).
            from kernels.cpu_kernels import silu_mul

            return self.down_proj(silu_mul(self.gate_up_proj(x).contiguous()))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, args: ModelArgs, layer: int = 0, norm_class: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer, norm_class)
        self.mlp = MLP(args)
        self.input_layernorm = norm_class(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = norm_class(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        """`attn_args`: (positions, rope, kv_cache, meta, ops), as `Attention.forward` takes them.
        The residual add and the next norm are one op where the backend fuses them (on CPU
        x is updated in place: it is this forward's own residual stream)."""
        ops: KernelOps = attn_args[-1]
        h, _ = self.input_layernorm.add_norm(x, None, ops)
        h, x = self.post_attention_layernorm.add_norm(x, self.self_attn(h, *attn_args), ops)
        return x + self.mlp(h)


class FusedDecodeLayers:
    """A step's embedding lookup, every decoder layer and the final norm of its sampling rows
    (and a plain LM head's logits: `LlamaForCausalLM.decode_logits`) in one C++ call
    (kernels/cpu_kernels.py `bf16_decode_layers`), on the C++ bf16, int4 and int8 kernels'
    packed weights: decode batches of any size, speculative verification chunks, prefill
    chunks and steps that mix them (the name is from when it took decode steps only).

    The per-op forward adds ~10 Python calls per layer (each a pybind or dispatcher call and
    new tensor objects) to what the kernels do: at batch 1 a large share of the bundled
    model's step, and still 10-15% of its 32- and 96-row steps (docs/BENCHMARKS.md, "The
    fused call at every row count"). The C++ call runs the same kernels in the same order
    with the same rounding at every row count, so its output is bit-identical
    (tests/engine/test_fused_decode.py); the model's Python stays the reference and runs the
    steps the call does not take (float32, tensor parallelism, other quantized layouts,
    LoRA adapters outside the C++ kernels, `PAGODA_CPU_FUSED_DECODE=0`).

    `build` returns None unless every layer is the plain Llama block of this module
    (Llama, Mistral, Qwen2: no q/k norms, a SiLU MLP) whose linears are each a bf16 kernel
    `Linear`, an `Int4Linear` in the C++ int4 kernel's layout or an `Int8Linear` with bf16 scales,
    the head dim one the C++ attention's bf16 loops take, and the C++ kernels built with
    AVX512-BF16. `PAGODA_CPU_FUSED_DECODE=0` turns it off (the per-op path, for A/B runs)."""

    def __init__(self, model: "LlamaForCausalLM", batch_invariant: bool = False,
                 c12_budget_bytes: int | None = None) -> None:
        args = model.args
        self.batch_invariant = batch_invariant  # attention's route, as the per-op forward's ops take it
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = args.attention_scale
        self.eps = args.rms_norm_eps
        self.tensors: list[torch.Tensor] = []
        self.kinds: list[int] = []
        # Each linear's kernel weight in call order (per layer: qkv, o_proj, gate_up, down),
        # as `self.tensors` holds it among the rest: what a step reads (bench_decode_paths).
        self.linear_weights: list[torch.Tensor] = []
        self.windows: list[int] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.tensors.append(layer.input_layernorm.weight.data)
            for linear in (attn.qkv_proj, attn.o_proj):
                self._add_linear(linear)
            self.tensors.append(layer.post_attention_layernorm.weight.data)
            for linear in (mlp.gate_up_proj, mlp.down_proj):
                self._add_linear(linear)
            self.windows.append(int(attn.sliding_window or 0))
        self.embedding = model.model.embed_tokens.weight.data
        self.final_norm = model.model.norm.weight.data
        # The LM head too (`logits`) where the model's `compute_logits` is a plain head on a C++
        # kernel: no bias, no soft-capping; a bf16-kernel `Linear`, or an `Int8Linear` with its
        # packed copy and bf16 row scales (the INT4 model's INT8 head on CPU).
        from engine.quantization.linears import Int8Linear

        head = model.lm_head
        int8_head = (type(head) is Int8Linear and head.kernel_weight is not None
                     and head.scales.dtype == torch.bfloat16)
        plain_head = (type(model).compute_logits is LlamaForCausalLM.compute_logits
                      and (int8_head or (type(head) is Linear and head.kernel_weight is not None))
                      and head.bias is None and model.args.final_logit_softcapping is None)
        self.lm_head: torch.Tensor | None = head.kernel_weight if plain_head else None
        self.lm_head_scales: torch.Tensor | None = head.scales if plain_head and int8_head else None
        # A bf16 head's int8 copy for steps whose rows only take their argmax
        # (`AttentionMetadata.argmax_only`): the head read at about half its bytes, the same
        # tokens (kernels/greedy_head.py). PAGODA_CPU_GREEDY_HEAD=0: the whole head always (A/B).
        self.argmax_head: list[torch.Tensor] | None = None
        if self.lm_head is not None and not int8_head and os.environ.get("PAGODA_CPU_GREEDY_HEAD", "1") != "0":
            from kernels.greedy_head import greedy_head_copy

            self.argmax_head = greedy_head_copy(self.lm_head)
            self.argmax_head[0] = onto_huge_pages(self.argmax_head[0])  # the int8 copy: a weight stream too
        # Each bias-free bf16 linear's lossless 12-bit copy, which steps of 1-2 rows read
        # instead (the same bits from 3/4 of the bytes: a one-stream decode streams the
        # weights, so it is that much shorter), held beside the bf16 copy the larger steps
        # compute from. Made only where it fits: `c12_budget_bytes` is what the host can still
        # give after the KV cache and a headroom (engine/worker.py, engine/host_memory.py);
        # None: no limit. PAGODA_CPU_12BIT_WEIGHTS=0: none (A/B; the memory back); =1: made
        # whatever the budget.
        self.c12: list[torch.Tensor] | None = None
        self.c12_bytes = 0  # the copies' bytes
        self.c12_bf16_bytes = 0  # the bf16 weights' bytes they stand in for
        self.c12_skipped: str | None = None  # why there is no copy where one could run
        setting = os.environ.get("PAGODA_CPU_12BIT_WEIGHTS", "auto")
        layers_linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj) for layer in model.model.layers]
        copied = [[type(linear) is Linear and linear.bias is None for linear in linears] for linears in layers_linears]
        if setting != "0" and any(map(any, copied)) and cpu_kernels.c12_available():
            need = sum(cpu_kernels.c12_copy_bytes(*linear.kernel_weight.shape)
                       for linears, flags in zip(layers_linears, copied) for linear, flag in zip(linears, flags) if flag)
            if setting != "1" and c12_budget_bytes is not None and need > c12_budget_bytes:
                self.c12_skipped = (f"no 12-bit copy: it needs {need / 2**20:.0f} MiB, "
                                    f"{max(c12_budget_bytes, 0) / 2**20:.0f} MiB are free beside the KV cache "
                                    "and the headroom (PAGODA_CPU_12BIT_WEIGHTS=1 makes it anyway)")
                copied = []
        else:
            copied = []
        if copied:
            self.c12 = []
            empty = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int16), torch.empty(0, dtype=torch.int64)]
            for linears, flags in zip(layers_linears, copied):
                for linear, flag in zip(linears, flags):
                    if flag:
                        copy = cpu_kernels.pack_c12_weight(cpu_kernels.unpack_bf16_weight(linear.kernel_weight))
                        copy[0] = onto_huge_pages(copy[0])  # the packed bytes; exceptions and offsets are small
                        self.c12 += copy
                        self.c12_bytes += sum(t.numel() * t.element_size() for t in copy)
                        self.c12_bf16_bytes += 2 * linear.kernel_weight.numel()
                    else:
                        self.c12 += empty
        self.rope = model.rope
        # The C++ side's copy of all this (cpu_kernels.DecodeModel), made at the first step.
        self._held: cpu_kernels.DecodeModel | None = None

    def _add_linear(self, linear: nn.Module) -> None:
        none = torch.empty(0, dtype=torch.bfloat16)
        bias = none if linear.bias is None else linear.bias
        self.linear_weights.append(linear.kernel_weight)
        if type(linear) is Linear:
            self.tensors += [linear.kernel_weight, bias, none]
            self.kinds.append(0)
        elif _is_cpu_int4(linear):
            self.tensors += [linear.kernel_weight, bias, none]
            self.kinds.append(linear.group_size)
        else:  # an Int8Linear with its packed copy (`_decode_kernel_runs`)
            self.tensors += [linear.kernel_weight, bias, linear.scales]
            self.kinds.append(-1)

    @classmethod
    def build(cls, model: "LlamaForCausalLM", batch_invariant: bool = False,
              c12_budget_bytes: int | None = None) -> "FusedDecodeLayers | None":
        if os.environ.get("PAGODA_CPU_FUSED_DECODE", "1") == "0" or not cpu_kernels.bf16_gemv_available():
            return None
        args = model.args
        final = model.model.norm
        if (type(model).layer_ropes is not LlamaForCausalLM.layer_ropes or type(model).embed is not LlamaForCausalLM.embed
                or type(model).final_norm is not LlamaForCausalLM.final_norm
                or type(final) is not RMSNorm or final.eps != args.rms_norm_eps or final.weight.dtype != torch.bfloat16
                or type(model.model.embed_tokens) is not nn.Embedding
                or model.model.embed_tokens.weight.dtype != torch.bfloat16
                or not isinstance(model.rope, RotaryEmbedding) or args.qk_norm
                or not cpu_kernels.blocked_attention_runs(torch.bfloat16, args.head_dim)):
            return None
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP
                    or mlp.act is not F.silu
                    or any(type(n) is not RMSNorm or n.eps != args.rms_norm_eps or n.weight.dtype != torch.bfloat16
                           for n in norms)):
                return None
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not _decode_kernel_runs(linear):
                    return None
        return cls(model, batch_invariant, c12_budget_bytes)

    def runs(self, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], ops: KernelOps) -> bool:
        """Whether this step's layers go through the C++ call: any rows (tokens) on the C++
        kernel backend, over bf16 or int8 (`--kv-cache-dtype int8`) KV caches."""
        return (ops.backend == "cpu" and input_ids.shape[0] > 0
                and kv_caches[0][0].dtype in (torch.bfloat16, torch.int8))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 logits: bool = False,
                 lora: tuple[list[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The final hidden states of the rows at `meta.logits_indices`: the embedding lookup,
        every layer, then the model's final norm of those rows (as
        `LlamaForCausalLM.final_norm` computes it on this backend), in the one call. With
        `logits` (only where `self.lm_head` is set) their float32 logits instead: the head's
        bf16 outputs widened, as the sampler widens the per-op head's; on a step of at most
        4 rows with `meta.argmax_only`, exact only where a token can be a row's argmax and
        -inf elsewhere (`self.argmax_head`)."""
        caches = [c for pair in kv_caches for c in pair]
        held = self._held
        if held is None or not held.holds(caches, self.argmax_head, self.c12):
            # Made (and checked) once, at the first step, and again only if the caches or the
            # copies (set aside for an A/B: loadtest/bench_decode_paths.py) change.
            held = self._held = cpu_kernels.DecodeModel(
                self.embedding, self.tensors, self.kinds, caches, self.windows, self.num_heads, self.num_kv_heads,
                self.scale, self.eps, self.final_norm, self.lm_head, self.lm_head_scales,
                invariant=self.batch_invariant, argmax_head=self.argmax_head, c12=self.c12)
        return held(input_ids.contiguous(), *self.rope.tables(), positions, meta.slot_mapping, meta.block_tables,
                    meta.seq_lens, meta.query_start_loc, meta.logits_indices, logits=logits,
                    argmax=logits and meta.argmax_only, lora=lora[0] if lora else None,
                    lora_rows=lora[1] if lora else None)


def _is_cpu_int4(linear: nn.Module) -> bool:
    from engine.quantization.linears import Int4Linear

    return type(linear) is Int4Linear and linear.kernel


def _decode_kernel_runs(linear: nn.Module) -> bool:
    """Whether the fused decode call runs this linear as the per-op forward does: the bf16
    kernel (a `Linear` with a `kernel_weight`), the C++ int4 kernel (an `Int4Linear` in its
    layout) or the C++ int8 kernel (an `Int8Linear` with its packed copy and bf16 scales), bf16
    biases. Any other module (a GPTQ act-order `PermutedInputLinear`, which has no `bias` of its
    own and permutes its input first) is not run there: the model keeps the per-op forward."""
    from engine.quantization.linears import Int8Linear

    bias = getattr(linear, "bias", None)
    if bias is not None and bias.dtype != torch.bfloat16:
        return False
    if type(linear) is Linear:
        return linear.kernel_weight is not None
    if _is_cpu_int4(linear):
        return True
    return type(linear) is Int8Linear and linear.scales.dtype == torch.bfloat16 and linear.kernel_weight is not None


class LlamaForCausalLM(nn.Module):
    """Parameter names match HF checkpoints, so safetensors load by name.

    The other architectures subclass it (engine/models/): `norm_class` and `layer_class`
    choose the blocks, `embed` and `layer_ropes` the embedding scale and each layer's RoPE;
    the constructor is the same for all, `(args, max_positions)`."""

    norm_class: type[nn.Module] = RMSNorm
    layer_class: type[nn.Module] = DecoderLayer
    # The LoRA manager (engine/lora.py), set when LoRA is on: a step with LoRA rows runs the
    # fused C++ decode call with its deltas (`LoraManager.fused_tensors`) where the deltas
    # are C++ (`lora.kernel`: bf16 CPU), else the per-layer forward, whose linears' hooks add them.
    lora = None

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.max_positions = max_positions
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = nn.ModuleList(
            self.layer_class(args, i, self.norm_class) for i in range(args.num_hidden_layers)
        )
        self.model.norm = self.norm_class(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.build_rope()
        # The decode steps' layers in one C++ call, where they qualify: set by the Worker
        # once the weights are final (`FusedDecodeLayers.build`, after `prepack_linears`).
        self.fused_decode: FusedDecodeLayers | None = None

    def build_rope(self, device: torch.device | None = None) -> None:
        """(Re)build the RoPE tables, non-persistent buffers: the loader calls this on the
        real device after materialising a model built on the meta device."""
        rope = RotaryEmbedding(self.args, self.max_positions)
        self.rope = rope if device is None else rope.to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def layer_ropes(self, positions: torch.Tensor) -> list[RotaryAt]:
        """Each layer's rotation at `positions`: cos/sin looked up once, not once per layer."""
        return [self.rope.at(positions)] * len(self.model.layers)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """Returns the final hidden states of the tokens at `meta.logits_indices`."""
        if self.fused_decode is not None and self.fused_decode.runs(input_ids, kv_caches, ops):
            if self.lora is None or not self.lora.active:
                return self.fused_decode(input_ids, positions, kv_caches, meta)  # the lookup and the final norm included
            if self.lora.kernel:  # the step's LoRA deltas inside the call
                return self.fused_decode(input_ids, positions, kv_caches, meta,
                                         lora=self.lora.fused_tensors(len(self.model.layers)))
            self.lora.note_fused_fallback()
        x = self.embed(input_ids)
        ropes = self.layer_ropes(positions)
        with ops.forward_scope():  # the layers share this step's metadata (and what ops derive from it)
            for layer, rope, kv_cache in zip(self.model.layers, ropes, kv_caches):
                x = layer(x, positions, rope, kv_cache, meta, ops)
        # Only the positions that sample need the final norm and the (large) LM head.
        return self.final_norm(x[meta.logits_indices], ops)

    @torch.inference_mode()
    def decode_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor | None:
        """The float32 logits of the rows at `meta.logits_indices` in one C++ call (the fused
        decode with the LM head: `FusedDecodeLayers`), or None where that call does not run
        this step (the caller runs `forward` and `compute_logits`). Equal to
        `compute_logits(forward(...)).float()`, which the sampler computes from the per-op
        path, without the head's and the widening's eager calls."""
        fused = self.fused_decode
        if fused is None or fused.lm_head is None or not fused.runs(input_ids, kv_caches, ops):
            return None
        lora = None
        if self.lora is not None and self.lora.active:
            if not self.lora.kernel:
                return None  # the per-layer forward applies the LoRA deltas (`forward`)
            lora = self.lora.fused_tensors(len(self.model.layers))
        return fused(input_ids, positions, kv_caches, meta, logits=True, lora=lora)

    def final_norm(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """The final norm of the rows that sample. In bf16 on the C++ kernel backend through
        the layers' `add_rms_norm` kernel (no add), which the fused decode call also runs
        (`FusedDecodeLayers`): both paths give the same bits. Elsewhere (float32, where the
        tokens are compared with Hugging Face's, and other backends) the module's own ops."""
        if ops.backend == "cpu" and x.dtype == torch.bfloat16 and type(self.model.norm) is RMSNorm:
            return self.model.norm.add_norm(x.contiguous(), None, ops)[0]
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # None on tensor-parallel ranks other than 0
        cap = self.args.final_logit_softcapping
        if cap is not None and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
