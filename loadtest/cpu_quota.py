"""A cgroup with a CPU quota, made for one command: a container's `--cpus 1` without the container.

    with cpu_quota_cgroup(1.0) as wrap:          # None where no cgroup can be made here
        subprocess.run(wrap(["pagoda", "serve"]))

The cgroup is made under the CPU controller's hierarchy, cgroup v2 (`cpu.max`) where the
unified hierarchy has the `cpu` controller, else v1's `cpu` mount (`cpu.cfs_quota_us`); the
command joins it as it starts (a shell writes its own pid into `cgroup.procs`, then execs
the command, so every thread and child it starts is in the cgroup too). On leaving, the
cgroup's processes must be gone (stop the server first); the folder is removed.

Needs write access to the cgroup file system (root on a VM or a privileged container);
`cpu_quota_cgroup` yields None where that is missing, and callers skip.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _v2_parent(root: Path) -> Path | None:
    """The unified hierarchy's root, when the `cpu` controller is on for its children."""
    for base in (root, root / "unified"):
        try:
            if "cpu" in (base / "cgroup.subtree_control").read_text().split():
                return base
        except OSError:
            continue
    return None


def _v1_parent(root: Path) -> Path | None:
    base = root / "cpu"
    return base if (base / "cpu.cfs_quota_us").exists() else None


@contextlib.contextmanager
def cpu_quota_cgroup(cpus: float, root: Path = CGROUP_ROOT,
                     name: str | None = None) -> Iterator[Callable[[list[str]], list[str]] | None]:
    """Yields `wrap(command) -> command` that runs `command` in a fresh cgroup whose CPU
    quota is `cpus` CPUs, or None where no such cgroup can be made."""
    name = name or f"pagoda-quota-{os.getpid()}-{time.monotonic_ns()}"
    quota_us = max(1000, int(cpus * PERIOD_US))
    folder = None
    for parent, files in ((_v2_parent(root), {"cpu.max": f"{quota_us} {PERIOD_US}"}),
                          (_v1_parent(root), {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(quota_us)})):
        if parent is None:
            continue
        try:
            (parent / name).mkdir()
        except OSError:
            continue
        folder = parent / name
        try:
            for file, text in files.items():
                (folder / file).write_text(text)
        except OSError:
            folder.rmdir()
            folder = None
            continue
        break
    procs = folder / "cgroup.procs" if folder is not None else None
    # A cgroup that takes no process (cgroup v2's rule against processes in inner nodes, a
    # delegated subtree without write access to cgroup.procs) is no use: check with a shell.
    if procs is not None and subprocess.run(["sh", "-c", 'echo $$ > "$0"', str(procs)],
                                            capture_output=True).returncode != 0:
        _remove(folder)
        procs = None
    if procs is None:
        yield None
        return

    def wrap(command: list[str]) -> list[str]:
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *command]

    try:
        yield wrap
    finally:
        _remove(folder)


def _remove(folder: Path) -> None:
    for _ in range(50):  # the last process's threads may still be leaving
        try:
            folder.rmdir()
            return
        except OSError:
            time.sleep(0.1)
