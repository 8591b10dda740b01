"""The workflow replay's pieces that need no Docker: expressions, conditions, output files, job order, the mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.paths import REPO
from tests.workflow_replay import ACTIONS, Evaluator, ReplayError, _order, condition, interpolate, read_kv_file

WORKFLOWS = REPO / ".github" / "workflows"


def ev(status: str = "success", **ctx) -> Evaluator:
    base = {"github": {"repository_owner": "Org"}, "vars": {}, "env": {}, "needs": {}, "matrix": {}, "inputs": {},
            "secrets": {}, "steps": {}, "runner": {"temp": "/t"}}
    base.update(ctx)
    return Evaluator(base, status=status)


@pytest.mark.parametrize(("expr", "want"), [
    ("vars.HOST || 'ghcr.io'", "ghcr.io"),
    ("needs.m.outputs.count != '0'", True),
    ("!cancelled() && needs.m.outputs.count != '0'", True),
    ("env.HOST == 'GHCR.IO'", True),  # strings compare case-insensitively
    ("vars.APP_ID != ''", False),  # a missing variable is null, and null == '' in GitHub's coercion
    ("fromJSON(needs.m.outputs.matrix).include[0].sku", "cpu"),
    ("steps.app.outputs.token || secrets.PAT", "pat"),
    ("'it''s'", "it's"),
    ("(1 == 1) && 'x'", "x"),
])
def test_expressions(expr, want):
    e = ev(vars={"HOST": ""}, env={"HOST": "ghcr.io"}, secrets={"PAT": "pat"},
           needs={"m": {"outputs": {"count": "1", "matrix": '{"include": [{"sku": "cpu"}]}'}}},
           steps={"app": {"outputs": {}}})
    assert e.evaluate(expr) == want


@pytest.mark.parametrize("expr", ["lower(github.repository_owner)", "hashFiles('x')", "nope.x", "1 < 2",
                                  "github.repository_owner ==", "a.b c"])
def test_anything_unknown_fails_loudly(expr):
    with pytest.raises(ReplayError):
        ev().evaluate(expr)


def test_interpolation_keeps_a_lone_expressions_type_and_strings_text():
    e = ev(needs={"m": {"outputs": {"matrix": '{"include": [{"sku": "a"}]}'}}}, matrix={"sku": "a", "on": ["x", "y"]})
    assert interpolate("${{ fromJSON(needs.m.outputs.matrix) }}", e) == {"include": [{"sku": "a"}]}
    assert interpolate("${{ matrix.on }}", e) == ["x", "y"]
    assert interpolate("build-${{ matrix.sku }}-${{ runner.temp }}", e) == "build-a-/t"
    assert interpolate("${{ matrix.sku }}/${{ runner.temp }}", e) == "a//t"  # two expressions, not one
    assert interpolate({"k": ["${{ matrix.sku }}"]}, e) == {"k": ["a"]}


def test_conditions_need_success_unless_they_name_a_status():
    assert condition(None, ev()) and not condition(None, ev("failure"))
    assert not condition("${{ 'x' == 'x' }}", ev("failure"))  # an implicit success() joins any condition
    assert condition("${{ !cancelled() }}", ev("failure"))
    assert not condition("${{ !cancelled() }}", ev("cancelled"))
    assert condition("always()", ev("failure"))


def test_output_files_read_lines_and_heredocs(tmp_path: Path):
    f = tmp_path / "out"
    f.write_text("a=1\nmatrix={\"x\": \"=\"}\nbody<<EOF\nline 1\nline=2\nEOF\nb=\n")
    assert read_kv_file(f) == {"a": "1", "matrix": '{"x": "="}', "body": "line 1\nline=2", "b": ""}
    f.write_text("no equals sign\n")
    with pytest.raises(ReplayError):
        read_kv_file(f)


@pytest.mark.parametrize("name", ["ci.yml", "images.yml", "watch.yml"])
def test_every_action_of_the_replayed_workflows_has_a_local_equivalent(name):
    """A workflow edit that uses an action the replay cannot stand for fails here (an unknown function fails the replay)."""
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    jobs = data["jobs"]
    assert _order(jobs)  # needs form no cycle
    for job in jobs.values():
        if name != "ci.yml":  # ci.yml is not replayed (it is the suite itself); the others are
            for step in job.get("steps", []):
                if "uses" in step:
                    assert step["uses"].split("@", 1)[0] in ACTIONS, step["uses"]
        if "strategy" in job and "matrix" in job["strategy"]:
            assert job["strategy"].get("fail-fast") is False  # one SKU's failure never cancels another's legs


def test_jobs_run_after_what_they_need():
    jobs = {"publish": {"needs": ["matrix", "gate"]}, "gate": {"needs": ["matrix", "build"]}, "build": {"needs": "matrix"},
            "matrix": {}}
    assert _order(jobs) == ["matrix", "build", "gate", "publish"]
    with pytest.raises(ReplayError):
        _order({"a": {"needs": "b"}, "b": {"needs": "a"}})
