"""The import smoke test on a real image with no accelerator attached (gates/gate.py smoke_spec, skupin_probe_smoke.py,
gates/judge/smoke.py): the honest CPU image loads; a derived image with one runtime library broken fails, named.

The gate runs the smoke test for GPU images only (a CPU image's boot is its import test); this drives the same
container and judge on the CPU image, the one image this machine builds in CI, with the CUDA family's host libraries.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.builder.render import VENV
from skupin.dockerd import Docker
from skupin.gates.gate import _host_folder, _probe_run, smoke_spec
from skupin.gates.judge.smoke import judge_smoke

pytestmark = pytest.mark.integration
CUDA_HOST = ALL_FAMILIES["cuda"].host_libraries
BASE_TAG = "skupin-test/smoke-base:latest"


def _smoke(docker: Docker, stack, image: str, out: Path) -> dict:
    fd = _host_folder(out)
    try:
        probe = _probe_run(docker.run(smoke_spec(manifest=stack.manifest, image=image, out=out)),
                           deadline=float(stack.manifest.gate.deadline_s), out_fd=fd)
    finally:
        os.close(fd)
    assert not probe.error, probe.error
    return probe.report["checks"]["smoke"]


def test_the_honest_image_loads_with_no_accelerator_and_a_broken_library_is_named(docker: Docker, honest_image: str,
                                                                                   stack, tmp_path: Path) -> None:
    report = _smoke(docker, stack, honest_image, tmp_path / "honest")
    assert report["imports"] == {"torch": "ok", "transformers": "ok"}
    loaded = {Path(p).name for p, v in report["libraries"].items() if v == "ok"}
    assert "libtorch_cpu.so" in loaded and report["accelerator_visible"] is False
    result = judge_smoke(report, host_libraries=CUDA_HOST, family="cuda")
    assert result.status == "pass", result.reason

    context = tmp_path / "broken"
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM {BASE_TAG}\nUSER root\n"
        f"RUN lib=$(ls -d {VENV}/lib/python3*/site-packages/torch/lib) && printf 'broken' > \"$lib/libshm.so\"\n")
    docker.tag(honest_image, BASE_TAG)
    lines: list[str] = []
    try:
        broken = docker.build(context=context, dockerfile=context / "Dockerfile", on_line=lines.append)
        try:
            result = judge_smoke(_smoke(docker, stack, broken, tmp_path / "broken-out"), host_libraries=CUDA_HOST,
                                 family="cuda")
        finally:
            docker.remove_image(broken, force=True)
    except Exception:
        print("\n".join(lines[-30:]))
        raise
    finally:
        docker.remove_image(BASE_TAG)
    assert result.status == "fail" and "torch/lib/libshm.so" in result.reason, result.reason
