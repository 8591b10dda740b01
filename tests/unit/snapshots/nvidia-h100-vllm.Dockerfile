# Rendered by skupin 0.1.0 from skus/nvidia-h100-vllm.yaml: edit the manifest, not this file.
# nvidia H100 SXM 80GB (sm_90, nvidia-hopper)
# driver nvidia 580.95.05 | framework torch 2.13.0 | compiler triton 3.7.1 | engine vllm 0.32.0
# locked pip steps install fetched wheels with tools/wheel_install.py (pypa installer 0.7.0) and tools/bytecode.py; tools sha256 <tools>
# the image BuildKit builds is normalised as skupin-layers/2: one lock, one image id (docs/REPRODUCIBLE.md)
# UNLOCKED: pins only, resolved by pip at build time. `skupin build` needs a lock (`skupin lock nvidia-h100-vllm`).
ARG SKUPIN_BASE=docker.io/nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:6a0e31b59e70890446f2c17356d6efc0d54260090a8c63d6ca7c2ad049db95d2
FROM ${SKUPIN_BASE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# layer: base
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# layer: python
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3.12 python3.12-venv python3.12-dev build-essential \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log \
 && python3.12 -m venv /opt/skupin/venv \
 && rm -f /opt/skupin/venv/bin/activate* /opt/skupin/venv/bin/Activate.ps1
ENV PATH=/opt/skupin/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/skupin/venv

# layer: framework
COPY requirements/framework.txt /opt/skupin/requirements/framework.txt
RUN --mount=type=bind,source=tools,target=/tmp/skupin-tools \
    --mount=type=cache,id=skupin-bytecode,target=/var/cache/skupin-bytecode --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca; fi \
 && touch /tmp/skupin-stamp \
 && pip install --no-compile --progress-bar off --only-binary=:all: --index-url https://pypi.org/simple \
    -r /opt/skupin/requirements/framework.txt \
 && python /tmp/skupin-tools/bytecode.py --since /tmp/skupin-stamp --lazy '/site-packages/transformers/models/(?!auto/)[^/]+/' \
    --cache /var/cache/skupin-bytecode "$VIRTUAL_ENV" \
 && rm -f /tmp/skupin-stamp

# layer: compiler
COPY requirements/compiler.txt /opt/skupin/requirements/compiler.txt
RUN --mount=type=bind,source=tools,target=/tmp/skupin-tools \
    --mount=type=cache,id=skupin-bytecode,target=/var/cache/skupin-bytecode --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca; fi \
 && touch /tmp/skupin-stamp \
 && pip install --no-compile --progress-bar off --only-binary=:all: --index-url https://pypi.org/simple \
    -r /opt/skupin/requirements/compiler.txt \
 && python /tmp/skupin-tools/bytecode.py --since /tmp/skupin-stamp --lazy '/site-packages/transformers/models/(?!auto/)[^/]+/' \
    --cache /var/cache/skupin-bytecode "$VIRTUAL_ENV" \
 && rm -f /tmp/skupin-stamp

# layer: engine
COPY requirements/engine.txt /opt/skupin/requirements/engine.txt
RUN --mount=type=bind,source=tools,target=/tmp/skupin-tools \
    --mount=type=cache,id=skupin-bytecode,target=/var/cache/skupin-bytecode --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca; fi \
 && touch /tmp/skupin-stamp \
 && pip install --no-compile --progress-bar off --only-binary=:all: --index-url https://pypi.org/simple \
    -r /opt/skupin/requirements/engine.txt \
 && python /tmp/skupin-tools/bytecode.py --since /tmp/skupin-stamp --lazy '/site-packages/transformers/models/(?!auto/)[^/]+/' \
    --cache /var/cache/skupin-bytecode "$VIRTUAL_ENV" \
 && rm -f /tmp/skupin-stamp

# layer: extras

# layer: labels
ENV VLLM_WORKER_MULTIPROC_METHOD="spawn"
EXPOSE 8000
CMD ["vllm", "serve", "/model", "--host", "0.0.0.0", "--port", "8000", "--dtype", "bfloat16", "--served-model-name", "skupin-model", "--seed", "0", "--max-logprobs", "20"]
ARG SKUPIN_LOCK_HASH=unlocked
ARG SKUPIN_DOCKERFILE_SHA256=unknown
LABEL org.opencontainers.image.title="skupin/nvidia-h100-vllm" \
      org.opencontainers.image.description="NVIDIA H100 80GB, CUDA 13.0, torch 2.13.0 cu130, triton 3.7.1, vLLM 0.32.0" \
      org.opencontainers.image.vendor="skupin" \
      org.opencontainers.image.version="0.32.0" \
      org.opencontainers.image.base.name="docker.io/nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:6a0e31b59e70890446f2c17356d6efc0d54260090a8c63d6ca7c2ad049db95d2" \
      org.opencontainers.image.base.digest="sha256:6a0e31b59e70890446f2c17356d6efc0d54260090a8c63d6ca7c2ad049db95d2" \
      io.skupin.sku="nvidia-h100-vllm" \
      io.skupin.hardware-class="nvidia-hopper" \
      io.skupin.arch="sm_90" \
      io.skupin.driver="nvidia==580.95.05" \
      io.skupin.framework="torch==2.13.0" \
      io.skupin.compiler="triton==3.7.1" \
      io.skupin.engine="vllm==0.32.0" \
      io.skupin.lock-sha256="${SKUPIN_LOCK_HASH}" \
      io.skupin.dockerfile-sha256="${SKUPIN_DOCKERFILE_SHA256}"
