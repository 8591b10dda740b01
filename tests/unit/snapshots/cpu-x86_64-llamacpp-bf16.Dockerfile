# Rendered by skupin 0.1.0 from skus/cpu-x86_64-llamacpp-bf16.yaml: edit the manifest, not this file.
# cpu x86_64 CPU (x86_64, cpu-x86_64)
# driver none none | framework none none | compiler gcc 12.2.0 | engine llamacpp 0.3.36
# locked pip steps install fetched wheels with tools/wheel_install.py (pypa installer 0.7.0) and tools/bytecode.py; tools sha256 <tools>
# the image BuildKit builds is normalised as skupin-layers/2: one lock, one image id (docs/REPRODUCIBLE.md)
# UNLOCKED: pins only, resolved by pip at build time. `skupin build` needs a lock (`skupin lock cpu-x86_64-llamacpp-bf16`).
ARG SKUPIN_BASE=skupin-base/debian-bookworm-minbase:f36ed5ef9ef7

# stage: engine build (llama-cpp-python 0.3.36 from its sdist; only the wheel it makes reaches the image)
# layer: engine-build
FROM ${SKUPIN_BASE} AS skupin-engine-build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv g++-12=12.2.0-14+deb12u1 cmake=3.25.1-1 make=4.3-4.1 libc6-dev \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log \
 && python3.11 -m venv /opt/skupin/build-venv
RUN --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca; fi \
 && CC=gcc-12 CXX=g++-12 CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    /opt/skupin/build-venv/bin/pip wheel --no-deps --no-binary llama-cpp-python --index-url https://pypi.org/simple \
    --wheel-dir /out/wheel llama-cpp-python==0.3.36

# stage: the engine's wheel alone (what `skupin build` exports and records, builder/sourcebuild.py)
FROM scratch AS skupin-engine-wheel
COPY --from=skupin-engine-build /out/ /

# stage: the image
# layer: preamble
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

# layer: compiler

# layer: engine
RUN --mount=type=bind,from=skupin-engine-build,source=/out,target=/tmp/skupin-built --mount=type=secret,id=skupin_ca \
    if [ -f /run/secrets/skupin_ca ]; then export PIP_CERT=/run/secrets/skupin_ca; fi \
 && pip install --progress-bar off --only-binary=:all: --find-links /tmp/skupin-built/wheel --index-url https://pypi.org/simple \
    'llama-cpp-python[server]==0.3.36'

# layer: extras
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1=12.2.0-14+deb12u1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log

# layer: labels
ENV OMP_NUM_THREADS="1"
EXPOSE 8000
CMD ["python3", "-m", "llama_cpp.server", "--model", "/model/model-bf16.gguf", "--host", "0.0.0.0", "--port", "8000", "--model_alias", "skupin-model", "--n_ctx", "0", "--seed", "0", "--type_k", "30", "--type_v", "30", "--interrupt_requests", "False"]
ARG SKUPIN_LOCK_HASH=unlocked
ARG SKUPIN_DOCKERFILE_SHA256=unknown
LABEL org.opencontainers.image.title="skupin/cpu-x86_64-llamacpp-bf16" \
      org.opencontainers.image.description="x86_64 CPU, Debian 12, llama.cpp (llama-cpp-python 0.3.36 built from its sdist) serving a BF16 GGUF of a MoE model (the bf16 path gated on every change)" \
      org.opencontainers.image.vendor="skupin" \
      org.opencontainers.image.version="0.3.36" \
      org.opencontainers.image.base.name="skupin-base/debian-bookworm-minbase:f36ed5ef9ef7" \
      io.skupin.sku="cpu-x86_64-llamacpp-bf16" \
      io.skupin.hardware-class="cpu-x86_64" \
      io.skupin.arch="x86_64" \
      io.skupin.driver="none==none" \
      io.skupin.framework="none==none" \
      io.skupin.compiler="gcc==12.2.0" \
      io.skupin.engine="llamacpp==0.3.36" \
      io.skupin.lock-sha256="${SKUPIN_LOCK_HASH}" \
      io.skupin.dockerfile-sha256="${SKUPIN_DOCKERFILE_SHA256}"
