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
OMP_WAIT_POLICY=passive (engine/__init__.py `prefer_passive_openmp`, before torch loads; a value
the user set is kept): torch's idle threads sleep at once, each parallel torch op pays a wake-up instead.
INT4 and INT8 linears run C++ kernels on the pool too (where the kernels build with
AVX512-BF16), so a decode step has no parallel torch op left.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _own_cgroup_paths(proc_cgroup: Path, controller: str = "cpu") -> tuple[str | None, str | None]:
    """(the cgroup v2 path, the v1 `controller`'s path) of this process, from
    /proc/self/cgroup ("0::/a/b" and "4:cpu,cpuacct:/a/b"); None where a line is missing.
    Inside a container with its own cgroup namespace both read "/"."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v2, v1


def _levels(base: Path, path: str | None) -> list[Path]:
    """`base / path` and each folder above it up to `base` itself: a quota set on any of
    them caps this process (a container's, a systemd slice's, a pod's parent)."""
    parts = [p for p in (path or "/").split("/") if p and p != ".."]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The cgroup's CPU quota in CPUs (1.5 = one and a half), None when there is none or
    it cannot be read: the smallest quota on the way from this process's own cgroup (read
    from `proc_cgroup`) up to the hierarchy's root at `root`, cgroup v2 `cpu.max` first,
    else v1's `cpu/cpu.cfs_quota_us` / `cpu.cfs_period_us`. In a container the process's
    cgroup is the mount's root; on a host it may sit deeper (`systemd-run -p CPUQuota=`,
    a cgroup made by hand), where the root's files say nothing about it."""
    v2_path, v1_path = _own_cgroup_paths(proc_cgroup)
    limits: list[float] = []
    for level in _levels(root, v2_path):
        try:
            quota, period = (level / "cpu.max").read_text().split()[:2]
            if quota != "max":
                limits.append(int(quota) / int(period))
        except (OSError, ValueError):
            continue
    if limits:
        return min(limits)
    for level in _levels(root / "cpu", v1_path):
        try:
            quota_us = int((level / "cpu.cfs_quota_us").read_text())
            period_us = int((level / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota_us > 0 and period_us > 0:
            limits.append(quota_us / period_us)
    return min(limits) if limits else None


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, str]:
    """(CPUs this process can run threads on at once, how that was found)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    why = f"{affinity} CPU{'s' if affinity != 1 else ''} in the affinity mask"
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is None:
        return affinity, why + ", no cgroup CPU quota"
    quota_cpus = max(1, math.floor(limit))
    quota = f"a cgroup CPU quota of {limit:g} CPU{'' if limit == 1 else 's'}"
    if quota_cpus < affinity:
        return quota_cpus, f"{quota} ({why})"
    return affinity, f"{why}, {quota}"


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
