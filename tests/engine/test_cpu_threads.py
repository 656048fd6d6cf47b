"""The CPU kernels' thread count follows the CPUs the process can get: its affinity mask
and its cgroup CPU quota (engine/cpu_threads.py), or --cpu-threads; the choice is logged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.cpu_threads import available_cpus, cgroup_cpu_limit, choose_cpu_threads


@pytest.mark.parametrize("files, limit", [
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
], ids=["v2_quota", "v2_unlimited", "v1_quota", "v1_unlimited", "no_cgroup"])
def test_cgroup_cpu_quota_is_read_in_both_versions(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path, _in_cgroup(tmp_path, "/", "/")) == limit


def _in_cgroup(tmp_path, v2: str, v1: str):
    """A /proc/self/cgroup of a process in cgroup v2 path `v2` and v1 cpu path `v1`."""
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"12:memory:/x\n4:cpu,cpuacct:{v1}\n0::{v2}\n")
    return proc


def _write(root, name: str, text: str) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)


def test_a_quota_on_the_process_own_cgroup_or_above_it_is_found(tmp_path):
    """On a host (no cgroup namespace) the process's cgroup sits below the mount's root:
    the quota there (`systemd-run -p CPUQuota=100%`, a cgroup made by hand) or on a folder
    above it caps the process; the smallest one counts."""
    root = tmp_path / "fs"
    _write(root, "cpu.max", "max 100000\n")
    _write(root, "pods/a/cpu.max", "300000 100000\n")
    _write(root, "pods/a/b/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(root, _in_cgroup(tmp_path, "/pods/a/b", "/")) == 3.0
    _write(root, "pods/a/b/cpu.max", "100000 100000\n")
    assert cgroup_cpu_limit(root, _in_cgroup(tmp_path, "/pods/a/b", "/")) == 1.0
    assert cgroup_cpu_limit(root, _in_cgroup(tmp_path, "/elsewhere", "/")) is None  # not this process's
    # cgroup v1: the cpu controller's own hierarchy and path.
    v1 = tmp_path / "v1"
    _write(v1, "cpu/cpu.cfs_quota_us", "-1\n")
    _write(v1, "cpu/cpu.cfs_period_us", "100000\n")
    _write(v1, "cpu/bench/cpu.cfs_quota_us", "150000\n")
    _write(v1, "cpu/bench/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(v1, _in_cgroup(tmp_path, "/", "/bench")) == 1.5
    assert cgroup_cpu_limit(v1, _in_cgroup(tmp_path, "/", "/")) is None
    n, why = available_cpus(root, _in_cgroup(tmp_path, "/pods/a/b", "/"))
    assert n == 1 and "a cgroup CPU quota of 1 CPU (" in why


def test_a_quota_below_the_affinity_mask_wins_and_never_gives_zero(tmp_path):
    proc = _in_cgroup(tmp_path, "/", "/")
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU
    n, why = available_cpus(tmp_path, proc)
    assert n == 1 and "quota of 0.5 CPUs" in why
    (tmp_path / "cpu.max").write_text("6400000 100000\n")  # 64 CPUs: the mask is smaller
    n, why = available_cpus(tmp_path, proc)
    assert n == len(os.sched_getaffinity(0)) and "affinity mask" in why


def test_the_flag_wins_and_is_checked():
    assert choose_cpu_threads(3) == (3, "--cpu-threads")
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        EngineConfig.from_engine_args(cpu_threads=0)


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_one_cpu_in_the_affinity_mask_gives_one_thread_and_says_why(tiny_model_path):
    run = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "server.cli", "generate", "Hi", "--model",
                          str(tiny_model_path), "--max-tokens", "2"], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert run.returncode == 0, run.stderr[-2000:]
    fact = next(line for line in run.stderr.splitlines() if line.startswith("[pagoda] cpu_threads:"))
    assert fact.startswith("[pagoda] cpu_threads: 1 (") and "1 CPU in the affinity mask" in fact, fact


def test_one_cpu_of_cgroup_quota_gives_one_thread_and_says_why():
    """A real cgroup with a quota of one CPU (loadtest/cpu_quota.py; a container's `--cpus 1`):
    a process in it, whose cgroup sits below the mount's root here, finds the quota itself
    and chooses one thread (the start-up fact's wording; the CLI's fact itself is checked
    end to end under taskset above)."""
    from loadtest.cpu_quota import cpu_quota_cgroup

    probe = ("from engine.cpu_threads import choose_cpu_threads; n, why = choose_cpu_threads(None); "
             "print(n); print(why)")
    with cpu_quota_cgroup(1.0) as wrap:
        if wrap is None:
            pytest.skip("no cgroup can be made here (needs write access to /sys/fs/cgroup)")
        run = subprocess.run(wrap([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    assert run.returncode == 0, run.stderr[-2000:]
    n, why = run.stdout.splitlines()[-2:]
    assert n == "1" and "a cgroup CPU quota of 1 CPU" in why, run.stdout


@pytest.mark.parametrize("first, env, policy, torch_loaded", [
    ("import engine", {}, "passive", True),
    ("from engine import LLM", {}, "passive", True),  # the Python API as `pagoda` runs
    ("import loadtest.bench_offline", {}, "passive", True),  # the benchmarks' in-process engines too
    ("from server.cli import main", {}, "None", False),  # the CLI module alone loads neither (main does)
    ("import engine", {"OMP_WAIT_POLICY": "active"}, "active", True),  # the user's choice is kept
    ("import engine", {"PAGODA_CPU_LOOPS": "openmp"}, "None", True),  # the kernels on OpenMP's team: its default
    ("import torch, engine", {}, "None", True),  # torch loaded first: too late for libgomp, left alone
])
def test_importing_the_engine_asks_passive_openmp_threads(first, env, policy, torch_loaded):
    """The engine package (and the benchmarks' package) set OMP_WAIT_POLICY=passive before
    they load torch, whose libgomp reads it then: torch's idle threads leave the work pool's
    cores free, for `pagoda`, `LLM` and the benchmarks alike."""
    probe = f"{first}; import os, sys; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PAGODA_CPU_LOOPS")}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=base | env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == [policy, str(torch_loaded)]


def test_pagoda_main_imports_the_engine_before_anything_loads_torch():
    """`pagoda`'s entry point: the policy is in place by the time torch is loaded."""
    probe = ("import sys, server.cli as cli; assert 'torch' not in sys.modules\n"
             "def stop(*a, **k):\n"
             "    import os; print(os.environ.get('OMP_WAIT_POLICY')); raise SystemExit(0)\n"
             "cli.build_parser = stop\n"
             "cli.main([])")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PAGODA_CPU_LOOPS")}
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=base)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "passive"
