"""Everything that decides a verdict is attested (issue 30): the main and the float32 bundle, both tolerance entries,
the hard bounds, the lock and the gate's version are in the signed predicate, and the one policy publish and verify
share refuses a record where any of them differs from what the catalog commits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from skupin.builder.catalog.lockfile import lock_path, read_lock
from skupin.common import paths
from skupin.gates.judge.verdict import GateVerdict
from skupin.publishing.attest import CheckOutcome, Float32Pin, ReferencePin, TolerancePin, VerificationPredicate
from skupin.publishing.policy import Expected, expected_for, predicate_problems

REPO = Path(__file__).resolve().parents[2]
SKU = "cpu-x86_64-bf16"  # bfloat16 on an engine with a float32 path: both bundles and both entries decide its verdict

# Every field of a verdict that records an INPUT of the decision, and the predicate field that attests it. Fields that
# record what the gate found (outputs) are listed apart; a new verdict field must be put in one of the two.
VERDICT_INPUTS = {
    "reference": "reference.sha256",
    "tolerance": "tolerance.entry_sha256 (+ hard_bounds_sha256 for its hard_bounds)",
    "lock_hash": "lock_sha256",
    "tool_version": "gate_tool_version",
    "checks": "checks (+ float32: the float32 check's reference_sha256 and tolerance_entry)",
    "sku": "sku",
    "image_id": "image_id",
}
VERDICT_OUTPUTS = {"format", "hardware_class", "image", "image_lock_label", "model_decision", "prompts", "decision",
                   "reason", "calibration_free", "timings", "probe", "created"}


def test_every_verdict_field_is_an_attested_input_or_an_output() -> None:
    fields = set(GateVerdict.model_fields)
    assert fields == set(VERDICT_INPUTS) | VERDICT_OUTPUTS, sorted(fields ^ (set(VERDICT_INPUTS) | VERDICT_OUTPUTS))
    attested = set(VerificationPredicate.model_fields)
    for what in VERDICT_INPUTS.values():
        assert what.split(".")[0].split(" ")[0] in attested, what


@pytest.fixture(scope="module")
def expected() -> Expected:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        mp.delenv(paths.ROOT_ENV, raising=False)
        return expected_for(SKU)


def _honest(expected: Expected) -> VerificationPredicate:
    lock = read_lock(lock_path(REPO / "skus" / f"{SKU}.yaml"))
    assert expected.float32_bundle_sha256 and expected.hard_bounds_sha256 and expected.bundle_sha256
    return VerificationPredicate(
        sku=SKU, repository=SKU, image_id="sha256:" + "1" * 64, lock_sha256=lock.content_hash(), lock=lock.json_data(),
        reference=ReferencePin(sha256=expected.bundle_sha256),
        tolerance=TolerancePin(key=str(expected.tolerance_key), entry_sha256=expected.tolerance_sha256),
        decision="pass", reason="passed",
        checks=tuple(CheckOutcome(name=n, status="pass")
                     for n in ("reference", "pins", "boot", "kernels", "model", "float32", "serve")),
        verdict_sha256="2" * 64, gate_created="2026-12-01T00:00:00+00:00", gate_tool_version="0.1.0",
        tool_version="0.1.0", published="2026-12-01T00:00:00+00:00",
        float32=Float32Pin(reference=ReferencePin(sha256=expected.float32_bundle_sha256),
                           tolerance=TolerancePin(key=str(expected.float32_tolerance_key),
                                                  entry_sha256=expected.float32_tolerance_sha256)),
        hard_bounds_sha256=expected.hard_bounds_sha256)


def test_the_catalog_commits_every_input_of_this_skus_verdict(expected: Expected) -> None:
    inputs = {name for name in Expected.model_fields if name not in ("sku", "catalog")}
    assert all(getattr(expected, name) not in (None, ()) for name in inputs), expected
    assert predicate_problems(_honest(expected), expected) == []


def _edit(field: str, value: object) -> Callable[[VerificationPredicate], VerificationPredicate]:
    def edit(p: VerificationPredicate) -> VerificationPredicate:
        data = json.loads(p.model_dump_json())
        node = data
        *parents, leaf = field.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
        return VerificationPredicate.model_validate(data)
    return edit


# One tamper per input of Expected: a copied bundle, a loosened entry, loosened hard bounds, an older lock.
TAMPERS = {
    "bundle_sha256": _edit("reference.sha256", "f" * 64),
    "tolerance_key": _edit("tolerance.key", "nvidia-hopper/bfloat16/deep-llama"),
    "tolerance_sha256": _edit("tolerance.entry_sha256", "e" * 64),
    "lock_sha256": _edit("lock_sha256", "d" * 64),
    "float32_bundle_sha256": _edit("float32.reference.sha256", "c" * 64),
    "float32_tolerance_key": _edit("float32.tolerance.key", "nvidia-hopper/float32/deep-llama"),
    "float32_tolerance_sha256": _edit("float32.tolerance.entry_sha256", "b" * 64),
    "hard_bounds_sha256": _edit("hard_bounds_sha256", "a" * 64),
    # a gate run from a manifest that asked for fewer checks: serve skipped where the catalog's gate.checks has it
    "checks": lambda p: p.model_copy(update={"checks": tuple(
        c.model_copy(update={"status": "skipped"}) if c.name == "serve" else c for c in p.checks)}),
}


def test_every_input_the_catalog_commits_has_a_tamper_here() -> None:
    assert set(TAMPERS) == {name for name in Expected.model_fields if name not in ("sku", "catalog")}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_a_record_whose_input_differs_from_the_catalogs_is_refused(expected: Expected, name: str) -> None:
    problems = predicate_problems(TAMPERS[name](_honest(expected)), expected)
    assert problems, f"a record with another {name} was accepted"


@pytest.mark.parametrize("drop", ["float32", "hard_bounds_sha256"])
def test_a_record_without_the_float32_pass_or_the_hard_bounds_is_refused(expected: Expected, drop: str) -> None:
    problems = predicate_problems(_honest(expected).model_copy(update={drop: None}), expected)
    assert any(("float32 pass" if drop == "float32" else "hard bounds") in p for p in problems), problems


def test_without_a_catalog_only_the_signed_facts_are_checked(expected: Expected) -> None:
    bare = Expected(sku=SKU, lock_sha256=None, bundle_sha256=None, tolerance_key=None, tolerance_sha256=None,
                    catalog=None)
    assert predicate_problems(_honest(expected).model_copy(update={"float32": None}), bare) == []
