"""Rank 0's side of tensor parallelism: start the worker ranks, send them each step, watch them.

`TensorParallelExecutor` lives in `EngineCore` (the engine loop's thread). It spawns one
process per worker rank (multiprocessing spawn: a fresh interpreter, never a fork of a
process holding threads and a CUDA context) or, under `torchrun`, finds them already
started; joins the process groups; loads rank 0's shard. Then every step,
`run_step` broadcasts the step message and runs rank 0's forward, whose collectives the
workers meet.

Failure is final: a worker that dies, a collective that errors or times out, or a step
that raises after the workers started it leaves the ranks out of step, so the executor
raises `TensorParallelError`, which ends the engine loop (`/health` answers 503) instead
of a step error the engine would recover from. A watchdog thread waits on the spawned
workers' process sentinels, so a death is reported (`on_failure`) even while the server
idles and no collective would notice.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import sys
import threading
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.distributed.parallel_state import (
    ParallelGroups,
    cpu_threads_per_rank,
    init_groups,
    local_rendezvous,
    rank_device,
    torchrun_rendezvous,
)
from engine.distributed.sharding import check_split
from engine.distributed.step_message import MessageKind, StepInputs, encode_header, encode_payload
from engine.distributed.worker import worker_main
from engine.models.llama import ModelArgs

if TYPE_CHECKING:
    from engine.prompt_logprobs import PromptLogprobRows
    from engine.worker import RankPlacement, Worker

_JOIN_TIMEOUT_S = 10.0


class TensorParallelError(RuntimeError):
    """The tensor-parallel ranks can no longer run steps together; the engine must stop."""


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, args: ModelArgs) -> None:
        world_size = config.parallel.tensor_parallel_size
        quantization = config.model.quantization
        check_split(args, world_size, quantization)  # before any process starts
        launched = torchrun_rendezvous()
        if launched is not None and (launched.world_size != world_size or launched.rank != 0):
            raise ValueError(
                f"tensor_parallel_size {world_size} but the launcher started rank {launched.rank} of "
                f"{launched.world_size}; run as many ranks as --tensor-parallel-size (rank 0 serves)"
            )
        rendezvous = launched or local_rendezvous(world_size)
        self.device = rank_device(config.model.torch_device, rendezvous.local_rank)
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(world_size, config.kernel.cpu_threads))
        self.failure: TensorParallelError | None = None
        self.on_failure: Callable[[TensorParallelError], None] | None = None
        """Called from the watchdog thread when a worker dies (the engine loop may be idle)."""
        self._closing = False
        self.workers: list[multiprocessing.process.BaseProcess] = []
        if launched is None:
            ctx = multiprocessing.get_context("spawn")
            for rank in range(1, world_size):
                worker = ctx.Process(
                    target=worker_main,
                    args=(config, dataclasses.replace(rendezvous, rank=rank, local_rank=rank)),
                    name=f"pagoda-tp-rank{rank}",
                    daemon=True,
                )
                worker.start()
                self.workers.append(worker)
            pids = ", ".join(f"rank {r} pid {w.pid}" for r, w in enumerate(self.workers, start=1))
            print(f"[pagoda] tensor parallel: {world_size} ranks; workers: {pids}", file=sys.stderr, flush=True)
            threading.Thread(target=self._watch, name="pagoda-tp-watchdog", daemon=True).start()
        try:
            self.groups: ParallelGroups = init_groups(rendezvous, self.device)
        except BaseException:
            self.shutdown()
            raise
        self.worker: Worker | None = None
        """Rank 0's Worker (its shard), built by EngineCore once the groups exist."""

    @property
    def placement(self) -> RankPlacement:
        """Where rank 0's Worker lives: this executor's device and process groups."""
        from engine.worker import RankPlacement

        return RankPlacement(self.device, self.groups)

    # ---- steps -------------------------------------------------------------------------------
    def run_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        blocks_to_copy: torch.Tensor | None,
        prompt_logprobs: "PromptLogprobRows | None" = None,
    ) -> torch.Tensor:
        """`ModelRunner.forward_step` under tensor parallelism: send the step to the worker
        ranks, then run rank 0's part (whose collectives meet theirs). The prompt-logprob
        rows stay on rank 0: the workers chunk the LM head alike by the row count alone."""
        self.check_workers()
        step = StepInputs(input_ids, positions, meta, blocks_to_copy)
        try:
            self.groups.send_control(encode_header(MessageKind.STEP, step))
            dist.broadcast(encode_payload(step), 0, group=self.groups.model)
            return self.worker.forward(input_ids, positions, meta, blocks_to_copy, prompt_logprobs)
        except Exception as e:
            self.check_workers()  # a dead worker is the better explanation
            self._fail(f"a step failed after the workers started it, so the ranks are out of step ({type(e).__name__}: {e})")
            raise self.failure from e

    def check_workers(self) -> None:
        """Raise TensorParallelError when the ranks cannot step together any more."""
        if self.failure is None:
            for rank, worker in enumerate(self.workers, start=1):
                if not worker.is_alive():
                    self._fail(f"tensor-parallel rank {rank} (pid {worker.pid}) exited with code {worker.exitcode}")
                    break
        if self.failure is not None:
            raise self.failure

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = TensorParallelError(reason)

    def _watch(self) -> None:
        """Wait on the workers' sentinels; report the first one to end unasked."""
        ready = multiprocessing.connection.wait([w.sentinel for w in self.workers])
        if self._closing:
            return
        for worker in self.workers:
            if worker.sentinel in ready:
                worker.join()  # its pipe closes a moment before the process can be reaped
        try:
            self.check_workers()
        except TensorParallelError as e:
            print(f"[pagoda] {e}", file=sys.stderr, flush=True)
            if self.on_failure is not None:
                self.on_failure(e)

    # ---- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell the workers to exit when they can still hear it, else end them; leave the groups."""
        if self._closing:
            return
        self._closing = True
        groups = getattr(self, "groups", None)
        in_step = groups is not None and self.failure is None and all(w.is_alive() for w in self.workers)
        if in_step:
            try:
                groups.send_control(encode_header(MessageKind.SHUTDOWN))
            except RuntimeError:
                in_step = False  # a worker went away meanwhile
        for worker in self.workers:
            if in_step:
                worker.join(timeout=_JOIN_TIMEOUT_S)
            if worker.is_alive():
                worker.kill()
            worker.join()
        if groups is not None:
            groups.destroy()
