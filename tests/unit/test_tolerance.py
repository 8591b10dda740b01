"""gates/judge/tolerance.py and skupin/calibration/calibrate.py: entries per class, provenance, never loosening another class."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from skupin.calibration.calibrate import HonestRun, derive_entry
from skupin.common.errors import GateCouldNotRun
from skupin.gates.judge.compare import kernel_errors, model_statistics
from skupin.gates.judge.tolerance import (
    DEFAULT_PATH,
    ToleranceKey,
    Tolerances,
    dump_tolerances,
    load_tolerances,
    lookup,
    merge_entry,
    write_tolerances,
)
from skupin.gates.refdata.bundle import bundle_sha256
from tests.paths import REPO
from tests.unit.test_compare import candidate, probe_tensors, synthetic

KEY = ToleranceKey(hardware_class="cpu-test", dtype="float32", model="tiny")
SHA = "a" * 64


def _runs(noises, kernel_noise=1e-7):
    hidden, head, ids = synthetic()
    ref = probe_tensors(hidden @ head, hidden, ids)
    ref["kernels.matmul.float32"] = np.linspace(-1, 1, 64, dtype=np.float32)
    runs = []
    for i, noise in enumerate(noises):
        t = candidate(hidden, head, ids, noise, seed=10 + i)
        t["kernels.matmul.float32"] = ref["kernels.matmul.float32"] + np.float32(kernel_noise * (i + 1))
        runs.append(HonestRun(label=f"run {i}", tensors=t, env={"python": "3.11", "torch": "2.13", "cpu_model": "cpu"}))
    return ref, runs, (hidden, head, ids)


def _entry(key=KEY, noises=(1e-4, 2e-4, 1.5e-4), margin=4.0):
    ref, runs, _ = _runs(noises)
    return derive_entry(key=key, reference=ref, reference_sha256=SHA, runs=runs, margin=margin, image="sha256:x",
                        date="2026-11-29T00:00:00+00:00")


def test_thresholds_are_margin_times_the_largest_honest_value():
    ref, runs, _ = _runs((1e-4, 2e-4, 1.5e-4))
    entry = derive_entry(key=KEY, reference=ref, reference_sha256=SHA, runs=runs, margin=4.0, image="sha256:x")
    largest = max(model_statistics(ref, r.tensors).per_prompt["logprob_l2"].max() for r in runs)
    assert entry.model.per_prompt["logprob_l2"] == pytest.approx(4.0 * largest)
    worst_kernel = max(kernel_errors(ref, r.tensors)[0].rel_err for r in runs)
    assert worst_kernel > 2.0**-22
    assert entry.kernels["matmul.float32"] == pytest.approx(4.0 * worst_kernel)
    assert entry.provenance.runs == 3 and entry.provenance.margin == 4.0
    assert 0.005 <= entry.model.honest_rate < 0.2  # upper bound of 0 exceedances in 36 prompts
    assert set(entry.model.per_prompt) == {"kl", "one_minus_cos", "logprob_l2", "max_abs"}


def test_a_bit_identical_calibration_still_gets_a_dtype_floor():
    entry = _entry(noises=(0.0, 0.0))
    assert all(v > 0 for v in entry.model.per_prompt.values())
    assert all(v > 0 for v in entry.kernels.values())


def test_calibration_refuses_a_single_run_or_a_margin_of_one():
    ref, runs, _ = _runs((1e-4, 1e-4))
    with pytest.raises(GateCouldNotRun):
        derive_entry(key=KEY, reference=ref, reference_sha256=SHA, runs=runs[:1], margin=4, image="x")
    with pytest.raises(GateCouldNotRun):
        derive_entry(key=KEY, reference=ref, reference_sha256=SHA, runs=runs, margin=1.0, image="x")


def test_file_round_trip(tmp_path):
    tolerances = merge_entry(Tolerances(), _entry())
    path = tmp_path / "tolerances.yaml"
    write_tolerances(tolerances, path)
    assert load_tolerances(path) == tolerances
    assert "provenance" in path.read_text()


def test_merge_adds_a_class_and_leaves_every_other_class_exactly_as_it_was():
    other = _entry(key=ToleranceKey(hardware_class="gpu-x", dtype="float32", model="tiny"), noises=(1e-6, 2e-6))
    before = merge_entry(Tolerances(), other)
    after = merge_entry(before, _entry(noises=(1e-2, 2e-2)))  # a much noisier class
    assert after.find(other.key) == other
    assert dump_tolerances(before).split("gpu-x")[1][:2000] in dump_tolerances(after)
    assert len(after.entries) == 2


def test_replacing_a_class_with_looser_thresholds_needs_consent():
    tight = merge_entry(Tolerances(), _entry(noises=(1e-5, 2e-5)))
    loose = _entry(noises=(1e-2, 2e-2))
    with pytest.raises(GateCouldNotRun, match="would loosen"):
        merge_entry(tight, loose)
    assert merge_entry(tight, loose, allow_looser=True).find(KEY) == loose
    tighter = _entry(noises=(1e-6, 2e-6))
    assert merge_entry(tight, tighter).find(KEY) == tighter


def test_a_calibration_without_kernels_keeps_the_classs_kernel_thresholds():
    """A SKU whose gate does not check kernels (llama.cpp: no torch, no kernel battery) measures none."""
    ref, runs, _ = _runs((1e-4, 2e-4))
    for run in runs:
        del run.tensors["kernels.matmul.float32"]
    with pytest.raises(GateCouldNotRun, match="did not produce this op"):
        derive_entry(key=KEY, reference=ref, reference_sha256=SHA, runs=runs, margin=4.0, image="x")
    entry = derive_entry(key=KEY, reference=ref, reference_sha256=SHA, runs=runs, margin=4.0, image="x", kernels=False)
    assert entry.kernels == {}
    with_kernels = merge_entry(Tolerances(), _entry(noises=(1e-4, 2e-4)))
    merged = merge_entry(with_kernels, entry, allow_looser=True).find(KEY)
    assert merged is not None and merged.kernels == with_kernels.find(KEY).kernels != {}
    assert merged.model == entry.model


def test_lookup_of_a_missing_class_says_how_to_calibrate():
    with pytest.raises(GateCouldNotRun, match="skupin calibrate"):
        lookup(Tolerances(), KEY)


def test_the_committed_cpu_entry_matches_the_committed_reference_bundle():
    tolerances = load_tolerances(DEFAULT_PATH)
    entry = lookup(tolerances, ToleranceKey(hardware_class="cpu-x86_64", dtype="float32", model="tiny-llama"))
    bundle = REPO / "gates/references/tiny-llama/h200-float32"
    assert entry.provenance.reference_sha256 == bundle_sha256(bundle)
    assert entry.provenance.runs >= 4 and entry.provenance.margin > 1
    assert tolerances.hard_bounds.max_mean_kl == 0.5 and tolerances.hard_bounds.min_top1_agree == 0.8


EVIDENCE = DEFAULT_PATH.parent / "evidence"


def test_there_is_evidence_for_the_engines_shipped_on_a_calibrated_class() -> None:
    assert sorted(p.name for p in EVIDENCE.glob("*.json")) == ["cpu-x86_64-vllm.float32.tiny-llama.json"]


@pytest.mark.parametrize("path", sorted(EVIDENCE.glob("*.json")), ids=lambda p: p.stem)
def test_every_engine_shipped_on_a_class_fits_inside_the_class_entry(path) -> None:
    """The engine is not part of the tolerance key (docs/GATE.md): each engine's honest runs on a class
    (gates/data/evidence/, `skupin calibrate SKU --dry-run`) must lie within that class's committed bounds."""
    import json

    from skupin.gates.judge.tolerance import ToleranceEntry

    evidence = ToleranceEntry.model_validate({k: v for k, v in json.loads(path.read_text()).items()})
    entry = lookup(load_tolerances(), evidence.key)
    honest = evidence.provenance.honest_max
    bounds = {**{f"per_prompt.{k}": v for k, v in entry.model.per_prompt.items()},
              **{f"mean.{k}": v for k, v in entry.model.mean.items()},
              **{f"kernels.{k}": v for k, v in entry.kernels.items()}}
    assert set(honest) <= set(bounds), set(honest) - set(bounds)
    over = {name: (value, bounds[name]) for name, value in honest.items() if value > bounds[name]}
    assert not over, f"{path.name}: honest values over the class entry's bounds: {over}"
    assert evidence.provenance.runs >= 4 and evidence.provenance.reference_sha256 == entry.provenance.reference_sha256


def test_a_yaml_alias_bomb_in_the_tolerance_file_is_refused_before_it_expands(tmp_path):
    # issue 30: ~550 bytes of nested aliases expand to billions of nodes under yaml.safe_load
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = tmp_path / "tolerances.yaml"
    path.write_text("format: skupin-tolerances/1\n" + "\n".join(lines) + "\nentries: []\n")
    assert len(path.read_bytes()) < 700
    with pytest.raises(GateCouldNotRun, match="anchors and aliases"):
        load_tolerances(path)


def test_the_tolerance_file_is_read_as_a_regular_file_only(tmp_path):
    real = tmp_path / "real.yaml"
    write_tolerances(merge_entry(Tolerances(), _entry()), real)
    link = tmp_path / "tolerances.yaml"
    link.symlink_to(real)
    with pytest.raises(GateCouldNotRun, match="regular file"):
        load_tolerances(link)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(GateCouldNotRun, match="regular file"):
        load_tolerances(fifo)  # refused at once, never blocks
    assert load_tolerances(tmp_path / "absent.yaml") == Tolerances()


def test_the_shipped_tolerance_file_uses_no_anchors_and_loads():
    text = DEFAULT_PATH.read_text(encoding="utf-8")
    assert not re.search(r"(^|[\s\[{,:-])[&*][A-Za-z0-9_]", text, flags=re.M)
    assert load_tolerances(DEFAULT_PATH).entries


def test_writing_the_tolerance_file_uses_a_unique_temporary_and_leaves_none(tmp_path, monkeypatch):
    path = tmp_path / "tolerances.yaml"
    squatted = path.with_suffix(".tmp")  # the old fixed temporary name: a link planted there is never written through
    target = tmp_path / "elsewhere"
    squatted.symlink_to(target)
    tolerances = merge_entry(Tolerances(), _entry())
    write_tolerances(tolerances, path)
    assert load_tolerances(path) == tolerances
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tolerances.tmp", "tolerances.yaml"]
