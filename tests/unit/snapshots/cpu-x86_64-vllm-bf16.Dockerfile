# Rendered by skupin 0.1.0 from skus/cpu-x86_64-vllm-bf16.yaml: edit the manifest, not this file.
# cpu x86_64 CPU (x86_64, cpu-x86_64)
# driver none none | framework torch 2.13.0+cpu | compiler gcc 12.2.0 | engine vllm 0.32.0
# locked pip steps install fetched wheels with tools/wheel_install.py (pypa installer 0.7.0) and tools/bytecode.py; tools sha256 <tools>
# the image BuildKit builds is normalised as skupin-layers/2: one lock, one image id (docs/REPRODUCIBLE.md)
# UNLOCKED: pins only, resolved by pip at build time. `skupin build` needs a lock (`skupin lock cpu-x86_64-vllm-bf16`).
ARG SKUPIN_BASE=skupin-base/debian-bookworm-minbase:f36ed5ef9ef7
FROM ${SKUPIN_BASE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# layer: base

# layer: python
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log \
 && python3.11 -m venv /opt/skupin/venv \
 && rm -f /opt/skupin/venv/bin/activate* /opt/skupin/venv/bin/Activate.ps1
ENV PATH=/opt/skupin/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/skupin/venv

# layer: framework
COPY requirements/framework.txt /opt/skupin/requirements/framework.txt
RUN --mount=type=bind,source=wheels/framework,target=/tmp/skupin-wheels --mount=type=bind,source=tools,target=/tmp/skupin-tools \
    --mount=type=cache,id=skupin-bytecode,target=/var/cache/skupin-bytecode --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca; fi \
 && touch /tmp/skupin-stamp \
 && pip install --no-compile --progress-bar off --only-binary=:all: --find-links /tmp/skupin-wheels --index-url https://pypi.org/simple \
    -r /opt/skupin/requirements/framework.txt \
 && python /tmp/skupin-tools/bytecode.py --since /tmp/skupin-stamp --lazy '/site-packages/transformers/models/(?!auto/)[^/]+/' \
    --cache /var/cache/skupin-bytecode "$VIRTUAL_ENV" \
 && rm -f /tmp/skupin-stamp

# layer: compiler
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++-12=12.2.0-14+deb12u1 libc6-dev \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log
ENV CXX=g++-12

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
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1=2.0.16-1 python3.11-dev=3.11.2-6+deb12u8 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log

# layer: labels
ENV OMP_NUM_THREADS="1" \
    VLLM_CPU_KVCACHE_SPACE="1"
EXPOSE 8000
CMD ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/model", "--host", "0.0.0.0", "--port", "8000", "--dtype", "bfloat16", "--served-model-name", "skupin-model", "--seed", "0", "--max-logprobs", "20"]
ARG SKUPIN_LOCK_HASH=unlocked
ARG SKUPIN_DOCKERFILE_SHA256=unknown
LABEL org.opencontainers.image.title="skupin/cpu-x86_64-vllm-bf16" \
      org.opencontainers.image.description="x86_64 CPU (AVX-512), Debian 12, torch 2.13.0+cpu, vLLM 0.32.0 (vllm-cpu) in bfloat16 (the bf16 path gated on every change)" \
      org.opencontainers.image.vendor="skupin" \
      org.opencontainers.image.version="0.32.0" \
      org.opencontainers.image.base.name="skupin-base/debian-bookworm-minbase:f36ed5ef9ef7" \
      io.skupin.sku="cpu-x86_64-vllm-bf16" \
      io.skupin.hardware-class="cpu-x86_64" \
      io.skupin.arch="x86_64" \
      io.skupin.driver="none==none" \
      io.skupin.framework="torch==2.13.0+cpu" \
      io.skupin.compiler="gcc==12.2.0" \
      io.skupin.engine="vllm==0.32.0" \
      io.skupin.lock-sha256="${SKUPIN_LOCK_HASH}" \
      io.skupin.dockerfile-sha256="${SKUPIN_DOCKERFILE_SHA256}"
