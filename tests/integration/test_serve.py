"""The serve check on real images: the honest CPU image's own `transformers serve` matches the H200 reference; a broken
sampler fails it while boot/kernels/model pass; an honest A/B is near 1; an image slowed on purpose fails the bound.

Derived images are thin layers FROM the honest image, built here without network:
- the locked `sampler` swap (tests/integration/tampered.py): a test wheel named by a test lock makes every
  GenerationConfig use repetition_penalty=1.3 (the server's generate() uses it; the probe's teacher-forced model
  check and its hand-written greedy loop do not), so `pins` passes;
- `slow`: LlamaForCausalLM.forward sleeps 20 ms per call (the serve check alone is run on it);
- `honest`: a label only (a second honest build with another image id).
Perf settings are small to keep the runtime modest (~3-4 min in all on 2 cores).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from skupin.builder.catalog.manifest import ServeGate
from skupin.dockerd import Docker
from skupin.gates.gate import gate_image, load_reference
from skupin.gates.judge.tolerance import ToleranceKey, load_tolerances
from skupin.gates.serving.perf import PerfSettings
from skupin.gates.serving.serve import NOT_PROVIDED, serve_check
from tests.integration.conftest import derived_images

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CPU_SKU = REPO / "skus" / "cpu-x86_64.yaml"
SERVE_LABEL = "io.skupin.role=gate-serve"
SMALL = PerfSettings(concurrency=(1, 2), requests=4, repetitions=2, warmup=1, max_tokens=16, prompts=4)

DOCKERFILE = """\
ARG BASE
FROM ${BASE}
ARG MODE
RUN set -eu; site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \\
    case "${MODE}" in \\
      slow) printf '%s\\n' '' 'import time as _skupin_time' '_skupin_fwd = LlamaForCausalLM.forward' \\
          'def _skupin_slow(self, *a, **k):' '    _skupin_time.sleep(0.02)' '    return _skupin_fwd(self, *a, **k)' \\
          'LlamaForCausalLM.forward = _skupin_slow' >> "${site}/transformers/models/llama/modeling_llama.py" ;; \\
      honest) true ;; \\
    esac
LABEL io.skupin.test-serve="${MODE}"
"""


@pytest.fixture(scope="module")
def derive(docker: Docker, honest_image: str, tmp_path_factory) -> Iterator:
    context = tmp_path_factory.mktemp("serve-derived")
    (context / "Dockerfile").write_text(DOCKERFILE)
    with derived_images(docker, honest_image=honest_image, context=context,
                        base_tag="skupin-test/serve-honest-base:latest") as build:
        yield build


@pytest.fixture(scope="module")
def reference(stack):
    tolerances = load_tolerances()
    entry = tolerances.find(ToleranceKey(hardware_class="cpu-x86_64", dtype="float32", model="tiny-llama"))
    assert entry is not None, "no calibrated cpu-x86_64 tolerance; run skupin calibrate cpu-x86_64"
    _, ref, _ = load_reference(manifest=stack.manifest)
    return ref, entry


def _with_bound(manifest, bound: float):
    gate = manifest.gate.model_copy(update={"serve": ServeGate(concurrency=(1, 2), max_decode_regression=bound)})
    return manifest.model_copy(update={"gate": gate})


def test_honest_image_passes_the_serve_check_with_speed_and_cost(stack, honest_image: str, docker: Docker,
                                                                   tmp_path: Path) -> None:
    verdict = gate_image(stack=stack, image=honest_image, docker=docker, out=tmp_path, serve_perf=SMALL)
    assert not docker.containers(label=SERVE_LABEL), "a server container was left behind"
    serve = verdict.check("serve")
    assert verdict.decision == "pass", verdict.reason
    assert serve.status == "pass"
    d = json.loads((tmp_path / "verdict.json").read_text())
    details = next(c for c in d["checks"] if c["name"] == "serve")["details"]
    assert details["greedy"]["diverged"] == 0 and details["greedy"]["prompts"] == 64
    assert details["logprobs"] == NOT_PROVIDED
    for lv in details["perf"]["levels"]:
        assert lv["decode_tok_s_per_request"] > 0 and 0 < lv["ttft_p50_s"] <= lv["ttft_p99_s"]
    assert details["cost"]["usd_per_1m_output_tokens"] > 0 and details["cost"]["hourly_usd"] == 0.10
    assert (tmp_path / "serve.png").is_file() and "## Serve check" in (tmp_path / "report.md").read_text()


def test_a_broken_sampler_fails_serve_while_framework_checks_pass(stack, derived, docker: Docker, tmp_path: Path) -> None:
    swapped = derived.swap("sampler")  # a locked package breaks the sampler: pins passes, the numbers do not
    verdict = gate_image(stack=swapped.stack(stack), image=swapped.image, docker=docker, out=tmp_path, serve_perf=SMALL,
                         wheelhouse=swapped.wheelhouse)
    assert not docker.containers(label=SERVE_LABEL)
    status = {c.name: c.status for c in verdict.checks}
    assert status["boot"] == status["pins"] == status["kernels"] == status["model"] == "pass", verdict.reason
    assert status["serve"] == "fail" and verdict.decision == "fail" and verdict.exit_code == 10
    assert "diverge" in verdict.check("serve").reason


def test_ab_of_two_honest_builds_is_near_one(stack, honest_image: str, derive, docker: Docker, reference) -> None:
    ref, entry = reference
    check = serve_check(manifest=_with_bound(stack.manifest, 0.5), image=derive("honest"), docker=docker, ref=ref,
                        entry=entry, baseline=honest_image, perf=SMALL, ab_rounds=3)
    assert not docker.containers(label=SERVE_LABEL) and not docker.containers(label="io.skupin.role=gate-serve-baseline")
    ab = check.details["ab"]
    assert check.status == "pass", check.reason
    assert 0.67 < ab["decode_ratio"] < 1.5 and ab["rounds"] == 3
    low, high = ab["decode_ratio_spread"]
    assert low <= ab["decode_ratio"] <= high


def test_an_image_slowed_on_purpose_fails_the_regression_bound(stack, honest_image: str, derive, docker: Docker,
                                                                 reference) -> None:
    ref, entry = reference
    check = serve_check(manifest=_with_bound(stack.manifest, 0.10), image=derive("slow"), docker=docker, ref=ref,
                        entry=entry, baseline=honest_image, perf=SMALL, ab_rounds=2)
    assert check.status == "fail", check.reason
    assert "runtime regression" in check.reason and check.details["ab"]["decode_ratio"] < 0.9
    assert check.details["greedy"]["diverged"] == 0  # same outputs, only slower
