"""Rank 0's step preparation: every scheduled token of every request, flattened into one
batch (input ids, positions, slot mapping, block tables, lengths), then one forward pass
on the Worker (or, under tensor parallelism, on every rank at once)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from engine.attention import AttentionMetadata
from engine.block_manager import BlockManager
from engine.prompt_logprobs import PromptLogprobRows
from engine.request import Request
from engine.sampler import argmax_suffices
from engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphRunner
    from engine.lora import LoraManager
    from engine.worker import Worker

ForwardStep = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, "torch.Tensor | None", "PromptLogprobRows | None"], torch.Tensor
]
"""(input_ids, positions, metadata, blocks_to_copy, prompt_logprobs) -> logits: `Worker.forward`,
or under tensor parallelism the executor's step, which hands the step to every rank first."""


class ModelRunner:
    def __init__(
        self,
        worker: "Worker",
        block_manager: BlockManager,
        forward_step: ForwardStep | None = None,
        decode_graphs: "DecodeGraphRunner | None" = None,
    ) -> None:
        self.worker = worker
        self.block_manager = block_manager
        self.device = worker.device
        self.block_size = block_manager.block_size
        self.prompt_rows: list[tuple[Request, int]] = []  # of the last prepared step
        # Those rows' logprobs, reduced on the device by the forward pass (engine/prompt_logprobs.py).
        self.prompt_logprobs: PromptLogprobRows | None = None
        self.forward_step: ForwardStep = forward_step or worker.forward
        # Pure decode steps replayed from CUDA graphs (on CUDA); None = every step eager.
        self.decode_graphs = decode_graphs
        # The LoRA adapters' row groups are set per step (engine/lora.py); None: LoRA off.
        self.lora: "LoraManager | None" = None

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.worker.kv_caches

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
        spec_tokens = sched.spec_tokens
        argmax_only = True  # every sampling row greedy with nothing but its argmax read
        for request, n in zip(sched.scheduled, sched.num_scheduled_tokens):
            start = request.num_computed_tokens
            end = start + n
            drafts = spec_tokens.get(request.request_id) if spec_tokens else None
            if drafts:
                # Verification: the last real token, then the drafts, with logits at each.
                input_ids.append(request.token_id_at(start))
                input_ids.extend(drafts)
            elif n == 1 and end == request.num_tokens:
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
            if drafts:
                logits_indices.extend(range(query_start_loc[-1] - 1 - len(drafts), query_start_loc[-1]))
                argmax_only = argmax_only and argmax_suffices(request)
            elif end == request.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
                argmax_only = argmax_only and argmax_suffices(request)
            if request.prompt_logprobs is not None:
                # Position p predicts token p + 1; recomputed positions (after preemption) are skipped.
                first = max(start, len(request.prompt_logprobs) - 1)
                base = query_start_loc[-2] - start
                for p in range(first, min(end, request.num_prompt_tokens - 1)):
                    prompt_rows.append((request, base + p, p + 1))
        # One tensor from padded lists (block 0 past a table's end): one op, not one per row.
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(logits_indices + [row for _, row, _ in prompt_rows], dtype=torch.int64, device=dev),
            argmax_only=argmax_only and bool(logits_indices) and not prompt_rows,
        )
        self.prompt_rows = [(request, target) for request, _, target in prompt_rows]
        self.prompt_logprobs = PromptLogprobRows.of(
            [r.prompt_token_ids[t] for r, t in self.prompt_rows],
            [r.sampling_params.prompt_logprobs for r, _ in self.prompt_rows], dev,
        ) if self.prompt_rows else None
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
        )

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Run the step; returns logits [num_sampling_rows, vocab] in `scheduled` order (one
        row per sampling request, 1 + k for a request verifying k drafts). The logprobs of
        `self.prompt_rows` are in `self.prompt_logprobs.result`, on the device."""
        copies = None
        if sched.blocks_to_copy:
            copies = torch.tensor(sched.blocks_to_copy, dtype=torch.int64, device=self.device)
        lora = self.lora
        # A graph replays the kernels it captured: it has no LoRA deltas in it.
        with_lora = lora is not None and any(r.sampling_params.lora_request is not None for r in sched.scheduled)
        if self.decode_graphs is not None and not with_lora and self.decode_graphs.can_run(sched):
            self.prompt_rows, self.prompt_logprobs = [], None  # a decode computes no prompt position
            return self.decode_graphs.execute(sched, copies)
        input_ids, positions, meta = self.prepare(sched)
        if not with_lora:
            return self.forward_step(input_ids, positions, meta, copies, self.prompt_logprobs)
        lora.begin_step(sched.scheduled, sched.num_scheduled_tokens)
        try:
            return self.forward_step(input_ids, positions, meta, copies, self.prompt_logprobs)
        finally:
            lora.end_step()
