"""Decode steps replayed from CUDA graphs, padded to the nearest captured batch size.

A decode step of a large model on a GPU launches ~10 kernels per layer from Python; at
small batches the launches, not the GPU, set the pace. A CUDA graph records one step's
kernels once and replays them with one call. A graph fixes every shape and address, so:

- graphs are captured for a list of batch sizes (1, 2, 4, 8, 16, 24, ... up to the cap);
  a step of n decodes runs in the graph of the smallest captured size >= n;
- inputs live in static buffers (token ids, positions, slot mapping, block tables as wide
  as `max_model_len`, sequence lengths, query start offsets, logits indices); a step
  copies its values in and replays. The padding rows are 1-token sequences on the KV
  cache's reserved pad block (the block past the block manager's): they write and read
  only there, and their outputs are dropped;
- every Triton kernel is compiled by an eager warm-up run of the same size before its
  capture (compiling, autotuning or a host sync inside a capture is an error), and all
  graphs share one memory pool, captured largest first so smaller ones reuse its memory;
- the captured region is the model's forward pass only: attention metadata is built on
  the host before, the LM head and sampling run after (on the real rows only).

Steps with any prefill chunk (q_len > 1) run eagerly, as does everything on CPU. On CPU
(tests) the same runner works with `use_cuda_graphs=False`: the same padded buffers and
code path, the forward pass run eagerly instead of replayed.
"""

from __future__ import annotations

import bisect
import sys
import time
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata
from engine.block_manager import BlockManager
from engine.models.llama import ModelArgs
from engine.scheduler import SchedulerOutput
from kernels.ops import KernelOps

if TYPE_CHECKING:
    from engine.worker import Worker

DEFAULT_MAX_BATCH_SIZE = 256


