"""One forward pass per step over every scheduled token of every request, flattened."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from engine.attention import AttentionMetadata
from engine.block_manager import BlockManager
from engine.models.llama import LlamaForCausalLM, prepack_linears
from engine.request import Request
from engine.scheduler import SchedulerOutput
from kernels.ops import KernelOps

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphRunner


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_manager: BlockManager,
        ops: KernelOps,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_manager = block_manager
        self.ops = ops
        self.device = device
        prepack_linears(model)  # on CPU, oneDNN's weight layout: the fast GEMM/GEMV
        self.block_size = block_manager.block_size
        self.prompt_rows: list[tuple[Request, int]] = []  # of the last prepared step
        # Tensor parallelism swaps in a forward that first hands the step to the other ranks.
        self.forward_step: Callable[..., torch.Tensor | None] = run_forward
        # Pure decode steps replayed from CUDA graphs (set by EngineCore on CUDA); None = eager.
        self.decode_graphs: DecodeGraphRunner | None = None

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logits_indices: list[int] = []
        # Prompt-logprob rows go after the sampling rows: (request, flat row, target position).
        prompt_rows: list[tuple[Request, int, int]] = []
        tables: list[list[int]] = []
        for request, n in zip(sched.scheduled, sched.num_scheduled_tokens):
            start = request.num_computed_tokens
            end = start + n
            if n == 1 and end == request.num_tokens:
                # A decode: the newest token is the last output token.
                input_ids.append(request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1])
            else:
                input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = self.block_manager.get_block_table(request.request_id)
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            tables.append(table)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + n)
            if end == request.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
            if request.prompt_logprobs is not None:
                # Position p predicts token p + 1; recomputed positions (after preemption) are skipped.
                first = max(start, len(request.prompt_logprobs) - 1)
                base = query_start_loc[-2] - start
                for p in range(first, min(end, request.num_prompt_tokens - 1)):
                    prompt_rows.append((request, base + p, p + 1))
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.zeros((len(tables), max_blocks), dtype=torch.int32)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(logits_indices + [row for _, row, _ in prompt_rows], dtype=torch.int64, device=dev),
        )
        self.prompt_rows = [(request, target) for request, _, target in prompt_rows]
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
        )

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run the step; returns logits [num_sampling_requests, vocab] in `scheduled` order,
        followed by one row per entry of `self.prompt_rows` (prompt logprobs)."""
        copies = None
        if sched.blocks_to_copy:
            copies = torch.tensor(sched.blocks_to_copy, dtype=torch.int64, device=self.device)
        if self.decode_graphs is not None and self.decode_graphs.can_run(sched):
            self.prompt_rows = []  # a decode computes no prompt position
            return self.decode_graphs.execute(sched, copies)
        input_ids, positions, meta = self.prepare(sched)
        return self.forward_step(self.model, self.kv_caches, self.ops, input_ids, positions, meta, copies)


def run_forward(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ops: KernelOps,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    blocks_to_copy: torch.Tensor | None,  # [num_copies, 2] (src, dst), copied first (copy-on-write)
) -> torch.Tensor | None:
    """One prepared step's forward: what every tensor-parallel rank runs (None on ranks > 0)."""
    if blocks_to_copy is not None:
        ops.copy_blocks([k for k, _ in kv_caches], [v for _, v in kv_caches], blocks_to_copy)
    hidden = model(input_ids, positions, kv_caches, meta, ops)
    return model.compute_logits(hidden)
