"""The llama.cpp CPU SKU on a real Docker engine: its engine is built from the locked sdist in a build stage, and the
gate's `pins` check verifies the built files against the wheel this host recorded (docs/GATE.md).

The image is the one `skupin build cpu-x86_64-llamacpp` recorded, else it is built here once (a cold build compiles
llama.cpp: minutes on 2 cores). The tampered image is a thin layer FROM it that appends a byte to a shared library of
the built engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.render import render
from builder.sourcebuild import read_built
from common.paths import STATE
from dockerd import ContainerSpec, Docker
from gates.static.integrity import inspect_image_files

pytestmark = pytest.mark.integration
SITE = "/opt/skupin/venv/lib/python3.11/site-packages"


def test_the_built_engine_is_installed_and_its_files_are_the_recorded_wheel(llamacpp_image: str, llamacpp_stack,
                                                                             docker: Docker, wheelhouse) -> None:
    lock = llamacpp_stack.lock
    record = read_built(lock)
    assert record is not None and record.sdist == lock.sources()["llama-cpp-python"]
    report = inspect_image_files(docker=docker, image_id=llamacpp_image, lock=lock, state=Path(STATE),
                                 dockerfile=render(llamacpp_stack).text, wheelhouse=wheelhouse)
    assert report.ok, (report.findings[:5], report.unverifiable)
    res = docker.run(ContainerSpec(image=llamacpp_image, entrypoint=(
        "python", "-c", "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"), mem_limit="2g",
        user="65534:65534"), deadline_s=120)
    assert res.exit_code == 0 and res.stdout.strip() == "0.3.36", res.stderr[-2000:]
    # neither the compiler, cmake nor the sdist's build tree reached the image
    res = docker.run(ContainerSpec(image=llamacpp_image, entrypoint=(
        "bash", "-c", "ls /usr/bin/g++-12 /usr/bin/cmake /tmp/skupin-src /out 2>/dev/null | wc -l"), mem_limit="1g"),
        deadline_s=60)
    assert res.stdout.strip() == "0"


def test_a_tampered_built_file_fails_pins(llamacpp_image: str, llamacpp_stack, docker: Docker, wheelhouse,
                                          tmp_path: Path) -> None:
    base = "skupin-test/llamacpp-tamper-base:latest"
    docker.tag(llamacpp_image, base)
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base}\nRUN printf 'x' >> {SITE}/llama_cpp/lib/libllama.so\n", encoding="utf-8")
    image = ""
    try:
        image = docker.build(context=tmp_path, dockerfile=tmp_path / "Dockerfile")
        report = inspect_image_files(docker=docker, image_id=image, lock=llamacpp_stack.lock, state=Path(STATE),
                                     dockerfile=render(llamacpp_stack).text, wheelhouse=wheelhouse)
    finally:
        if image:
            docker.remove_image(image, force=True)
        docker.remove_image(base)
    wheel = [f for f in report.findings if f.kind == "wheel"]
    assert [f.path for f in wheel] == [f"{SITE.lstrip('/')}/llama_cpp/lib/libllama.so"], report.findings[:5]
    assert "file of locked llama-cpp-python was changed" in wheel[0].detail
