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
                     '<testcase classname="t.m" name="ok"/><testcase classname="t.m" name="bad"><failure/></testcase>'
                     '<testcase classname="t.m" name="skip"><skipped/></testcase></testsuite></testsuites>')
    text = ci_summary.junit("unit", junit)
    assert "3 tests: 1 failed, 0 errors, 1 skipped" in text and "| `t.m::bad` |" in text and "ok" not in text
