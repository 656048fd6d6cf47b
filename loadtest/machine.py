"""How busy the machine was with other work while a run went on (Linux /proc; else None).

On a shared machine another process's CPU use skews every figure, so each run reports it:
other = (busy CPU seconds of the whole machine - this process's - the server's) / wall
seconds, busy = user + nice + system + irq + softirq from /proc/stat. The server's share
is known only for a server this tool started (its pid); for --base-url it counts as other.
A server started by loadtest/processes.py leads its own session, and its share is that
whole session's (vLLM's engine core is a second process in it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc `stat` file after the process name (field 3 on, at index 0);
    None if it cannot be read."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cpu_seconds(after_name: list[str], fields: int) -> float:
    """The sum of the first `fields` CPU-time fields (utime, stime, cutime, cstime) of
    `_stat_fields`' list, in seconds."""
    return sum(int(x) for x in after_name[11 : 11 + fields]) / os.sysconf("SC_CLK_TCK")


def _stat_seconds(path: str, fields: int) -> float | None:
    """`_cpu_seconds` of a /proc `stat` file; None if it cannot be read."""
    after_name = _stat_fields(path)
    return None if after_name is None else _cpu_seconds(after_name, fields)


def _process_seconds(pid: int) -> float | None:
    """user + system seconds of ``pid`` (all its threads) and of its reaped children."""
    return _stat_seconds(f"/proc/{pid}/stat", 4)


def _session_processes(session_id: int) -> Iterator[tuple[str, list[str]]]:
    """(pid, `_stat_fields`) of every process in session `session_id` that can still be read."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        after_name = _stat_fields(f"/proc/{entry}/stat")
        try:
            if after_name is not None and int(after_name[3]) == session_id:  # field 6: the session id
                yield entry, after_name
        except (IndexError, ValueError):
            continue


def _session_seconds(session_id: int) -> float | None:
    """user + system seconds (reaped children's included) of every process in session
    `session_id`; None where none can be read. A process that ends between two readings and
    is not reaped inside the session takes its seconds with it."""
    processes = list(_session_processes(session_id))
    if not processes:
        return None
    return sum(_cpu_seconds(after_name, 4) for _pid, after_name in processes)


def server_seconds(pid: int) -> float | None:
    """CPU seconds of a server: its whole session where it leads one (loadtest/processes.py
    starts servers so: vLLM's engine core, Pagoda's tensor-parallel ranks), else the process
    with its reaped children."""
    try:
        leads = os.getsid(pid) == pid
    except OSError:
        return None
    return _session_seconds(pid) if leads else _process_seconds(pid)


def thread_seconds(pid: int, tid: int) -> float | None:
    """user + system seconds of thread `tid` of process `pid` (its main thread: tid = pid)."""
    return _stat_seconds(f"/proc/{pid}/task/{tid}/stat", 2)


class OtherCpu:
    """Started at construction; ``cores()`` is the other processes' average CPU use since."""

    def __init__(self, server_pid: int | None = None) -> None:
        self.server_pid = server_pid
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float, float] | None:
        busy = _busy_seconds()
        if busy is None:
            return None
        own = os.times()
        server = server_seconds(self.server_pid) if self.server_pid else 0.0
        return busy, own.user + own.system, server or 0.0, time.perf_counter()

    def cores(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        busy, own, server, wall = (e - s for e, s in zip(end, self._start))
        return max(0.0, busy - own - server) / wall if wall > 0 else None


def session_memory_mib(session_id: int) -> float | None:
    """Proportional set size (PSS, MiB) of every process in session `session_id`: a server
    started by loadtest/processes.py leads its own session, so this is the server with all
    its workers (vLLM's engine core and worker processes, Pagoda's tensor-parallel ranks).
    PSS splits pages shared between them, so shared libraries and shared memory count once.
    None where /proc has no smaps_rollup."""
    total_kib, found = 0, False
    for pid, _fields in _session_processes(session_id):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total_kib += int(line.split()[1])
                        found = True
                        break
        except (OSError, IndexError, ValueError):
            continue
    return total_kib / 1024 if found else None
