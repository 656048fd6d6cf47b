"""The modules that talk to the other ranks during a forward pass (Megatron-style).

Column-parallel layers (the fused QKV and gate/up projections) need no module of their
own: each rank's `Linear` simply holds its rows, so its output is this rank's heads or
intermediate features. The three below are where the ranks meet: a row-parallel linear
(o_proj, down_proj: partial products summed by one all-reduce), the vocab-parallel
embedding (each rank looks up the ids it owns, an all-reduce fills in the rest) and the
vocab-parallel LM head (each rank scores its slice of the vocabulary; rank 0 gathers
the full logits, the only rank that samples).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class RowParallelLinear(nn.Module):
    """`local` holds this rank's slice of the input features; the bias is added once, after the sum."""

    def __init__(self, local: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        bias = local.bias
        local.bias = None
        self.local = local
        self.register_buffer("bias", None if bias is None else bias.data)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.local(x)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + rows) of the embedding table live on this rank."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)  # exactly one rank contributed each row
        return out


class ParallelLMHead(nn.Module):
    """`local` scores this rank's `shard_size` vocabulary rows; rank 0 returns the full
    [tokens, vocab_size] logits, the other ranks None."""

    def __init__(self, local: nn.Module, vocab_size: int, shard_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.local = local
        self.vocab_size = vocab_size
        self.shard_size = shard_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.local(hidden)
        if logits.shape[-1] < self.shard_size:  # the last rank's slice is short when ranks do not divide the vocab
            logits = F.pad(logits, (0, self.shard_size - logits.shape[-1]))
        logits = logits.contiguous()
        if dist.get_rank(self.group) != 0:
            dist.gather(logits, None, group_dst=0, group=self.group)
            return None
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.group))]
        dist.gather(logits, parts, group_dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
