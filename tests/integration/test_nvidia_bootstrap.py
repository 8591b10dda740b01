"""The bootstrapped NVIDIA SKU (skus/nvidia-h200-vllm-debian.yaml) built here, with no GPU: heavy, opt-in.

Marked `heavy`: skipped unless SKUPIN_HEAVY=1 (tests/integration/conftest.py), so `.ci/run` never runs it. It builds a
9.3 GB image from the committed lock (3.95 GB of wheels downloaded into the wheel store on the first run, then
reused; see docs/BENCHMARKS.md, "A bootstrapped NVIDIA image") and checks what can be checked without a GPU: the image
is its lock (the build's own check), the NVIDIA container runtime's variables are set, torch loads the CUDA user space
from the locked nvidia-* wheels, and the C compiler and Python headers Triton's launcher needs are there.

    SKUPIN_HEAVY=1 .venv/bin/pytest tests/integration/test_nvidia_bootstrap.py
"""

from __future__ import annotations

import json

import pytest

from skupin.builder.build import BuiltImage, build
from skupin.builder.check import resolve
from skupin.builder.render import render
from skupin.dockerd import ContainerSpec, Docker

from .conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

SKU = REPO / "skus" / "nvidia-h200-vllm-debian.yaml"


@pytest.fixture(scope="module")
def built(docker: Docker, host_ca_bundle) -> BuiltImage:
    """The SKU's image, built from its committed lock (BuildKit's cache and the wheel store are used when warm)."""
    return build(render(resolve(SKU, require_lock=True)), docker, ca_bundle=host_ca_bundle)


def _run(docker: Docker, image: str, *argv: str) -> str:
    res = docker.run(ContainerSpec(image=image, entrypoint=argv, mem_limit="4g"), deadline_s=300)
    assert res.exit_code == 0, res.stderr
    return res.stdout


def test_it_is_its_lock_with_the_nvidia_runtime_variables(docker: Docker, built: BuiltImage) -> None:
    stack = resolve(SKU, require_lock=True)
    assert stack.lock is not None
    assert built.lock_sha256 == stack.lock.content_hash()
    assert built.installed == {name: pkg.version for name, pkg in stack.lock.packages().items()}
    env = dict(line.split("=", 1) for line in _run(docker, built.image, "env").splitlines() if "=" in line)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["NVIDIA_REQUIRE_CUDA"] == "cuda>=13.0"  # the CUDA series of torch's cu130 wheels
    assert built.labels["io.skupin.base-diff-id"] == stack.lock.base.diff_id


def test_torch_loads_the_cuda_user_space_of_the_wheels_without_a_driver(docker: Docker, built: BuiltImage) -> None:
    code = ("import json, torch, triton; "
            "print(json.dumps({'cuda': torch.version.cuda, 'available': torch.cuda.is_available(), "
            "'triton': triton.__version__, 'arches': torch.cuda.get_arch_list()}))")
    report = json.loads(_run(docker, built.image, "python", "-c", code).strip().splitlines()[-1])
    assert report["cuda"] == "13.0" and report["available"] is False  # no GPU, no driver here
    assert report["triton"] == "3.7.1"
    assert "sm_90" in report["arches"]


def test_triton_can_compile_its_launcher(docker: Docker, built: BuiltImage) -> None:
    """Triton builds a small C module against Python.h with the system compiler at run time (pinned build-essential
    and python3.11-dev): compile one the same way."""
    script = ("printf '#include <Python.h>\\nPyMODINIT_FUNC PyInit_x(void){return NULL;}\\n' > /tmp/x.c && "
              "cc -O2 -shared -fPIC -I$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"include\"])') "
              "/tmp/x.c -o /tmp/x.so && echo ok")
    assert _run(docker, built.image, "bash", "-c", script).strip().endswith("ok")
