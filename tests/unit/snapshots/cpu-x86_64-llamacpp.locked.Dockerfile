# Rendered by skupin 0.1.0 from skus/cpu-x86_64-llamacpp.yaml: edit the manifest, not this file.
# cpu x86_64 CPU (x86_64, cpu-x86_64)
# driver none none | framework none none | compiler gcc 12.2.0 | engine llamacpp 0.3.36
# locked pip steps install fetched wheels with tools/wheel_install.py (pypa installer 0.7.0) and tools/bytecode.py; tools sha256 <tools>
# the image BuildKit builds is normalised as skupin-layers/2: one lock, one image id (docs/REPRODUCIBLE.md)
ARG SKUPIN_BASE=skupin-base/debian-bookworm-minbase:f36ed5ef9ef7

# stage: engine build (llama-cpp-python 0.3.36 from its sdist; only the wheel it makes reaches the image)
# layer: engine-build
FROM ${SKUPIN_BASE} AS skupin-engine-build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11=3.11.2-6+deb12u8 python3.11-venv=3.11.2-6+deb12u8 g++-12=12.2.0-14+deb12u1 cmake=3.25.1-1 make=4.3-4.1 libc6-dev=2.36-9+deb12u14 \
    binutils=2.40-2 binutils-common=2.40-2 binutils-x86-64-linux-gnu=2.40-2 ca-certificates=20230311+deb12u1 \
    cmake-data=3.25.1-1 cpp-12=12.2.0-14+deb12u1 gcc-12=12.2.0-14+deb12u1 libarchive13=3.6.2-1+deb12u4 \
    libasan8=12.2.0-14+deb12u1 libatomic1=12.2.0-14+deb12u1 libbinutils=2.40-2 libbrotli1=1.0.9-2+b6 \
    libc-dev-bin=2.36-9+deb12u14 libcc1-0=12.2.0-14+deb12u1 libcrypt-dev=1:4.4.33-2 libctf-nobfd0=2.40-2 libctf0=2.40-2 \
    libcurl4=7.88.1-10+deb12u15 libexpat1=2.5.0-1+deb12u2 libgcc-12-dev=12.2.0-14+deb12u1 libgomp1=12.2.0-14+deb12u1 \
    libgprofng0=2.40-2 libgssapi-krb5-2=1.20.1-2+deb12u5 libicu72=72.1-3+deb12u1 libisl23=0.25-1.1 \
    libitm1=12.2.0-14+deb12u1 libjansson4=2.14-2 libjsoncpp25=1.9.5-4 libk5crypto3=1.20.1-2+deb12u5 libkeyutils1=1.6.3-2 \
    libkrb5-3=1.20.1-2+deb12u5 libkrb5support0=1.20.1-2+deb12u5 libldap-2.5-0=2.5.13+dfsg-5 liblsan0=12.2.0-14+deb12u1 \
    libmpc3=1.3.1-1 libmpfr6=4.2.0-1 libncursesw6=6.4-4 libnghttp2-14=1.52.0-1+deb12u3 libnsl-dev=1.3.0-2 \
    libnsl2=1.3.0-2 libproc2-0=2:4.0.2-3 libpsl5=0.21.2-1 libpython3-stdlib=3.11.2-1+b1 \
    libpython3.11-minimal=3.11.2-6+deb12u8 libpython3.11-stdlib=3.11.2-6+deb12u8 libquadmath0=12.2.0-14+deb12u1 \
    libreadline8=8.2-1.3 librhash0=1.4.3-3 librtmp1=2.4+20151223.gitfa8646d.1-2+b2 libsasl2-2=2.1.28+dfsg-10 \
    libsasl2-modules-db=2.1.28+dfsg-10 libsqlite3-0=3.40.1-2+deb12u2 libssh2-1=1.10.0-3+b1 libssl3=3.0.20-1~deb12u2 \
    libstdc++-12-dev=12.2.0-14+deb12u1 libtirpc-common=1.3.3+ds-1 libtirpc-dev=1.3.3+ds-1 libtirpc3=1.3.3+ds-1 \
    libtsan2=12.2.0-14+deb12u1 libubsan1=12.2.0-14+deb12u1 libuv1=1.44.2-1+deb12u1 libxml2=2.9.14+dfsg-1.3~deb12u6 \
    linux-libc-dev=6.1.176-1 media-types=10.0.0 openssl=3.0.20-1~deb12u2 procps=2:4.0.2-3 python3=3.11.2-1+b1 \
    python3-distutils=3.11.2-3 python3-lib2to3=3.11.2-3 python3-minimal=3.11.2-1+b1 python3-pip-whl=23.0.1+dfsg-1 \
    python3-setuptools-whl=66.1.1-1+deb12u2 python3.11-minimal=3.11.2-6+deb12u8 readline-common=8.2-1.3 \
    rpcsvc-proto=1.4.3-1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log \
 && python3.11 -m venv --without-pip /opt/skupin/build-venv
RUN --mount=type=bind,source=wheels/build,target=/tmp/skupin-wheels --mount=type=bind,source=requirements/build.txt,target=/tmp/skupin-requirements.txt \
    --mount=type=bind,source=tools,target=/tmp/skupin-tools \
    /opt/skupin/build-venv/bin/python /tmp/skupin-tools/wheel_install.py --wheels /tmp/skupin-wheels /tmp/skupin-requirements.txt
