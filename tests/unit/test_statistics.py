"""The statistics registry (gates/judge/compare.py: STATISTICS): floors for every gate dtype, whole tolerance entries,
and a decision that names every registered statistic it leaves out."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest
import yaml

from skupin.builder.catalog.manifest import Gate
from skupin.calibration.calibrate import HonestRun, derive_entry
from skupin.common.errors import GateCouldNotRun
from skupin.engines.base import Output
from skupin.gates.judge.compare import ALL_STATS, DECISION_STATS, STATISTICS, model_statistics
from skupin.gates.judge.tolerance import (
    DEFAULT_PATH,
    ToleranceKey,
    dump_tolerances,
    load_tolerances,
    statistics_problems,
)
from skupin.gates.judge.verdict import judge_model
from skupin.publishing.attest import tolerance_sha256
from tests.unit.test_compare import candidate, probe_tensors, synthetic

GATE_DTYPES = get_args(Gate.model_fields["dtype"].annotation)


def test_the_registry_names_its_statistics_once_and_the_decision_ones_first() -> None:
    assert all(name == s.name for name, s in STATISTICS.items())
    assert ALL_STATS == tuple(STATISTICS) and set(DECISION_STATS) <= set(ALL_STATS)
    assert {"kl", "one_minus_cos", "logprob_l2", "max_abs"} <= set(DECISION_STATS)
    assert {s.needs for s in STATISTICS.values()} <= {None, *get_args(Output)}
    assert all(STATISTICS[s].larger_is_worse for s in DECISION_STATS)  # the decision counts values above a threshold


@pytest.mark.parametrize("stat", DECISION_STATS)
def test_every_decision_statistic_has_a_calibration_floor_for_every_dtype_the_gate_serves(stat: str) -> None:
    floors = STATISTICS[stat].floors
    assert set(GATE_DTYPES) <= set(floors), f"{stat} has no calibration floor for {set(GATE_DTYPES) - set(floors)}"
    assert all(0 < floors[d] < 1 for d in GATE_DTYPES)


def test_every_committed_tolerance_entry_judges_every_statistic_or_says_why() -> None:
    tolerances = load_tolerances(DEFAULT_PATH)  # refuses a file with an incomplete entry
    assert tolerances.entries
    assert [line for e in tolerances.entries for line in statistics_problems(e)] == []


def test_an_entry_without_a_statistic_and_without_a_reason_is_refused(tmp_path) -> None:
    entries = load_tolerances(DEFAULT_PATH).entries
    first = entries[0]
    cut = first.model.model_copy(update={"per_prompt": {k: v for k, v in first.model.per_prompt.items() if k != "kl"},
                                         "mean": {k: v for k, v in first.model.mean.items() if k != "kl"}})
    broken = load_tolerances(DEFAULT_PATH).model_copy(update={"entries": (first.model_copy(update={"model": cut}),
                                                                         *entries[1:])})
    path = tmp_path / "tolerances.yaml"
    path.write_text(dump_tolerances(broken), encoding="utf-8")
    with pytest.raises(GateCouldNotRun, match="kl has no per_prompt and mean threshold and the entry says not why"):
        load_tolerances(path)
    said = broken.model_copy(update={"entries": (first.model_copy(update={"model": cut.model_copy(
        update={"omitted": {**cut.omitted, "kl": "measured elsewhere (test)"}})}), *entries[1:])})
    path.write_text(dump_tolerances(said), encoding="utf-8")
    assert load_tolerances(path).entries[0].model.omitted["kl"] == "measured elsewhere (test)"


def test_an_entry_that_omits_nothing_keeps_its_serialised_form_and_hash() -> None:
    tolerances = load_tolerances(DEFAULT_PATH)
    assert dump_tolerances(tolerances) == DEFAULT_PATH.read_text(encoding="utf-8")
    raw = yaml.safe_load(DEFAULT_PATH.read_text(encoding="utf-8"))["entries"]
    for entry, committed in zip(tolerances.entries, raw, strict=True):
        assert entry.model_dump(mode="json") == committed
        assert ("omitted" in committed["model"]) == bool(entry.model.omitted)  # an empty map is left out
        assert tolerance_sha256(entry.model_dump(mode="json")) == tolerance_sha256(committed)  # what attestations sign


def _pair(hidden_on_candidate: bool = True):
    hidden, head, ids = synthetic()
    ref = probe_tensors(hidden @ head, hidden, ids)
    cands = [candidate(hidden, head, ids, 1e-6, seed=3 + i) for i in range(2)]
    if not hidden_on_candidate:
        for c in cands:
            del c["model.hidden"]
    return ref, cands


def test_calibration_without_hidden_states_omits_one_minus_cos_and_says_why() -> None:
    ref, cands = _pair(hidden_on_candidate=False)
    runs = [HonestRun(label=f"run {i}", tensors=c, env={}) for i, c in enumerate(cands)]
    entry = derive_entry(key=ToleranceKey(hardware_class="cpu-test", dtype="float32", model="tiny"), reference=ref,
                         reference_sha256="a" * 64, runs=runs, margin=4.0, image="sha256:x", kernels=False)
    assert set(entry.model.per_prompt) == set(DECISION_STATS) - {"one_minus_cos"}
    assert "final hidden states" in entry.model.omitted["one_minus_cos"]
    assert statistics_problems(entry) == []


def test_the_decision_reports_every_statistic_it_does_not_judge() -> None:
    ref, cands = _pair()
    runs = [HonestRun(label=f"run {i}", tensors=c, env={}) for i, c in enumerate(cands)]
    entry = derive_entry(key=ToleranceKey(hardware_class="cpu-test", dtype="float32", model="tiny"), reference=ref,
                         reference_sha256="a" * 64, runs=runs, margin=4.0, image="sha256:x", kernels=False)
    tolerances = load_tolerances(DEFAULT_PATH)
    whole, _, _ = judge_model(stats=model_statistics(ref, cands[0]), entry=entry, hard=tolerances.hard_bounds,
                              dtype="float32")
    assert whole.status == "pass" and "not_judged" not in whole.details
    no_hidden = dict(cands[0])
    del no_hidden["model.hidden"]
    check, decisions, _ = judge_model(stats=model_statistics(ref, no_hidden), entry=entry, hard=tolerances.hard_bounds,
                                      dtype="float32")
    assert check.status == "pass" and "one_minus_cos" not in {d.stat for d in decisions}
    assert "final hidden states are not available" in check.details["not_judged"]["one_minus_cos"]
    assert "not judged: one_minus_cos" in check.reason
    omits = entry.model_copy(update={"model": entry.model.model_copy(update={
        "per_prompt": {k: v for k, v in entry.model.per_prompt.items() if k != "max_abs"},
        "mean": {k: v for k, v in entry.model.mean.items() if k != "max_abs"}, "omitted": {"max_abs": "a reason"}})})
    check, _, _ = judge_model(stats=model_statistics(ref, cands[0]), entry=omits, hard=tolerances.hard_bounds,
                              dtype="float32")
    assert check.details["not_judged"] == {"max_abs": "the tolerance entry omits it: a reason"}
    silent = omits.model_copy(update={"model": omits.model.model_copy(update={"omitted": {}})})
    check, _, _ = judge_model(stats=model_statistics(ref, cands[0]), entry=silent, hard=tolerances.hard_bounds,
                              dtype="float32")
    assert "has no threshold for it and says not why" in check.details["not_judged"]["max_abs"]


def test_a_statistic_is_computed_by_the_registry_on_synthetic_arrays() -> None:
    ref, cands = _pair()
    stats = model_statistics(ref, cands[0])
    assert set(stats.per_prompt) == set(ALL_STATS)
    same = model_statistics(ref, ref)
    assert all(np.all(same.per_prompt[s] == 0) for s in DECISION_STATS)
    assert all(np.all(stats.per_prompt[s] > 0) for s in DECISION_STATS)
