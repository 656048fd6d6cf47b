"""How many threads the CPU kernels use: the CPUs this process may actually run on.

Every CPU kernel (torch's and Pagoda's C++ ones, kernels/csrc/cpu_kernels.cpp) splits its
work over `at::get_num_threads()` OpenMP threads that meet at barriers. More threads than
CPUs the process can get means a thread is descheduled mid-step and the others wait for
it at the next barrier, so a step stalls for a time slice. The CPUs a process gets are
the fewest of:

- its affinity mask (`taskset -c 0`, Kubernetes' static CPU manager, `docker --cpuset-cpus`);
- its cgroup's CPU quota (`docker --cpus 1.5`, a Kubernetes CPU limit): cgroup v2
  `cpu.max` ("150000 100000" = 1.5 CPUs) or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`,
  rounded down (a fraction of a CPU is a thread that runs only part of each period).

`--cpu-threads N` sets it by hand; an explicit `OMP_NUM_THREADS` is kept as well. The choice
and why is a start-up fact (`cpu_threads: ...`). Tensor-parallel ranks on one machine split
the count (engine/distributed/parallel_state.py).

Pagoda's C++ kernels run their loops on a work pool of their own (kernels/csrc/work_pool.h);
torch's own ops run on OpenMP's team, whose idle threads by default spin for ~300,000
pauses (milliseconds) after every parallel op, on the cores the pool's threads need
(loadtest/bench_noise.py's quiet A/B shows what that costs). `pagoda` therefore starts with
OMP_WAIT_POLICY=passive (server/cli.py `prefer_passive_openmp`, before torch loads; a value
the user set is kept): torch's idle threads sleep at once, each parallel torch op pays a wake-up instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in CPUs (1.5 = one and a half), None when there is none or
    it cannot be read. Reads the cgroup the process sees at `root` (a container's own)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # cgroup v1
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def available_cpus(root: Path = CGROUP_ROOT) -> tuple[int, str]:
    """(CPUs this process can run threads on at once, how that was found)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    why = f"{affinity} CPU{'s' if affinity != 1 else ''} in the affinity mask"
    limit = cgroup_cpu_limit(root)
    if limit is None:
        return affinity, why + ", no cgroup CPU quota"
    quota_cpus = max(1, math.floor(limit))
    if quota_cpus < affinity:
        return quota_cpus, f"a cgroup CPU quota of {limit:g} CPUs ({why})"
    return affinity, f"{why}, a cgroup CPU quota of {limit:g} CPUs"


def choose_cpu_threads(requested: int | None, world_size: int = 1) -> tuple[int, str]:
    """(threads per rank, why): `--cpu-threads` if given, else an explicit OMP_NUM_THREADS,
    else the available CPUs split over the `world_size` ranks on this machine."""
    if requested is not None:
        return requested, "--cpu-threads"
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    cpus, why = available_cpus()
    if world_size > 1:
        return max(1, cpus // world_size), f"{why}, split over {world_size} ranks"
    return cpus, why


def openmp_wait_policy() -> str:
    """What torch's OpenMP threads do while idle, for the start-up fact."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    return f"OMP_WAIT_POLICY={policy}" if policy else "OMP_WAIT_POLICY unset: torch's idle OpenMP threads spin"


def apply_cpu_threads(requested: int | None) -> str:
    """Set this process's kernel threads (call it on the thread that runs the kernels,
    before the model loads) and return the start-up fact."""
    n, why = choose_cpu_threads(requested)
    torch.set_num_threads(n)
    return f"{n} ({why}; {openmp_wait_policy()})"
