"""What each tensor-parallel rank holds, and cutting a loaded model down to it.

Rank r of N holds, in every decoder layer:

- qkv_proj (column-parallel): the rows of its H/N query heads and of their KV heads -
  KV/N heads, or, when the model has fewer KV heads than ranks (N a multiple of KV), the
  one KV head its query heads share, replicated on N/KV ranks;
  its biases (Qwen2's q/k/v) the same rows; q/k norms (Qwen3, Gemma 3) are one weight of
  head_dim that every head shares, so every rank keeps all of it;
- gate_up_proj (column-parallel): rows [r I/N, (r+1) I/N) of gate and the same of up;
- o_proj, down_proj (row-parallel): the matching input columns, summed by one all-reduce
  (a bias added once, after the sum);
- every norm (2 per layer, 4 in Gemma 3) and the per-layer sliding windows: replicated;
- the KV cache of its KV heads only;

and rows [r V', (r+1) V') of the embedding table and LM head, V' = ceil(V / N).

Quantized weights (`--quantization int8|int4`, round-to-nearest at load time) become
exactly the integers and scales the whole model gets with N = 1, cut at group
boundaries:
- INT8 is per output row, so rows split freely; a row-parallel layer's scale spans all
  of its input columns, which one slice does not see - those layers are quantized whole,
  then their integer columns are split (the scales stay whole).
- INT4 groups run along the input columns: each slice must hold whole groups of the
  size the whole layer uses (`int4_group_size(K)`), checked up front. Quantizing each
  slice then gives the same groups as quantizing the whole and slicing.
So the same weights run at every N, and N = 2 gives the greedy tokens of N = 1 (up to
the order of float additions in the all-reduce).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from engine.kv_cache import KVCacheSpec
from engine.models.llama import Linear, LlamaForCausalLM, ModelArgs

SHARDABLE_QUANTIZATION = (None, "int8", "int4")


def split_problem(args: ModelArgs, world_size: int, quantization: str | None) -> str | None:
    """Why `world_size` ranks cannot split this model, or None when they can."""
    n = world_size
    if args.num_attention_heads % n:
        return f"{n} ranks do not divide the model's {args.num_attention_heads} attention heads"
    kv = args.num_key_value_heads
    if kv % n and n % kv:
        return f"{n} ranks neither divide the model's {kv} KV heads nor are a multiple of them"
    if args.intermediate_size % n:
        return f"{n} ranks do not divide the model's {args.intermediate_size} MLP features"
    if quantization not in SHARDABLE_QUANTIZATION:
        return f"quantization {quantization!r} cannot be split across ranks yet (int8 and int4 can)"
    if quantization == "int4":
        from engine.quantization.rtn import int4_group_size

        for name, k in (("o_proj", args.num_attention_heads * args.head_dim), ("down_proj", args.intermediate_size)):
            group = int4_group_size(k)
            if (k // n) % group:
                return (
                    f"{name}'s INT4 groups of {group} along its {k} input features cannot be split into "
                    f"{n} slices of whole groups"
                )
    return None


def check_split(args: ModelArgs, world_size: int, quantization: str | None) -> None:
    """Raise a ValueError that names the sizes that would work."""
    problem = split_problem(args, world_size, quantization)
    if problem is None:
        return
    working = [n for n in range(1, args.num_attention_heads + 1) if split_problem(args, n, quantization) is None]
    raise ValueError(
        f"tensor_parallel_size {world_size} cannot split this model: {problem} "
        f"(sizes that can: {', '.join(map(str, working))})"
    )


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """This rank's share of the heads, MLP features and vocabulary."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_shard_size: int

    @classmethod
    def for_rank(cls, args: ModelArgs, rank: int, world_size: int, quantization: str | None) -> "ShardLayout":
        check_split(args, world_size, quantization)
        n, kv = world_size, args.num_key_value_heads
        if kv >= n:
            num_kv_heads, kv_head_start = kv // n, rank * (kv // n)
        else:  # one KV head per rank, shared by the n / kv ranks whose query heads use it
            num_kv_heads, kv_head_start = 1, rank * kv // n
        return cls(
            rank=rank,
            world_size=n,
            num_heads=args.num_attention_heads // n,
            num_kv_heads=num_kv_heads,
            kv_head_start=kv_head_start,
            intermediate_size=args.intermediate_size // n,
            vocab_shard_size=-(-args.vocab_size // n),
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard_size

    def kv_cache_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """The whole model's KV-cache spec cut to this rank's KV heads."""
        return dataclasses.replace(spec, num_kv_heads=self.num_kv_heads)


def _rows(module: nn.Module, index: torch.Tensor) -> None:
    """Keep the output rows `index` of a float `Linear`."""
    module.weight = nn.Parameter(module.weight.data.index_select(0, index).contiguous(), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.data.index_select(0, index).contiguous(), requires_grad=False)


def _columns(module: nn.Module, start: int, length: int) -> None:
    """Keep the input columns [start, start + length) of a float `Linear` or an INT8 linear."""
    if isinstance(getattr(module, "qweight", None), torch.Tensor) and module.qweight.dtype == torch.int8:
        module.qweight = module.qweight[:, start : start + length].contiguous()
    elif isinstance(getattr(module, "weight", None), torch.Tensor):
        module.weight = nn.Parameter(module.weight.data[:, start : start + length].contiguous(), requires_grad=False)
    else:
        raise TypeError(f"cannot split the input columns of {type(module).__name__}")


@torch.no_grad()
def shard_model(
    model: LlamaForCausalLM,
    layout: ShardLayout,
    quantization: str | None,
    device: torch.device,
    group: dist.ProcessGroup,
    lm_head_quantization: str = "auto",
) -> LlamaForCausalLM:
    """Cut a whole float model (loaded on the CPU) down to this rank's shard on `device`,
    quantized as the whole model would be; returns the same module, changed in place."""
    args = model.args
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        if not isinstance(model.model.layers[0].get_submodule(name), Linear):
            raise ValueError(f"tensor parallelism splits float checkpoints only; this one's {name} is quantized")
    d, r = args.head_dim, layout.rank
    q_heads = torch.arange(r * layout.num_heads, (r + 1) * layout.num_heads)
    kv_heads = torch.arange(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)

    def head_rows(heads: torch.Tensor, offset: int) -> torch.Tensor:
        return offset + (heads[:, None] * d + torch.arange(d)).flatten()

    q_size, kv_size = args.num_attention_heads * d, args.num_key_value_heads * d
    qkv_rows = torch.cat([head_rows(q_heads, 0), head_rows(kv_heads, q_size), head_rows(kv_heads, q_size + kv_size)])
    inter = layout.intermediate_size
    mlp_rows = torch.arange(r * inter, (r + 1) * inter)
    gate_up_rows = torch.cat([mlp_rows, args.intermediate_size + mlp_rows])
    # INT8 scales span a whole row: those row-parallel layers are quantized whole, split after.
    split_inputs_late = quantization == "int8"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _rows(attn.qkv_proj, qkv_rows)
        attn.num_heads, attn.num_kv_heads = layout.num_heads, layout.num_kv_heads
        attn.q_size, attn.kv_size = layout.num_heads * d, layout.num_kv_heads * d
        attn.qkv_proj.shard_sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        _rows(mlp.gate_up_proj, gate_up_rows)
        mlp.intermediate_size = inter
        mlp.gate_up_proj.shard_sizes = [inter, inter]
        if not split_inputs_late:
            _columns(attn.o_proj, r * attn.q_size, attn.q_size)
            _columns(mlp.down_proj, r * inter, inter)

    vocab_rows = torch.arange(layout.vocab_start, min(layout.vocab_start + layout.vocab_shard_size, args.vocab_size))
    embed = model.model.embed_tokens
    embed.weight = nn.Parameter(embed.weight.data.index_select(0, vocab_rows).contiguous(), requires_grad=False)
    if args.tie_word_embeddings:
        model.lm_head.weight = embed.weight
    else:
        _rows(model.lm_head, vocab_rows)

    model.to(device)
    if quantization is not None:
        from engine.quantization.rtn import convert_model

        convert_model(model, quantization, lm_head_quantization)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if split_inputs_late:
            _columns(attn.o_proj, r * attn.q_size, attn.q_size)
            _columns(mlp.down_proj, r * inter, inter)
        attn.o_proj = RowParallelLinear(attn.o_proj, group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight.data, layout.vocab_start, group)
    model.lm_head = ParallelLMHead(model.lm_head, args.vocab_size, layout.vocab_shard_size, group)
    return model
