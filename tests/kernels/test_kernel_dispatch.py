"""kernels/ops.py: which ops each kernel_backend gives, and the interpreter requirement on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels import reference  # noqa: E402
from kernels.ops import get_ops  # noqa: E402


def test_torch_on_cpu_is_the_reference() -> None:
    ops = get_ops("torch", torch.device("cpu"))
    assert ops.backend == "torch"
    assert ops.paged_attention is reference.paged_attention
    assert ops.reshape_and_cache is reference.reshape_and_cache


def test_auto_on_cpu_is_the_cpp_kernels() -> None:
    """This machine has a compiler: auto and cpu give the C++ kernels; the cpu backend
    is refused on another device."""
    from kernels import cpu_kernels

    for backend in ("auto", "cpu"):
        ops = get_ops(backend, torch.device("cpu"))
        assert ops.backend == "cpu"
        assert ops.paged_attention.func is cpu_kernels.paged_attention
        assert ops.paged_attention.keywords == {"invariant": False}
        assert ops.reshape_and_cache is cpu_kernels.reshape_and_cache
    assert get_ops("cpu", torch.device("cpu"), batch_invariant=True).paged_attention.keywords == {"invariant": True}
    with pytest.raises(ValueError, match="kernel_backend 'cpu'"):
        get_ops("cpu", torch.device("cuda"))


@pytest.mark.skipif(ON_CUDA, reason="interpreter variant: this process compiles the kernels for CUDA")
def test_triton_on_cpu_under_the_interpreter() -> None:
    from kernels import triton_attention, triton_cache

    for invariant in (False, True):
        ops = get_ops("triton", torch.device("cpu"), batch_invariant=invariant)
        assert ops.backend == "triton"
        assert ops.paged_attention.func is triton_attention.paged_attention
        assert ops.paged_attention.keywords == {"invariant": invariant}  # --batch-invariant's one config
        assert ops.reshape_and_cache is triton_cache.reshape_and_cache


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
def test_auto_on_cuda_is_triton_and_falls_back_for_unsupported_shapes() -> None:
    ops = get_ops("auto", torch.device("cuda"))
    assert ops.backend == "triton"
    for head_dim in (16, 64):  # 16: the kernels refuse it, auto uses the reference
        g = torch.Generator(device="cuda").manual_seed(0)
        key_cache = torch.randn(4, 16, 2, head_dim, device="cuda", generator=g)
        value_cache = torch.randn(4, 16, 2, head_dim, device="cuda", generator=g)
        k, v = torch.randn(2, 2, head_dim, device="cuda", generator=g), torch.randn(2, 2, head_dim, device="cuda", generator=g)
        ops.reshape_and_cache(k, v, key_cache, value_cache, torch.tensor([17, 40], device="cuda"))
        args = (torch.randn(2, 4, head_dim, device="cuda", generator=g), key_cache, value_cache,
                torch.tensor([[1], [2]], dtype=torch.int32, device="cuda"),
                torch.tensor([2, 9], dtype=torch.int32, device="cuda"),
                torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"), head_dim**-0.5)
        torch.testing.assert_close(ops.paged_attention(*args), reference.paged_attention(*args), atol=1e-4, rtol=1e-4)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="kernel_backend"):
        get_ops("cuda", torch.device("cpu"))


@pytest.mark.skipif(ON_CUDA, reason="about the CPU interpreter")
def test_import_is_cheap_and_the_interpreter_can_be_switched_on_late() -> None:
    # A fresh process without TRITON_INTERPRET: `import kernels.ops` must not import triton,
    # and asking for triton on CPU must say how to get it. Then triton gets imported
    # compiled (transformers' Llama does) before TRITON_INTERPRET=1 is set, as in a pytest
    # run where engine tests come first: the kernels must still run, and match the reference.
    code = textwrap.dedent(
        """
        import os, sys
        import torch
        import kernels, kernels.ops
        assert "triton" not in sys.modules, "import kernels pulled in triton"
        try:
            kernels.ops.get_ops("triton", torch.device("cpu"))
            raise SystemExit("no ValueError without TRITON_INTERPRET")
        except ValueError as e:
            assert "TRITON_INTERPRET=1" in str(e), e
        from transformers import LlamaForCausalLM
        assert "triton" in sys.modules
        os.environ["TRITON_INTERPRET"] = "1"
        ops = kernels.ops.get_ops("triton", torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(2, 9, 2, 64, generator=g), torch.randn(2, 9, 2, 64, generator=g)
        key_cache, value_cache = torch.randn(4, 16, 2, 64, generator=g), torch.randn(4, 16, 2, 64, generator=g)
        ref_k, ref_v = key_cache.clone(), value_cache.clone()
        slots = torch.tensor([3 * 16 + i for i in range(9)] + [1 * 16 + i for i in range(9)])
        ops.reshape_and_cache(k.flatten(0, 1), v.flatten(0, 1), key_cache, value_cache, slots)
        kernels.reference.reshape_and_cache(k.flatten(0, 1), v.flatten(0, 1), ref_k, ref_v, slots)
        assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
        args = (torch.randn(10, 6, 64, generator=g), key_cache, value_cache,
                torch.tensor([[3], [1]], dtype=torch.int32), torch.tensor([9, 9], dtype=torch.int32),
                torch.tensor([0, 1, 10], dtype=torch.int32), 0.125)
        torch.testing.assert_close(ops.paged_attention(*args), kernels.reference.paged_attention(*args))
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr
