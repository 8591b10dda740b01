"""scripts/ci_summary.py: job summaries from the gate's verdict, a publish record and JUnit XML."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.paths import REPO

spec = importlib.util.spec_from_file_location("ci_summary", REPO / "scripts" / "ci_summary.py")
assert spec is not None and spec.loader is not None
ci_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ci_summary)

EXAMPLE = REPO / "docs" / "examples" / "gate-cpu-x86_64"


def test_the_gate_table_has_a_row_per_check_and_points_at_the_plots():
    text = ci_summary.gate("cpu-x86_64", EXAMPLE / "verdict.json", EXAMPLE, "https://github.com/o/r/actions/runs/1")
    verdict = json.loads((EXAMPLE / "verdict.json").read_text())
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == [c["name"] for c in verdict["checks"]]
    assert f"**{verdict['decision']}**" in text
    assert "plot.png" in text and "(https://github.com/o/r/actions/runs/1#artifacts)" in text


def test_text_from_the_image_cannot_break_the_table(tmp_path: Path):
    verdict = {"decision": "fail", "reason": "x", "checks": [
        {"name": "model", "status": "fail", "reason": "a | b\n| injected | row |\x1b[31m" + "z" * 500}]}
    (tmp_path / "verdict.json").write_text(json.dumps(verdict))
    text = ci_summary.gate("s", tmp_path / "verdict.json", tmp_path / "none", None)
    row = next(line for line in text.splitlines() if line.startswith("| model"))
    assert row.count("|") == 4 and "\x1b" not in row and len(row) < 260
    assert "| injected |" not in text


def test_no_verdict_and_junit_counts(tmp_path: Path):
    assert "No verdict" in ci_summary.gate("s", tmp_path / "missing.json", tmp_path, None)
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                     '<testcase classname="t.m" name="ok"/><testcase classname="t.m" name="bad">'
                     '<failure message="AssertionError: assert 2 == 3">long traceback</failure></testcase>'
                     '<testcase classname="t.m" name="skip"><skipped/></testcase></testsuite></testsuites>')
    text = ci_summary.junit("unit", junit)
    assert "3 tests: 1 failed, 0 errors, 1 skipped" in text and "ok" not in text
    assert "| `t.m::bad` | AssertionError: assert 2 == 3 |" in text  # why it failed, not only that it did


FAILED = {"ok": False, "error": {
    "code": 3, "kind": "compat", "file": "skus/x.yaml", "field": "stack.compiler.version",
    "message": "triton 3.6.0 does not match torch 2.13.0; expected ==3.7.1", "fix": "set stack.compiler.version: 3.7.1",
    "problems": [{"file": "skus/x.yaml", "field": "stack.compiler.version", "message": "triton 3.6.0 does not match",
                  "fix": "set stack.compiler.version: 3.7.1"},
                 {"file": "skus/x.yaml", "field": "stack.engine.version", "message": "vllm 9.9 is | not known",
                  "fix": None}]},
    "warnings": ["no calibrated tolerance"]}


def _shows_the_error(text: str) -> None:
    assert "**failed** (exit 3, compat): triton 3.6.0 does not match torch 2.13.0; expected ==3.7.1" in text
    assert "- file: `skus/x.yaml`" in text and "- field: `stack.compiler.version`" in text
    assert "- fix: set stack.compiler.version: 3.7.1" in text
    assert "| skus/x.yaml | stack.engine.version | vllm 9.9 is / not known |  |" in text  # every problem, one row each
    assert "- no calibrated tolerance" in text


def test_a_step_that_failed_shows_its_error_not_just_failed(tmp_path: Path):
    """`step` on a command's --json failure object: code, kind, file, field, message, fix, every problem."""
    record = tmp_path / "build-record.json"
    record.write_text(json.dumps(FAILED))
    _shows_the_error(ci_summary.step("Build: x", record))
    # a command that writes a line per item first (lock --json) ends with the object
    record.write_text('{"event": "resolved"}\n' + json.dumps(FAILED) + "\n")
    _shows_the_error(ci_summary.step("Lock: x", record))
    record.write_text(json.dumps({"ok": True, "image_id": "sha256:1", "warnings": []}))
    assert ci_summary.step("Build: x", record).splitlines()[2] == "ok"
    assert "No JSON output" in ci_summary.step("Build: x", tmp_path / "missing.json")


def test_a_gate_that_could_not_run_or_failed_shows_the_error(tmp_path: Path):
    verdict = tmp_path / "verdict.json"
    verdict.write_text(json.dumps({**FAILED, "error": {**FAILED["error"], "code": 11, "kind": "gate_error"}}))
    text = ci_summary.gate("s", verdict, tmp_path, None)
    assert "**failed** (exit 11, gate_error)" in text and "- fix: set stack.compiler.version: 3.7.1" in text
    # a verdict with the contract's failure fields beside it: the table and the error
    verdict.write_text(json.dumps({"decision": "fail", "reason": "model: mean KL 0.9 > 0.1",
                                   "checks": [{"name": "model", "status": "fail", "reason": "KL"}], **FAILED}))
    text = ci_summary.gate("s", verdict, tmp_path, None)
    assert "**fail**: model: mean KL 0.9 > 0.1" in text and "| model | fail | KL |" in text
    _shows_the_error(text)


def test_a_publish_that_failed_shows_its_error(tmp_path: Path):
    published = tmp_path / "published.json"
    published.write_text(json.dumps(FAILED))
    text = ci_summary.publish("s", published, tmp_path / "verified.txt")
    assert text.startswith("## Publish failed: `s`") and "reference" not in text
    _shows_the_error(text)


def test_the_images_workflow_writes_the_summaries_when_a_step_failed():
    """The build leg summarises a failed build from its record; the publish leg's summary runs whatever publish and
    verify did (a failed publish's error is in published.json)."""
    import yaml

    jobs = yaml.safe_load((REPO / ".github" / "workflows" / "images.yml").read_text())["jobs"]
    build = [s for s in jobs["build"]["steps"] if "ci_summary.py step" in str(s.get("run"))]
    assert len(build) == 1 and build[0]["if"] == "${{ failure() }}" and "build-record.json" in build[0]["run"]
    publish = [s for s in jobs["publish"]["steps"] if "ci_summary.py publish" in str(s.get("run"))]
    assert len(publish) == 1 and publish[0]["if"] == "${{ !cancelled() }}"
    gate = [s for s in jobs["gate"]["steps"] if "ci_summary.py gate" in str(s.get("run"))]
    assert len(gate) == 1 and gate[0]["if"] == "${{ !cancelled() }}"
