"""The llama.cpp CPU SKU on a real Docker engine: its engine is built from the locked sdist in a build stage, and the
gate's `pins` check verifies the built files against the wheel this host recorded (docs/GATE.md).

The image is the one `skupin build cpu-x86_64-llamacpp` recorded, else it is built here once (a cold build compiles
llama.cpp: minutes on 2 cores). The tampered image is a thin layer FROM it that appends a byte to a shared library of
the built engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from skupin.builder.render import render
from skupin.builder.sourcebuild import read_built
from skupin.common.paths import state_dir
from skupin.dockerd import ContainerSpec, Docker
from skupin.gates.integrity.static import inspect_image_files
from skupin.imagetools.probe import skupin_probe_ops as spec

pytestmark = pytest.mark.integration
SITE = "/opt/skupin/venv/lib/python3.11/site-packages"
REPO = Path(__file__).resolve().parents[2]


def test_the_llamacpp_image_passes_the_gate_through_llama_cpp_on_the_f32_gguf(llamacpp_image: str, tmp_path: Path
                                                                              ) -> None:
    """llama.cpp itself computed the model check (no torch in the image) on the checked F32 GGUF, and its own
    server passed the serve check."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "skupin.cli", "gate", "cpu-x86_64-llamacpp", "--image", llamacpp_image,
                           "--json", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    verdict = json.loads(proc.stdout)
    checks = {c["name"]: c for c in verdict["checks"]}
    assert [(n, c["status"]) for n, c in checks.items()] == [
        ("reference", "pass"), ("pins", "pass"), ("binaries", "pass"), ("smoke", "skipped"), ("boot", "pass"),
        ("kernels", "skipped"), ("ops", "pass"),
        ("model", "pass"), ("float32", "skipped"), ("serve", "pass")]  # it serves float32: the model check was the
    # float32 pass. The op battery's seeded ops are uncovered (no per-op ggml API), with why; every module of the plan
    # was captured from llama.cpp's own forward (its eval callback) and judged on the host, on its hard bounds
    ops = checks["ops"]
    plan = spec.module_plan(json.loads((REPO / "gates/fixtures/tiny-llama/config.json").read_text(encoding="utf-8")))
    assert set(ops["details"]["ops"]) == {f"{key}.float32" for key, _ in plan}
    assert all(row["ratio"] < 1 and "captured" in row["note"] for row in ops["details"]["ops"].values())
    assert set(ops["details"]["uncovered"]) == set(spec.OPS) and "no per-op ggml API" in ops["reason"]
    assert f"{len(plan)} engine ops within their bounds" in ops["reason"] and "hard bounds only" in ops["reason"]
    path = checks["model"]["details"]["engine_path"]
    assert (path["engine"], path["engine_distribution"], path["engine_version"]) == ("llamacpp", "llama-cpp-python",
                                                                                      "0.3.36")
    assert checks["model"]["details"]["means"].get("one_minus_cos") is not None  # llama.cpp's hidden states
    serve = checks["serve"]["details"]
    assert "llama_cpp.server" in serve["launch"] and "/model/model-f32.gguf" in serve["launch"]
    assert serve["greedy"]["match"] + serve["greedy"]["near_tie"] == 64
    print(f"llama.cpp gate: {verdict['reason']}; ops {ops['reason'][:300]}; serve {checks['serve']['reason']}")


def test_a_q8_0_gguf_of_the_same_fixture_fails_the_model_check(llamacpp_q8_image: str, llamacpp_q8_stack,
                                                               docker: Docker, wheelhouse, tmp_path: Path) -> None:
    """Same image and engine, the server and the probe load the Q8_0 GGUF: a different model version, caught by the
    numbers (pins and boot pass)."""
    from skupin.gates.gate import gate_image

    verdict = gate_image(stack=llamacpp_q8_stack, image=llamacpp_q8_image, docker=docker, out=tmp_path,
                         wheelhouse=wheelhouse)
    failing = verdict.failing_check()
    assert verdict.decision == "fail" and failing is not None and failing.name == "model", verdict.reason
    assert [c.status for c in verdict.checks[:5]] == ["pass", "pass", "pass", "skipped", "pass"]  # reference, pins,
    # binaries, smoke (a CPU image), boot
    print(f"q8_0: {failing.reason}")


def test_the_built_engine_is_installed_and_its_files_are_the_recorded_wheel(llamacpp_image: str, llamacpp_stack,
                                                                             docker: Docker, wheelhouse) -> None:
    lock = llamacpp_stack.lock
    record = read_built(lock)
    assert record is not None and record.sdist == lock.sources()["llama-cpp-python"]
    report = inspect_image_files(docker=docker, image_id=llamacpp_image, lock=lock, state=state_dir(),
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
        report = inspect_image_files(docker=docker, image_id=image, lock=llamacpp_stack.lock, state=state_dir(),
                                     dockerfile=render(llamacpp_stack).text, wheelhouse=wheelhouse)
    finally:
        if image:
            docker.remove_image(image, force=True)
        docker.remove_image(base)
    wheel = [f for f in report.findings if f.kind == "wheel"]
    assert [f.path for f in wheel] == [f"{SITE.lstrip('/')}/llama_cpp/lib/libllama.so"], report.findings[:5]
    assert "file of locked llama-cpp-python was changed" in wheel[0].detail
