"""How much host memory this process can still take: the least of what the kernel would hand
out (/proc/meminfo `MemAvailable`) and what its cgroup's memory limit leaves.

A container's /proc/meminfo shows the host's memory, not the container's: `docker --memory 8g`
or a Kubernetes memory limit lives in the cgroup, cgroup v2 `memory.max` (less `memory.current`)
or v1 `memory/memory.limit_in_bytes` (less `memory.usage_in_bytes`), on the process's own cgroup
or any folder above it. What the cgroup counts includes the page cache, which the kernel
drops before it kills anyone, so the inactive file pages (`memory.stat`) count as free, as
`docker stats` counts them. Exceeding the limit is an OOM kill, not a slow path, so what the
engine adds at start-up beyond the weights and the KV cache (the 12-bit weight copies,
engine/models/llama.py `FusedDecodeLayers`) is made only where this says it fits.
"""

from __future__ import annotations

from pathlib import Path

from engine.cpu_threads import CGROUP_ROOT, PROC_CGROUP, _levels, _own_cgroup_paths

MEMINFO = Path("/proc/meminfo")
# cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712).
_V1_NO_LIMIT = 1 << 62


def meminfo_available(meminfo: Path = MEMINFO) -> int | None:
    """`MemAvailable` in bytes: free memory plus what the kernel can reclaim without swapping."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_memory_headroom(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Bytes left under the tightest cgroup memory limit on the way from this process's own
    cgroup up to the hierarchy's root (limit - usage + inactive file pages); None when no
    level sets a limit or none can be read. cgroup v2 first, else v1's `memory` controller."""
    v2_path, v1_path = _own_cgroup_paths(proc_cgroup, "memory")
    headrooms: list[int] = []
    for level in _levels(root, v2_path):
        limit = _read_int(level / "memory.max")
        used = _read_int(level / "memory.current")
        if limit is not None and used is not None:
            headrooms.append(limit - used + _inactive_file(level / "memory.stat", "inactive_file"))
    if headrooms:
        return max(0, min(headrooms))
    for level in _levels(root / "memory", v1_path):
        limit = _read_int(level / "memory.limit_in_bytes")
        used = _read_int(level / "memory.usage_in_bytes")
        if limit is not None and used is not None and limit < _V1_NO_LIMIT:
            headrooms.append(limit - used + _inactive_file(level / "memory.stat", "total_inactive_file"))
    return max(0, min(headrooms)) if headrooms else None


def available_host_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP,
                          meminfo: Path = MEMINFO) -> tuple[int | None, str]:
    """(bytes this process can still allocate, how that was found); None where neither
    /proc/meminfo nor a cgroup limit could be read (not Linux)."""
    host = meminfo_available(meminfo)
    cgroup = cgroup_memory_headroom(root, proc_cgroup)
    if cgroup is not None and (host is None or cgroup < host):
        return cgroup, f"{cgroup / 2**30:.1f} GiB under the cgroup's memory limit"
    if host is not None:
        return host, f"{host / 2**30:.1f} GiB MemAvailable" + (", no cgroup memory limit" if cgroup is None else "")
    return None, "host memory unknown (no /proc/meminfo)"