RUN --mount=type=bind,source=wheels/engine-sdist,target=/tmp/skupin-sdist \
    echo "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  /tmp/skupin-sdist/llama_cpp_python-0.3.36.tar.gz" | sha256sum --check --strict - \
 && mkdir -p /tmp/skupin-src /out/wheel \
 && tar -xzf /tmp/skupin-sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/skupin-src --strip-components=1 --no-same-owner \
 && cd /tmp/skupin-src \
 && CC=gcc-12 CXX=g++-12 CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    /opt/skupin/build-venv/bin/python -c 'import sys; from scikit_build_core.build import build_wheel; print(build_wheel(sys.argv[1]))' /out/wheel \
 && cd /out/wheel \
 && wheel=$(ls) \
 && echo "llama-cpp-python==0.3.36 --hash=sha256:$(sha256sum "$wheel" | cut -d' ' -f1)" > /out/requirements.txt \
 && rm -rf /tmp/skupin-src

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
 && apt-get install -y --no-install-recommends ca-certificates=20230311+deb12u1 python3.11=3.11.2-6+deb12u8 python3.11-venv=3.11.2-6+deb12u8 \
    libexpat1=2.5.0-1+deb12u2 libgssapi-krb5-2=1.20.1-2+deb12u5 libk5crypto3=1.20.1-2+deb12u5 libkeyutils1=1.6.3-2 \
    libkrb5-3=1.20.1-2+deb12u5 libkrb5support0=1.20.1-2+deb12u5 libncursesw6=6.4-4 libnsl2=1.3.0-2 \
    libpython3-stdlib=3.11.2-1+b1 libpython3.11-minimal=3.11.2-6+deb12u8 libpython3.11-stdlib=3.11.2-6+deb12u8 \
    libreadline8=8.2-1.3 libsqlite3-0=3.40.1-2+deb12u2 libssl3=3.0.20-1~deb12u2 libtirpc-common=1.3.3+ds-1 \
    libtirpc3=1.3.3+ds-1 media-types=10.0.0 openssl=3.0.20-1~deb12u2 python3=3.11.2-1+b1 python3-distutils=3.11.2-3 \
    python3-lib2to3=3.11.2-3 python3-minimal=3.11.2-1+b1 python3-pip-whl=23.0.1+dfsg-1 \
    python3-setuptools-whl=66.1.1-1+deb12u2 python3.11-minimal=3.11.2-6+deb12u8 readline-common=8.2-1.3 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log \
 && python3.11 -m venv --without-pip /opt/skupin/venv \
 && rm -f /opt/skupin/venv/bin/activate* /opt/skupin/venv/bin/Activate.ps1
ENV PATH=/opt/skupin/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/skupin/venv

# layer: framework

# layer: compiler

# layer: engine
RUN --mount=type=bind,source=wheels/engine,target=/tmp/skupin-wheels --mount=type=bind,source=requirements/engine.txt,target=/tmp/skupin-requirements.txt \
    --mount=type=bind,source=tools,target=/tmp/skupin-tools --mount=type=cache,id=skupin-bytecode,target=/var/cache/skupin-bytecode \
    python /tmp/skupin-tools/wheel_install.py --wheels /tmp/skupin-wheels --keep /opt/skupin/requirements/engine.txt \
    --lazy '/site-packages/transformers/models/(?!auto/)[^/]+/' --cache /var/cache/skupin-bytecode --mtime 1686355200 /tmp/skupin-requirements.txt
RUN --mount=type=bind,from=skupin-engine-build,source=/out,target=/tmp/skupin-built --mount=type=bind,source=tools,target=/tmp/skupin-tools \
    --mount=type=cache,id=skupin-bytecode,target=/var/cache/skupin-bytecode \
    python /tmp/skupin-tools/wheel_install.py --wheels /tmp/skupin-built/wheel --keep /opt/skupin/requirements/engine-built.txt \
    --lazy '/site-packages/transformers/models/(?!auto/)[^/]+/' --cache /var/cache/skupin-bytecode --mtime 1686355200 /tmp/skupin-built/requirements.txt

# layer: extras
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1=12.2.0-14+deb12u1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/archives/lock /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/cache/ldconfig/aux-cache /var/log/apt/* /var/log/dpkg.log

# layer: labels
ENV OMP_NUM_THREADS="1"
EXPOSE 8000
CMD ["python3", "-m", "llama_cpp.server", "--model", "/model/model-f32.gguf", "--host", "0.0.0.0", "--port", "8000", "--model_alias", "skupin-model", "--n_ctx", "0", "--seed", "0", "--type_k", "0", "--type_v", "0", "--interrupt_requests", "False"]
ARG SKUPIN_LOCK_HASH=unlocked
ARG SKUPIN_DOCKERFILE_SHA256=unknown
LABEL org.opencontainers.image.title="skupin/cpu-x86_64-llamacpp" \
      org.opencontainers.image.description="x86_64 CPU, Debian 12, llama.cpp (llama-cpp-python 0.3.36 built from its sdist), GGUF weights" \
      org.opencontainers.image.vendor="skupin" \
      org.opencontainers.image.version="0.3.36" \
      org.opencontainers.image.base.name="skupin-base/debian-bookworm-minbase:f36ed5ef9ef7" \
      io.skupin.base-diff-id="sha256:460dab1ac658df8ea07192187d09fd54fee29021507d9354fb1e9ae33e314cc8" \
      org.opencontainers.image.created="2026-12-03T11:03:44Z" \
      io.skupin.sku="cpu-x86_64-llamacpp" \
      io.skupin.hardware-class="cpu-x86_64" \
      io.skupin.arch="x86_64" \
      io.skupin.driver="none==none" \
      io.skupin.framework="none==none" \
      io.skupin.compiler="gcc==12.2.0" \
      io.skupin.engine="llamacpp==0.3.36" \
      io.skupin.lock-sha256="${SKUPIN_LOCK_HASH}" \
      io.skupin.dockerfile-sha256="${SKUPIN_DOCKERFILE_SHA256}"
