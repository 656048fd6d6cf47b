"""The model side's one owner (engine/worker.py): what the start-up log says it loaded,
and the server reading model facts through AsyncEngine, never EngineCore."""

import ast
from pathlib import Path

import pytest

from engine import LLM
from kernels.cpu_kernels import cpu_has_native_bf16

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("quantization, expected", [
    (None, "none"),
    ("int8", "int8 weight-only RTN, per output channel (W8A16)"),
    ("int4", "int4 weight-only RTN, asymmetric, groups of up to 128 inputs (W4A16)"),
], ids=["float", "int8", "int4"])
def test_start_up_log_names_the_quantization(tiny_model_path, capfd, quantization, expected):
    llm = LLM(model=str(tiny_model_path), max_model_len=128, num_gpu_blocks_override=16, quantization=quantization)
    log = capfd.readouterr().err
    assert f"[pagoda] quantization: {expected}\n" in log
    # --dtype auto: bf16 where the CPU computes it natively, float32 elsewhere, said at start.
    native = cpu_has_native_bf16()
    dtype, size = ("bfloat16", 2) if native else ("float32", 4)
    assert f"[pagoda] dtype: {dtype} (--dtype auto: this CPU {'computes bf16 natively' if native else 'has no native bf16'})" in log
    assert f"[pagoda] kv_cache: {128 * size} bytes/token (2 x 2 layers x 2 KV heads x 16 x {size} bytes), 16 blocks" in log
    assert llm.engine_core.facts()["quantization"] == expected


def test_server_never_reaches_into_the_engine_core():
    """`AsyncEngine` is the server's surface: no `.core` attribute access under server/."""
    offenders = []
    for path in sorted((REPO / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "core":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders
