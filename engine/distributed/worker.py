"""A tensor-parallel worker (rank > 0): its shard of the model and KV cache, stepping when rank 0 says.

The scheduler, block manager and sampler live on rank 0 only. A worker builds the same
shard layout from the same configuration, then loops: wait for a step header on the
control group, take the payload, run the same forward pass (its collectives meet rank
0's), repeat until the shutdown message. Any error ends the process, which the other
ranks notice at their next collective (the connections close).

Spawned by rank 0 (`worker_main`, multiprocessing spawn) on one machine, or run by
`pagoda serve` / `pagoda generate` itself on every rank but 0 under `torchrun`.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.parallel_state import (
    ParallelGroups,
    Rendezvous,
    cpu_threads_per_rank,
    init_groups,
    rank_device,
)
from engine.distributed.step_message import HEADER_LEN, MessageKind, decode, payload_len

if TYPE_CHECKING:
    from engine.worker import Worker


def worker_main(config: EngineConfig, rendezvous: Rendezvous) -> None:
    """The process entry of a spawned worker rank; exits non-zero on any error."""
    try:
        run_worker(config, rendezvous)
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        trace = traceback.format_exc()
        print(f"[pagoda] tensor-parallel rank {rendezvous.rank} failed:\n{trace}", file=sys.stderr, flush=True)
        sys.exit(1)


def run_worker(config: EngineConfig, rendezvous: Rendezvous) -> None:
    from engine.default_model import resolve_model_path
    from engine.worker import RankPlacement, Worker

    mc = config.model
    if rendezvous.world_size != config.parallel.tensor_parallel_size:
        raise ValueError(
            f"{rendezvous.world_size} ranks were started for tensor_parallel_size {config.parallel.tensor_parallel_size}"
        )
    device = rank_device(mc.torch_device, rendezvous.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(rendezvous.world_size, config.kernel.cpu_threads))
    print(
        f"[pagoda] tensor-parallel rank {rendezvous.rank}/{rendezvous.world_size}: pid {os.getpid()}, {device}",
        file=sys.stderr,
        flush=True,
    )
    groups = init_groups(rendezvous, device)
    # The same model side as rank 0's: load, shard, prepack, size and allocate the KV cache.
    worker = Worker(config, resolve_model_path(mc.model), RankPlacement(device, groups), log=False)
    serve_steps(worker, groups)
    groups.destroy()


def serve_steps(worker: Worker, groups: ParallelGroups) -> None:
    """Run every step rank 0 broadcasts, until it sends the shutdown message."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            dist.broadcast(header, 0, group=groups.control)
            if header[0] == MessageKind.SHUTDOWN:
                return
            payload = torch.empty(payload_len(header), dtype=torch.int64, device=worker.device)
            dist.broadcast(payload, 0, group=groups.model)
            step = decode(header, payload)
            worker.forward(step.input_ids, step.positions, step.meta, step.blocks_to_copy)
