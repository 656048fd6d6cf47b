"""Rendezvous and process groups of the tensor-parallel ranks, on torch.distributed.

Two groups join the same ranks:

- the model group (the default group: NCCL on CUDA, gloo on CPU) carries the forward
  pass's all-reduces, the logits gather and the step payload. Its timeout is bounded
  (`MODEL_TIMEOUT`): a rank that stops answering in the middle of a step fails the step
  on the others instead of hanging them. A rank that dies is noticed at once anyway (its
  connections close).
- the control group (gloo, CPU) carries the small step header and the start-up
  agreement. An idle worker waits on it for the next step for as long as the server is
  idle, so it has no practical deadline; rank 0's sends on it are bounded by
  MODEL_TIMEOUT instead (`send_control`).

Rendezvous is torch's env-var one: `MASTER_ADDR` / `MASTER_PORT` (a free local port when
unset) for ranks the engine spawns itself; `RANK`, `WORLD_SIZE`, `LOCAL_RANK` when
`torchrun` launched every rank (multi-node: `torchrun --nnodes --node-rank --master-addr
--master-port`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.cpu_threads import choose_cpu_threads

MODEL_TIMEOUT = timedelta(seconds=120)
"""Longest wait for the other ranks inside a step: they run the same work, so any wait
this long means a rank hangs (a dead rank is noticed at once)."""
STARTUP_TIMEOUT = timedelta(minutes=10)
"""Longest wait for every rank to join (spawned interpreters import torch first)."""
CONTROL_TIMEOUT = timedelta(days=3650)
"""An idle server's workers wait for the next step on the control group: no deadline."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and as whom one rank joins the group."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def torchrun_rendezvous() -> Rendezvous | None:
    """This process's place when `torchrun` (or any env-var launcher) started it, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return Rendezvous(
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(os.environ.get("MASTER_PORT", "29500")),
        rank=rank,
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
    )


def local_rendezvous(world_size: int) -> Rendezvous:
    """Rank 0's place when it spawns the other ranks on this machine: MASTER_ADDR /
    MASTER_PORT if set, else loopback and a port that is free now."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else _free_port(addr)
    return Rendezvous(addr, port, rank=0, world_size=world_size, local_rank=0)


def _free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """One GPU per rank on this machine; every CPU rank shares the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", local_rank)
    return device


@dataclass(slots=True)
class ParallelGroups:
    rank: int
    world_size: int
    model: dist.ProcessGroup
    control: dist.ProcessGroup

    def send_control(self, message: torch.Tensor) -> None:
        """Rank 0's broadcast on the control group, bounded by MODEL_TIMEOUT: the workers
        wait for it without a deadline, but a worker that stopped taking messages (gloo's
        send waits for the receiver) must not hang rank 0."""
        dist.broadcast(message, 0, group=self.control, async_op=True).wait(timeout=MODEL_TIMEOUT)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_groups(rendezvous: Rendezvous, device: torch.device) -> ParallelGroups:
    """Join the ranks (blocks until all of them have joined, up to STARTUP_TIMEOUT)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # torch's own rendezvous (it also knows torchrun's agent store), with the start-up
    # deadline; the group's collectives get the step deadline.
    store, _, _ = next(
        dist.rendezvous(rendezvous.init_method, rendezvous.rank, rendezvous.world_size, timeout=STARTUP_TIMEOUT)
    )
    dist.init_process_group(
        backend, store=store, rank=rendezvous.rank, world_size=rendezvous.world_size, timeout=MODEL_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ParallelGroups(rendezvous.rank, rendezvous.world_size, dist.group.WORLD, control)


def cpu_threads_per_rank(world_size: int, requested: int | None = None) -> int:
    """CPU ranks on one machine split the CPUs the process can get (each rank's own OpenMP
    team would otherwise oversubscribe them); `--cpu-threads` (per rank) or an explicit
    OMP_NUM_THREADS wins (engine/cpu_threads.py)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return choose_cpu_threads(requested, ranks_here)[0]


def agree_num_blocks(groups: ParallelGroups, num_blocks: int) -> int:
    """Every rank allocates the same number of KV blocks: the fewest any rank has room for."""
    n = torch.tensor([num_blocks], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=groups.control)
    return int(n.item())
