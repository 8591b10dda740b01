"""`skupin ab` between real images on a real Docker daemon: both images are gated and measured (the annex's numbers
come from containers of each image, not from one image twice), a slower candidate is rejected as slower, and a
candidate that fails the quality gate is rejected whatever its speed.

The candidates are derived from the honest CPU image with one locked test wheel (tests/integration/tampered.py):
`slow` keeps the numbers and sleeps in every SiLU call; `int4` quantizes the weights as transformers loads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skupin.ab.decision import ABSettings, RuntimeAB
from skupin.ab.runtime import ABInput, runtime_ab
from skupin.dockerd import Docker
from skupin.gates.gate import gate_image
from skupin.gates.judge.verdict import GateVerdict
from skupin.gates.serving.perf import PerfSettings

pytestmark = pytest.mark.integration

SHORT = ABSettings(runs=3, concurrency=(1, 2), prompt_lengths=(16, 64), requests=3, max_tokens=12, warmup=1)
GATE_LOAD = PerfSettings(concurrency=(1,), requests=2, repetitions=1, warmup=0, max_tokens=8)  # the gates' serve speed


@pytest.fixture(scope="module")
def honest_verdict(stack, honest_image: str, docker: Docker, wheelhouse, tmp_path_factory) -> GateVerdict:
    """The honest CPU image's verdict, made once for both A/Bs (runtime_ab reuses it: same image id and lock)."""
    verdict = gate_image(stack=stack, image=honest_image, docker=docker, out=tmp_path_factory.mktemp("honest-gate"),
                         wheelhouse=wheelhouse, serve_perf=GATE_LOAD)
    assert verdict.decision == "pass", verdict.reason
    return verdict


def _no_ab_containers(docker: Docker) -> bool:
    return not any(docker.containers(label=f"io.skupin.role=ab-{role}") for role in ("baseline", "candidate"))


def test_ab_measures_both_images_and_rejects_a_slower_candidate(stack, honest_image, honest_verdict, derived,
                                                                docker: Docker, tmp_path: Path) -> None:
    slow = derived.swap("slow")
    result = runtime_ab(baseline=ABInput(stack=stack, image=honest_image, verdict=honest_verdict),
                        candidate=ABInput(stack=slow.stack(stack), image=slow.image), docker=docker, out=tmp_path,
                        settings=SHORT, wheelhouse=slow.wheelhouse, gate_serve_perf=GATE_LOAD, on_event=print)
    assert _no_ab_containers(docker)
    base, cand = result.baseline, result.candidate
    assert base.verdict_reused and not cand.verdict_reused
    assert (base.gate, cand.gate) == ("pass", "pass"), cand.gate_reason  # honest numbers, only slower
    # every number of each side came from containers of that side's image, and the two images differ
    assert base.served_by == (base.image_id,) and cand.served_by == (cand.image_id,)
    assert base.image_id == docker.inspect_image(honest_image).id
    assert cand.image_id == docker.inspect_image(slow.image).id != base.image_id
    assert result.order == ("BA", "AB", "BA") and not result.errors
    assert result.failed_requests == {"baseline": 0, "candidate": 0}
    assert result.output_agreement is not None and result.output_agreement > 0.9  # honest numbers: the same texts
    assert [n.prompt_tokens for n in result.lengths] == [16, 64]
    for length in result.lengths:
        for lv in length.ab.levels:  # 5 ms per SiLU call, 3 layers: slower at every level (rounds vary on a busy host)
            assert lv.candidate_decode_tok_s < lv.baseline_decode_tok_s and lv.decode_ratio < 0.9, lv
    decode = result.kpi("decode")
    assert decode is not None and decode.ratio < 1 - result.noise_floor and max(decode.rounds) < 1
    assert base.perf[0].levels[0].requests == cand.perf[0].levels[0].requests == SHORT.requests * SHORT.runs
    assert "paused" in result.isolation
    # output tokens counted on the host from the streamed text (honest servers, EOS forbidden): none short
    assert result.short_completions == {"baseline": 0, "candidate": 0}
    assert all(t["host"] >= t["asked"] * 0.9 for t in result.output_tokens.values()), result.output_tokens
    assert decode.ci_low is not None and decode.ci_high is not None and decode.ci_high < 1  # slower beyond its interval
    assert {(s.prompt_tokens, s.concurrency) for s in result.slices} == {(n, c) for n in (16, 64)
                                                                         for c in SHORT.concurrency}
    assert result.capacity is not None and result.capacity.baseline is not None and result.capacity.candidate is not None
    assert result.capacity.candidate.servers >= result.capacity.baseline.servers
    assert set(result.cpu) == {"baseline", "candidate"}  # each container's cgroup CPU time per 1M output tokens
    assert (result.decision, result.decision_line, result.exit_code) == ("reject", "reject: slower", 13)
    annex = (tmp_path / "annex.md").read_text()
    assert "test fixture" in annex and "## Capacity and cost" in annex and "## Decision rule" in annex
    assert "**Decision: reject: slower**" in annex
    assert result.rounds_stop == "runs" and result.rounds_stopped == f"3 rounds, as asked by --runs {SHORT.runs}"
    assert result.rounds_stopped in annex
    assert base.image_id[:19] in annex and cand.image_id[:19] in annex
    assert (tmp_path / "annex.png").stat().st_size > 10_000
    assert RuntimeAB.model_validate(json.loads((tmp_path / "ab.json").read_text())) == result


def test_a_quality_failure_blocks_promote(stack, honest_image, honest_verdict, derived, docker: Docker,
                                          tmp_path: Path) -> None:
    """Also the restarts (--restart-every 2, 4 rounds): both servers booted twice, every round names its boot, the
    second boot opens with the candidate, every interval is over the boots and no container outlives the A/B."""
    int4 = derived.swap("int4")
    result = runtime_ab(baseline=ABInput(stack=stack, image=honest_image, verdict=honest_verdict),
                        candidate=ABInput(stack=int4.stack(stack), image=int4.image), docker=docker, out=tmp_path,
                        settings=ABSettings(runs=4, restart_every=2, concurrency=(1, 2), prompt_lengths=(64,),
                                            requests=3, max_tokens=12, warmup=1),
                        wheelhouse=int4.wheelhouse, gate_serve_perf=GATE_LOAD, on_event=print)
    assert _no_ab_containers(docker)
    assert [(r.number, r.boot, r.order, r.paired) for r in result.rounds] == [
        (1, 1, "BA", True), (2, 1, "AB", True), (3, 2, "AB", True), (4, 2, "BA", True)]
    assert result.rounds_stop == "runs" and "over 2 boots" in (tmp_path / "annex.md").read_text()
    cand = result.candidate
    assert (cand.gate, cand.failing_check) == ("fail", "ops"), cand.gate_reason  # the module ops see INT4 weights
    assert cand.measured and cand.served_by == (cand.image_id,)  # it booted and served: its speed is shown
    assert (result.decision, result.decision_line, result.exit_code) == ("reject", "reject: quality gate failed", 13)
    annex = (tmp_path / "annex.md").read_text()
    assert "**FAIL** at `ops`" in annex and "- [ ] quality gates: baseline pass, candidate fail" in annex
