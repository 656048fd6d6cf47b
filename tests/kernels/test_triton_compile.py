"""The kernels compile for Hopper (sm_90) ahead of time, on any machine, GPU or not.

The interpreter runs the kernels' Python, not Triton's compiler: type unification across
loop iterations, layouts, shared memory and the software pipeliner only show up when
compiling. Triton's wheel carries the NVIDIA backend and ptxas, so `hopper_compile.py`
compiles each config the config table picks (in a fresh process without the interpreter)
to a cubin for an H100/H200, and the decode loop is checked to stream K/V through
asynchronous copies: the pipelined loop that decode bandwidth depends on.

The quantized KV cache's variants (INT8 / FP8 rows, kernels/kv_quant.py) compile on every
path too; their rows of head_dim + 2 bytes are only 2-byte aligned, below the 4 bytes an
asynchronous copy moves, so their loads are checked to be 16-bit wide instead (not byte
by byte). Their quantizing write is checked for the instructions its bit-exactness
rests on: correctly rounded divisions, the round-half-even constant, FP8's cvt.rn.satfinite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hopper_compile import ATTENTION_CASES, GEMM_CASES, QUANT_ATTENTION_CASES, QUANT_CACHE_CASES

HERE = os.path.dirname(os.path.abspath(__file__))


def _has_ptxas() -> bool:
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.path.exists(bundled) or shutil.which("ptxas") is not None


pytestmark = pytest.mark.skipif(not _has_ptxas(), reason="triton's NVIDIA backend has no ptxas here")


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "hopper_compile.py")], env=env, capture_output=True, text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_compiles_for_hopper(compiled, name: str) -> None:
    r = compiled[name]
    assert r["ok"], r.get("error")
    assert r["shared"] <= 227 * 1024
    if r["decode"] and r["dtype"] != "fp32":
        assert r["async_copies"] > 0, "the decode loop's K/V loads are not pipelined"


@pytest.mark.parametrize("name", list(GEMM_CASES))
def test_weight_only_gemms_compile_for_hopper(compiled, name: str) -> None:
    r = compiled[name]
    assert r["ok"], r.get("error")
    assert r["shared"] <= 227 * 1024


@pytest.mark.parametrize("name", ["merge_2", "merge_16", "cache_bf16", "cache_fp16", "cache_fp32"])
def test_merge_and_cache_write_compile_for_hopper(compiled, name: str) -> None:
    assert compiled[name]["ok"], compiled[name].get("error")


@pytest.mark.parametrize("name", list(QUANT_ATTENTION_CASES))
def test_attention_on_a_quantized_cache_compiles_for_hopper(compiled, name: str) -> None:
    r = compiled[name]
    assert r["ok"], r.get("error")
    assert r["shared"] <= 227 * 1024
    assert r["byte_loads"] == 0 and r["b16_loads"] > 0, "the codes are loaded a byte at a time"


@pytest.mark.parametrize("name", list(QUANT_CACHE_CASES))
def test_quantizing_cache_write_compiles_for_hopper(compiled, name: str) -> None:
    r = compiled[name]
    assert r["ok"], r.get("error")
    assert r["div_rn"] > 0 and r["div_approx"] == 0, "x / scale must be the correctly rounded division"
    if r["kv_quant"] == "int8":
        assert r["rint_constant"], "the round-half-even's 1.5 * 2**23 was folded away"
    else:
        assert r["fp8_rne"], "FP8 codes not converted by cvt.rn.satfinite.e4m3x2.f32"
