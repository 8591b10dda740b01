# Rendered by skupin 0.1.0 from skus/intel-max1550-vllm.yaml: edit the manifest, not this file.
# intel Data Center GPU Max 1550 (xe-hpc, intel-xe-hpc)
# driver intel-compute-runtime 25.48.36300.8 | framework torch 2.14.0+xpu | compiler triton 3.8.0 | engine vllm 0.33.0
# locked pip steps install fetched wheels with tools/wheel_install.py (pypa installer 0.7.0) and tools/bytecode.py; tools sha256 <tools>
# the image BuildKit builds is normalised as skupin-layers/2: one lock, one image id (docs/REPRODUCIBLE.md)
# UNLOCKED: pins only, resolved by pip at build time. `skupin build` needs a lock (`skupin lock intel-max1550-vllm`).
ARG SKUPIN_BASE=docker.io/intel/oneapi-basekit:2025.3.2-0-devel-ubuntu24.04@sha256:79a5e333ff6f773793d124b78047001c51cbcd53035e5100313abf2f771af95a
FROM ${SKUPIN_BASE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# layer: base
ENV ZE_ENABLE_PCI_ID_DEVICE_ORDER=1
# The driver pin's user-mode part (Level Zero), from the graphics apt repository the base configures.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libze-intel-gpu1=25.48.36300.8-0 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log

# layer: python
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3.12 python3.12-venv python3.12-dev build-essential \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log \
 && python3.12 -m venv /opt/skupin/venv \
 && rm -f /opt/skupin/venv/bin/activate* /opt/skupin/venv/bin/Activate.ps1
ENV PATH=/opt/skupin/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/skupin/venv

# layer: framework
# UNHASHED: pip picks framework over 2 indexes without hashes (a name on either may win); only a lock pins it
COPY requirements/framework.txt /opt/skupin/requirements/framework.txt
RUN --mount=type=bind,source=tools,target=/tmp/skupin-tools \
    --mount=type=cache,id=skupin-bytecode,target=/var/cache/skupin-bytecode --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca; fi \
 && touch /tmp/skupin-stamp \
 && pip install --no-compile --progress-bar off --only-binary=:all: --index-url https://download.pytorch.org/whl/xpu --extra-index-url https://pypi.org/simple \
    -r /opt/skupin/requirements/framework.txt \
 && python /tmp/skupin-tools/bytecode.py --since /tmp/skupin-stamp --lazy '/site-packages/transformers/models/(?!auto/)[^/]+/' \
    --cache /var/cache/skupin-bytecode "$VIRTUAL_ENV" \
 && rm -f /tmp/skupin-stamp

# layer: compiler
# UNHASHED: pip picks compiler over 2 indexes without hashes (a name on either may win); only a lock pins it
COPY requirements/compiler.txt /opt/skupin/requirements/compiler.txt
RUN --mount=type=bind,source=tools,target=/tmp/skupin-tools \
    --mount=type=cache,id=skupin-bytecode,target=/var/cache/skupin-bytecode --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca; fi \
 && touch /tmp/skupin-stamp \
 && pip install --no-compile --progress-bar off --only-binary=:all: --index-url https://download.pytorch.org/whl/xpu --extra-index-url https://pypi.org/simple \
    -r /opt/skupin/requirements/compiler.txt \
 && python /tmp/skupin-tools/bytecode.py --since /tmp/skupin-stamp --lazy '/site-packages/transformers/models/(?!auto/)[^/]+/' \
    --cache /var/cache/skupin-bytecode "$VIRTUAL_ENV" \
 && rm -f /tmp/skupin-stamp

# layer: engine
# UNPINNED: https://github.com/vllm-project/vllm at v0.33.0 names no commit (a tag can be moved): add source.commit
RUN --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca GIT_SSL_CAINFO=/run/secrets/skupin_ca; fi \
 && git clone --depth 1 --branch v0.33.0 https://github.com/vllm-project/vllm /tmp/skupin-src \
 && pip install --no-build-isolation /tmp/skupin-src \
 && rm -rf /tmp/skupin-src

# layer: extras

# layer: labels
ENV VLLM_TARGET_DEVICE="xpu" \
    VLLM_WORKER_MULTIPROC_METHOD="spawn"
EXPOSE 8000
CMD ["vllm", "serve", "/model", "--host", "0.0.0.0", "--port", "8000", "--dtype", "bfloat16", "--served-model-name", "skupin-model", "--seed", "0", "--max-logprobs", "20"]
ARG SKUPIN_LOCK_HASH=unlocked
ARG SKUPIN_DOCKERFILE_SHA256=unknown
LABEL org.opencontainers.image.title="skupin/intel-max1550-vllm" \
      org.opencontainers.image.description="Intel Data Center GPU Max 1550, Level Zero 25.48, torch 2.14.0 xpu, pytorch-triton-xpu 3.8.0, vLLM 0.33.0 (git)" \
      org.opencontainers.image.vendor="skupin" \
      org.opencontainers.image.version="0.33.0" \
      org.opencontainers.image.base.name="docker.io/intel/oneapi-basekit:2025.3.2-0-devel-ubuntu24.04@sha256:79a5e333ff6f773793d124b78047001c51cbcd53035e5100313abf2f771af95a" \
      org.opencontainers.image.base.digest="sha256:79a5e333ff6f773793d124b78047001c51cbcd53035e5100313abf2f771af95a" \
      io.skupin.sku="intel-max1550-vllm" \
      io.skupin.hardware-class="intel-xe-hpc" \
      io.skupin.arch="xe-hpc" \
      io.skupin.driver="intel-compute-runtime==25.48.36300.8" \
      io.skupin.framework="torch==2.14.0+xpu" \
      io.skupin.compiler="triton==3.8.0" \
      io.skupin.engine="vllm==0.33.0" \
      io.skupin.lock-sha256="${SKUPIN_LOCK_HASH}" \
      io.skupin.dockerfile-sha256="${SKUPIN_DOCKERFILE_SHA256}"
