"""What host memory the engine can still take (engine/host_memory.py): /proc/meminfo's
MemAvailable and the cgroup's memory limit (v2 and v1, on the process's own cgroup or above
it), and the engine's 12-bit weight copies made only where they fit beside the KV cache."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from engine.host_memory import available_host_memory, cgroup_memory_headroom, meminfo_available

GiB = 2**30


def _write(root: Path, name: str, text: str) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)


def _in_cgroup(tmp_path: Path, v2: str, v1_memory: str) -> Path:
    """A /proc/self/cgroup of a process in cgroup v2 path `v2` and v1 memory path `v1_memory`."""
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"4:memory:{v1_memory}\n3:cpu,cpuacct:/other\n0::{v2}\n")
    return proc


def test_meminfo_available_is_read_in_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:    8388608 kB\n")
    assert meminfo_available(meminfo) == 8 * GiB
    meminfo.write_text("MemTotal:       24576000 kB\n")
    assert meminfo_available(meminfo) is None
    assert meminfo_available(tmp_path / "missing") is None


def test_cgroup_v2_headroom_is_the_tightest_limit_less_usage_plus_inactive_files(tmp_path):
    """A pod's limit above the container's own cgroup counts too; the page cache's inactive
    file pages are what the kernel frees before an OOM kill, so they count as free."""
    root = tmp_path / "fs"
    _write(root, "memory.max", "max\n")
    _write(root, "memory.current", f"{20 * GiB}\n")
    _write(root, "pod/memory.max", f"{8 * GiB}\n")
    _write(root, "pod/memory.current", f"{3 * GiB}\n")
    _write(root, "pod/memory.stat", f"anon {2 * GiB}\ninactive_file {GiB}\nactive_file 0\n")
    _write(root, "pod/c/memory.max", "max\n")
    _write(root, "pod/c/memory.current", f"{3 * GiB}\n")
    proc = _in_cgroup(tmp_path, "/pod/c", "/")
    assert cgroup_memory_headroom(root, proc) == 6 * GiB
    _write(root, "pod/c/memory.max", f"{4 * GiB}\n")  # the container's own, tighter
    assert cgroup_memory_headroom(root, proc) == 1 * GiB
    assert cgroup_memory_headroom(root, _in_cgroup(tmp_path, "/elsewhere", "/")) is None


def test_cgroup_v1_no_limit_is_none_and_a_limit_is_read(tmp_path):
    root = tmp_path / "fs"
    _write(root, "memory/memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    _write(root, "memory/memory.usage_in_bytes", f"{GiB}\n")
    proc = _in_cgroup(tmp_path, "/", "/jobs/a")
    assert cgroup_memory_headroom(root, proc) is None
    _write(root, "memory/jobs/a/memory.limit_in_bytes", f"{6 * GiB}\n")
    _write(root, "memory/jobs/a/memory.usage_in_bytes", f"{4 * GiB}\n")
    _write(root, "memory/jobs/a/memory.stat", f"cache 0\ntotal_inactive_file {GiB // 2}\n")
    assert cgroup_memory_headroom(root, proc) == 2 * GiB + GiB // 2


def test_the_least_of_meminfo_and_the_cgroup_is_what_is_available(tmp_path):
    root = tmp_path / "fs"
    _write(root, "memory.max", f"{4 * GiB}\n")
    _write(root, "memory.current", f"{GiB}\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {16 * 2**20} kB\n")
    proc = _in_cgroup(tmp_path, "/", "/")
    assert available_host_memory(root, proc, meminfo) == (3 * GiB, "3.0 GiB under the cgroup's memory limit")
    meminfo.write_text(f"MemAvailable: {2 * 2**20} kB\n")
    assert available_host_memory(root, proc, meminfo) == (2 * GiB, "2.0 GiB MemAvailable")
    assert available_host_memory(tmp_path / "none", proc, meminfo) == (
        2 * GiB, "2.0 GiB MemAvailable, no cgroup memory limit")
    assert available_host_memory(tmp_path / "none", proc, tmp_path / "missing")[0] is None


V1_MEMORY = Path("/sys/fs/cgroup/memory")


def _own_v1_memory_cgroup() -> Path | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return V1_MEMORY.joinpath(*[p for p in path.split("/") if p])
    except (OSError, ValueError):
        return None
    return None


def test_a_real_cgroup_v1_memory_limit_is_read(tmp_path):
    """The kernel's own files: a memory cgroup made under this process's (where the machine
    lets it: cgroup v1, root), limited to 3 GB, empty: all of the limit is headroom."""
    own = _own_v1_memory_cgroup()
    if own is None or not os.access(own, os.W_OK):
        pytest.skip("no writable cgroup v1 memory hierarchy here")
    child = own / f"pagoda-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup: {e}")
    try:
        (child / "memory.limit_in_bytes").write_text("3000000000")
        limit = int((child / "memory.limit_in_bytes").read_text())  # rounded down to a page
        relative = "/" + str(child.relative_to(V1_MEMORY))
        proc = tmp_path / "proc-self-cgroup"
        proc.write_text(f"4:memory:{relative}\n0::/\n")
        assert cgroup_memory_headroom(Path("/sys/fs/cgroup"), proc) == limit
        assert 2_999_000_000 < limit <= 3_000_000_000
    finally:
        child.rmdir()


@pytest.mark.slow
def test_an_engine_short_of_memory_makes_no_12bit_copy_says_so_and_gives_the_same_tokens(
        default_model_path, monkeypatch):
    """The bundled model in bf16 on a host that (as a cgroup limit the test cannot impose on
    its own process would say) has room for the KV cache and the headroom but not the 153 MiB
    of copies: the engine starts without them, its `decode_layers` fact says why, and its
    greedy tokens are those of an engine with them."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.worker import C12_HEADROOM_BYTES
    from kernels import cpu_kernels

    if not cpu_kernels.c12_available():
        pytest.skip("the 12-bit copies need AVX512-VBMI2")
    kv = 0.05
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with_copies = LLM(str(default_model_path), dtype="bfloat16", kv_cache_memory=kv, max_model_len=256)
    assert "12-bit copy (153 MiB more" in with_copies.engine_core.facts()["decode_layers"]
    expected = [r.outputs[0].token_ids for r in with_copies.generate(prompts, params)]
    del with_copies
    short = int(kv * GiB) + C12_HEADROOM_BYTES + 100 * 2**20
    monkeypatch.setattr("engine.worker.available_host_memory", lambda: (short, "a test's 1.2 GiB"))
    without = LLM(str(default_model_path), dtype="bfloat16", kv_cache_memory=kv, max_model_len=256)
    fact = without.engine_core.facts()["decode_layers"]
    assert "no 12-bit copy: it needs 153 MiB" in fact and "(host: a test's 1.2 GiB)" in fact, fact
    assert without.engine_core.facts()["lm_head"].startswith("bfloat16")
    assert [r.outputs[0].token_ids for r in without.generate(prompts, params)] == expected
