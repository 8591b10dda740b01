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
from pathlib import Path

import pytest

from skupin.builder.build import BuiltImage, build
from skupin.builder.check import resolve
from skupin.builder.render import render
from skupin.dockerd import ContainerSpec, Docker
from skupin.gates.gate import gate_image, pre_gate_passed
from skupin.gates.host import host_accelerator
from tests.integration import tampered
from tests.unit.elf_files import elf, fatbin

from .conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

SKU = REPO / "skus" / "nvidia-h200-vllm-debian.yaml"
NO_GPU_HERE = pytest.mark.skipif(host_accelerator("cuda").present,
                                 reason="this host has an NVIDIA driver: its gate boots the image instead")


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


@NO_GPU_HERE
def test_the_gate_ends_could_not_run_after_every_check_that_needs_no_accelerator(docker: Docker, built: BuiltImage,
                                                                                   tmp_path: Path) -> None:
    """The gate on a host without an H200: reference, pins (the image's 9 GB against its lock), binaries (every CUDA
    binary carries sm_90 code or PTX, every NEEDED resolves) and the import smoke test pass, then 'could not run'."""
    verdict = gate_image(stack=resolve(SKU, require_lock=True), image=built.image_id, docker=docker,
                         out=tmp_path / "gate")
    statuses = {c.name: c.status for c in verdict.checks}
    assert {name: statuses[name] for name in ("reference", "pins", "binaries", "smoke")} == dict.fromkeys(
        ("reference", "pins", "binaries", "smoke"), "pass"), verdict.checks
    assert verdict.decision == "could_not_run" and verdict.exit_code == 11
    assert "boot: could not run: no nvidia-hopper accelerator here" in verdict.reason
    binaries = next(c for c in verdict.checks if c.name == "binaries")
    archs = binaries.details["archs"]
    assert any(path.endswith("/vllm/_C_stable_libtorch.abi3.so") for path in archs), sorted(archs)
    smoke = next(c for c in verdict.checks if c.name == "smoke")
    assert smoke.details["imports"] == {"torch": "ok", "vllm": "ok"}, smoke.details


@NO_GPU_HERE
def test_an_engine_extension_without_the_skus_arch_fails_the_arch_check_naming_it(docker: Docker, built: BuiltImage,
                                                                                   tmp_path: Path) -> None:
    """A locked test package that adds an extension module to vLLM's package built for sm_100 only: pins passes it
    (it is in the test lock), the binaries check fails naming the file and the archs it carries."""
    name = "vllm/_skupin_test_C.abi3.so"
    (tmp_path / "wheels").mkdir()
    wheel = tampered.make_wheel(tmp_path / "wheels", name="skupin-test-arch", version="1.0",
                                files={name: elf(soname="_skupin_test_C.abi3.so",
                                                 sections={".nv_fatbin": fatbin((2, 100, 0))})})
    stack = resolve(SKU, require_lock=True)
    assert stack.lock is not None
    pkg = tampered.wheel_package(wheel, name="skupin-test-arch", version="1.0")
    lock = tampered.lock_with(stack.lock, pkg)
    context = tampered.write_context(tmp_path / "context", wheels=[wheel], requirements=tampered.requirement(pkg))
    base = "skupin-test/nvidia-arch-base:latest"
    docker.tag(built.image_id, base)
    derived = ""
    try:
        derived = docker.build(context=context, dockerfile=context / "Dockerfile",
                               build_args={"BASE": base, "MODE": "locked", "LOCK_LABEL": lock.content_hash()})
        verdict = gate_image(stack=stack.model_copy(update={"lock": lock}), image=derived, docker=docker,
                             out=tmp_path / "gate", wheelhouse=wheel.parent, pre_gate=True)
    finally:
        if derived:
            docker.remove_image(derived, force=True)
        docker.remove_image(base)
    statuses = {c.name: c.status for c in verdict.checks}
    assert statuses["pins"] == "pass" and statuses["binaries"] == "fail", verdict.checks
    assert verdict.decision == "fail" and not pre_gate_passed(verdict)
    assert name in verdict.reason and "sm_90" in verdict.reason and "sm_100" in verdict.reason, verdict.reason
