"""The CPU kernels' work pool (kernels/csrc/work_pool.h): every parallel loop's chunks are
claimed by whichever threads are running, so a descheduled thread stalls nothing.

What a user would notice if it were wrong: other bits than before (the pool must compute
what OpenMP's team computed, at any thread count, including more threads than CPUs), a
hang (more threads than CPUs in the affinity mask; a forked child, whose parent's workers
are gone; two Python threads in the kernels at once), or wrong results for one of two
concurrent callers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kernels import cpu_kernels
from tests.kernels.paged_batches import make_batch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the pool's kernels need AVX512-BF16")


def _module():
    return cpu_kernels.load()


def _outputs() -> dict[str, torch.Tensor]:
    """One output of each kind of parallel loop: GEMV pieces (1 and 3 rows), GEMM pieces (37
    rows), the MLP, attention (a batch-1 decode's key parts; a prefill beside decodes on the
    invariant route), LoRA (the few-row shrink/expand pieces and a row per chunk), RMSNorm."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 576, generator=g).bfloat16()
    packed = cpu_kernels.pack_bf16_weight(weight)
    out = {}
    for rows in (1, 3, 37):
        out[f"linear{rows}"] = cpu_kernels.bf16_linear(torch.randn(rows, 576, generator=g).bfloat16(), packed)
    gate_up = cpu_kernels.pack_bf16_weight(torch.randn(2 * 320, 576, generator=g).bfloat16() / 24)
    down = cpu_kernels.pack_bf16_weight(torch.randn(576, 320, generator=g).bfloat16() / 18)
    out["mlp"] = cpu_kernels.bf16_silu_mlp(torch.randn(2, 576, generator=g).bfloat16(), gate_up, down)
    decode = make_batch([(1500, 1)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                        dtype=torch.bfloat16, block_order="shuffled", seed=1)
    out["attention_parts"] = cpu_kernels.paged_attention(*decode.args(), decode.scale)
    mixed = make_batch([(300, 40), (500, 1), (77, 1)], num_heads=4, num_kv_heads=2, head_dim=128, block_size=16,
                       dtype=torch.bfloat16, block_order="shuffled", seed=2)
    out["attention_invariant"] = cpu_kernels.paged_attention(*mixed.args(), mixed.scale, invariant=True)
    a = (torch.randn(16, 576, generator=g) / 24).bfloat16()
    b_pairs = (torch.randn(8, 2 * 1000, generator=g) / 4).bfloat16()
    offsets = torch.tensor([0, 8, 16], dtype=torch.int64)
    for rows in (1, 9):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        y = torch.randn(rows, 1000, generator=g).bfloat16()
        groups = torch.tensor([(0, 1, -1)[i % 3] for i in range(rows)], dtype=torch.int64)
        cpu_kernels.lora_add(y, x, a, b_pairs, groups, offsets)
        out[f"lora{rows}"] = y
    x = torch.randn(40, 576, generator=g).bfloat16()
    norm_out, residual = torch.empty_like(x), torch.empty_like(x)
    _module().add_rms_norm(norm_out, residual, x, x, torch.randn(576, generator=g).bfloat16(), 1e-5)
    out["norm"], out["residual"] = norm_out, residual
    return out


def _with(openmp: bool, threads: int) -> dict[str, torch.Tensor]:
    m = _module()
    before_loops, before_threads = m.set_openmp_loops(openmp), m.set_kernel_threads(threads)
    try:
        return _outputs()
    finally:
        m.set_openmp_loops(before_loops)
        m.set_kernel_threads(before_threads)


def test_the_pool_gives_openmps_bits_at_every_thread_count():
    """The same bits under OpenMP's team (the kernels before the pool) and on the pool with
    1, 2, 3 and 7 threads (more than this machine's CPUs: oversubscribed)."""
    want = _with(openmp=True, threads=2)
    for threads in (1, 2, 3, 7):
        got = _with(openmp=False, threads=threads)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"{name} differs on the pool with {threads} threads"


def test_a_wrong_result_would_be_seen():
    """The comparison above has teeth: another input gives other bits."""
    g = torch.Generator().manual_seed(0)
    packed = cpu_kernels.pack_bf16_weight(torch.randn(1000, 576, generator=g).bfloat16())
    x = torch.randn(1, 576, generator=g).bfloat16()
    y = x.clone()
    y[0, 0] = y[0, 0] + 1
    assert not torch.equal(cpu_kernels.bf16_linear(x, packed), cpu_kernels.bf16_linear(y, packed))


def _run_python(code: str, taskset: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    if taskset:
        cmd = ["taskset", "-c", taskset, *cmd]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_four_threads_on_one_cpu_finish_with_the_same_bits():
    """Four kernel threads in a process whose affinity mask holds one CPU: three of them are
    never running while the fourth is, yet every loop finishes (nobody waits for a thread
    that is not running) with the one-thread bits."""
    run = _run_python("""
        import os, torch
        from kernels import cpu_kernels
        assert len(os.sched_getaffinity(0)) == 1
        m = cpu_kernels.load()
        g = torch.Generator().manual_seed(0)
        packed = cpu_kernels.pack_bf16_weight(torch.randn(3000, 576, generator=g).bfloat16())
        x = torch.randn(2, 576, generator=g).bfloat16()
        m.set_kernel_threads(1)
        want = cpu_kernels.bf16_linear(x, packed)
        m.set_kernel_threads(4)
        for _ in range(200):
            assert torch.equal(cpu_kernels.bf16_linear(x, packed), want)
        print("ok")
    """, taskset="0")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_a_forked_child_runs_the_kernels():
    """After fork the parent's pool workers do not exist in the child; the child's first
    loop starts its own (a pool that waited for the parent's would hang)."""
    run = _run_python("""
        import os, torch
        from kernels import cpu_kernels
        m = cpu_kernels.load()
        m.set_kernel_threads(2)
        g = torch.Generator().manual_seed(0)
        packed = cpu_kernels.pack_bf16_weight(torch.randn(3000, 576, generator=g).bfloat16())
        x = torch.randn(1, 576, generator=g).bfloat16()
        want = cpu_kernels.bf16_linear(x, packed)  # the parent's workers start here
        pid = os.fork()
        if pid == 0:
            ok = all(torch.equal(cpu_kernels.bf16_linear(x, packed), want) for _ in range(50))
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert torch.equal(cpu_kernels.bf16_linear(x, packed), want)  # the parent's pool still works
        print("ok")
    """, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_two_python_threads_in_the_kernels_at_once_each_get_their_own_result():
    """The kernels run without the GIL: while one caller's loop holds the pool, another's
    runs alone on its own thread; both get their own, right, results."""
    g = torch.Generator().manual_seed(0)
    packed = cpu_kernels.pack_bf16_weight(torch.randn(2000, 576, generator=g).bfloat16())
    inputs = [torch.randn(1, 576, generator=g).bfloat16() for _ in range(2)]
    wants = [cpu_kernels.bf16_linear(x, packed) for x in inputs]
    failures: list[str] = []

    def caller(i: int) -> None:
        for _ in range(300):
            if not torch.equal(cpu_kernels.bf16_linear(inputs[i], packed), wants[i]):
                failures.append(f"caller {i}")
                return

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert not failures, failures


def test_back_to_back_loops_of_different_sizes_keep_their_results():
    """A thousand pairs of loops alternating few and many chunks (a GEMV of 8 groups, then one of
    128), each result checked. A worker that read a finished loop's state and the next
    loop's larger size once won its claim on the finished loop and ran the next loop's chunk
    unaccounted for: the loop returned under it and the server crashed (a general
    protection fault in the LoRA and attention kernels); run() now closes a loop's state
    before it writes the next one's fields."""
    g = torch.Generator().manual_seed(0)
    small = cpu_kernels.pack_bf16_weight(torch.randn(256, 576, generator=g).bfloat16())
    large = cpu_kernels.pack_bf16_weight(torch.randn(4096, 576, generator=g).bfloat16())
    x = torch.randn(1, 576, generator=g).bfloat16()
    m = _module()
    before = m.set_kernel_threads(2)
    try:
        want_small, want_large = cpu_kernels.bf16_linear(x, small), cpu_kernels.bf16_linear(x, large)
        for _ in range(1000):
            assert torch.equal(cpu_kernels.bf16_linear(x, small), want_small)
            assert torch.equal(cpu_kernels.bf16_linear(x, large), want_large)
    finally:
        m.set_kernel_threads(before)
