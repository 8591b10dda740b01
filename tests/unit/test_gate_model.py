"""The model check never skips a statistic the engine is known to provide (gates/gate.py: _check_model)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from builder.manifest import load_manifest
from common.paths import SKUS
from gates.gate import ProbeRun, _check_model, _GateRun, _Stop


def _run(ref: dict, cand: dict) -> _GateRun:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")  # engine transformers: hidden states and full logprobs
    run = _GateRun(stack=SimpleNamespace(manifest=manifest), image="img", docker=None, out=Path("."),
                   on_event=lambda _: None, tolerances_path=Path("."), reference=None, baseline=None, serve_perf=None)
    run.ref, run.probe = ref, ProbeRun(report={"checks": {"model": {"status": "ok"}}}, tensors=cand)
    return run


def test_a_candidate_without_the_hidden_states_its_engine_provides_fails() -> None:
    ref = {"model.hidden": np.zeros((2, 3, 4), np.float32), "model.logprobs_full": np.zeros((1, 2, 5), np.float32)}
    run = _run(ref, {"model.logprobs_full": ref["model.logprobs_full"]})
    with pytest.raises(_Stop):
        _check_model(run)
    assert run.checks[-1].status == "fail"
    assert run.checks[-1].reason.startswith("the candidate returned no model.hidden, which the transformers engine provides")


def test_outputs_the_reference_lacks_are_not_required() -> None:
    run = _run({}, {})
    with pytest.raises(_Stop):
        _check_model(run)
    assert "returned no" not in run.checks[-1].reason  # it fails later, for its own reason