def graph_batch_sizes(max_num_seqs: int, max_batch_size: int | None = None) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to min(max_num_seqs, cap) (which is included)."""
    cap = min(max_num_seqs, max_batch_size or DEFAULT_MAX_BATCH_SIZE)
    return sorted({s for s in (1, 2, 4, *range(8, cap + 1, 8)) if s < cap} | {cap})


def graphs_unsupported_reason(ops: KernelOps, args: ModelArgs, tensor_parallel_size: int = 1) -> str | None:
    """Why this model cannot be captured with these ops, or None. The torch reference
    attention reads sequence lengths on the host, a sync no capture allows."""
    if tensor_parallel_size > 1:
        return "tensor parallelism (the worker ranks run their steps eagerly)"
    if ops.backend != "triton":
        return f"kernel backend {ops.backend!r} (the torch reference attention syncs with the host)"
    from kernels.triton_attention import MAX_GQA_RATIO, SUPPORTED_HEAD_DIMS

    ratio = args.num_attention_heads // args.num_key_value_heads
    if args.head_dim not in SUPPORTED_HEAD_DIMS or ratio > MAX_GQA_RATIO:
        return f"head_dim {args.head_dim} / GQA ratio {ratio} run on the torch reference attention"
    return None


class DecodeGraphRunner:
    def __init__(self, worker: "Worker", block_manager: BlockManager, batch_sizes: list[int], use_cuda_graphs: bool) -> None:
        self.model = model = worker.model
        self.kv_caches = kv_caches = worker.kv_caches
        self.block_manager = block_manager
        self.ops = worker.ops
        self.device = device = worker.device
        max_model_len = worker.max_model_len
        self.batch_sizes = batch_sizes
        self.max_batch_size = batch_sizes[-1]
        self.use_cuda_graphs = use_cuda_graphs
        self.block_size = block_manager.block_size
        # The KV cache holds one block more than the block manager hands out: the pad block.
        self.pad_block = kv_caches[0][0].shape[0] - 1
        if self.pad_block != block_manager.num_blocks:
            raise ValueError("the KV cache must hold exactly one block past the block manager's (the pad block)")
        self.pad_slot = self.pad_block * self.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        n = self.max_batch_size
        with torch.device(device):
            self.input_ids = torch.zeros(n, dtype=torch.int64)
            self.positions = torch.zeros(n, dtype=torch.int64)
            self.slot_mapping = torch.full((n,), self.pad_slot, dtype=torch.int64)
            self.block_tables = torch.full((n, self.max_blocks_per_seq), self.pad_block, dtype=torch.int32)
            self.seq_lens = torch.ones(n, dtype=torch.int32)
            # Every sequence has one query token and samples it: both are constant.
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
            self.logits_indices = torch.arange(n, dtype=torch.int64)
            self.hidden = torch.zeros(n, model.args.hidden_size, dtype=model.model.embed_tokens.weight.dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def padded_batch_size(self, num_seqs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    def can_run(self, sched: SchedulerOutput) -> bool:
        """A pure decode step (every request computes exactly its last token) that fits."""
        return 0 < len(sched.scheduled) <= self.max_batch_size and all(
            n == 1 and r.num_computed_tokens + 1 == r.num_tokens
            for r, n in zip(sched.scheduled, sched.num_scheduled_tokens)
        )

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            logits_indices=self.logits_indices[:batch_size],
        )

    def _forward(self, batch_size: int) -> None:
        b = batch_size
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._metadata(b), self.ops)
        self.hidden[:b].copy_(hidden)

    def run(self, batch_size: int) -> None:
        """The forward pass of the first `batch_size` rows of the static buffers into `hidden`."""
        if self.use_cuda_graphs:
            self.graphs[batch_size].replay()
        else:
            self._forward(batch_size)

    def capture(self, log: bool = True) -> None:
        """Warm up and capture every batch size, largest first, into one memory pool."""
        if not self.use_cuda_graphs:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # The buffers hold only padding rows here: warm-up and capture touch the pad block alone.
        with torch.inference_mode():
            for b in reversed(self.batch_sizes):
                self._forward(b)  # compiles this size's Triton kernels (split-K configs differ per size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the server's other threads may touch CUDA while the engine captures.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._forward(b)
                self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        if log:
            print(
                f"[pagoda] CUDA graphs: decode batch sizes {self.batch_sizes[0]}..{self.max_batch_size} "
                f"({len(self.batch_sizes)} graphs) captured in {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    def execute(self, sched: SchedulerOutput, blocks_to_copy: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a step `can_run` accepted, in `scheduled` order.
        `blocks_to_copy` ([num_copies, 2] (src, dst)) are copied first (copy-on-write)."""
        if blocks_to_copy is not None:
            self.ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], blocks_to_copy)
        n = len(sched.scheduled)
        b = self.padded_batch_size(n)
        bs, pad = self.block_size, self.pad_block
        input_ids, positions = [0] * b, [0] * b
        slots, seq_lens = [self.pad_slot] * b, [1] * b
        tables = []
        for i, request in enumerate(sched.scheduled):
            pos = request.num_computed_tokens
            table = self.block_manager.get_block_table(request.request_id)
            input_ids[i] = request.token_id_at(pos)
            positions[i] = pos
            slots[i] = table[pos // bs] * bs + pos % bs
            seq_lens[i] = pos + 1
            tables.append(table)
        width = max(len(t) for t in tables)
        rows = [t + [pad] * (width - len(t)) for t in tables] + [[pad] * width] * (b - n)
        # Every padded row is rewritten each step: rows past n may hold an earlier, larger
        # step's requests, whose slots must not be written again.
        self.input_ids[:b].copy_(torch.tensor(input_ids, dtype=torch.int64), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions, dtype=torch.int64), non_blocking=True)
        self.slot_mapping[:b].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:b].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        # Columns past `width` keep stale ids: no sequence reads past its seq_len.
        self.block_tables[:b, :width].copy_(torch.tensor(rows, dtype=torch.int32), non_blocking=True)
        self.run(b)
        return self.model.compute_logits(self.hidden[:n])


def build_decode_graph_runner(
    worker: "Worker",
    block_manager: BlockManager,
    max_num_seqs: int,
    max_batch_size: int | None,
    tensor_parallel_size: int = 1,
    log: bool = True,
) -> DecodeGraphRunner | None:
    """The captured runner on CUDA, or None (with the reason logged) when this engine's
    forward pass cannot be captured, or when capturing it fails: the eager path is
    correct anyway, so a capture error (a host sync or host -> device copy some op does
    inside the capture, an out-of-memory graph pool, ...) costs speed, not the server."""
    reason = graphs_unsupported_reason(worker.ops, worker.args, tensor_parallel_size)
    if reason is not None:
        if log:
            print(f"[pagoda] CUDA graphs off: {reason}; decode steps run eagerly", file=sys.stderr, flush=True)
        return None
    runner = DecodeGraphRunner(
        worker, block_manager, graph_batch_sizes(max_num_seqs, max_batch_size), use_cuda_graphs=True
    )
    try:
        runner.capture(log)
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to the eager path
        runner.graphs.clear()
        if worker.device.type == "cuda":
            try:
                torch.cuda.synchronize(worker.device)
            except RuntimeError:
                pass  # the capture's own error; the eager steps report anything lasting
        if log:
            reason = (str(e).strip().splitlines() or [""])[0]
            print(f"[pagoda] fallback: CUDA graph capture failed ({type(e).__name__}: {reason}); decode steps run "
                  "eagerly", file=sys.stderr, flush=True)
        return None
    return runner
