"""docs/guide-ci-point-releases.md says what the workflows do: their jobs, variables, secrets and the replay's mapping."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.paths import REPO
from tests.workflow_replay import ACTIONS

GUIDE = (REPO / "docs" / "guide-ci-point-releases.md").read_text()
WORKFLOWS = REPO / ".github" / "workflows"


@pytest.mark.parametrize("name", ["ci.yml", "images.yml", "watch.yml"])
def test_every_job_variable_and_secret_is_in_the_guide(name):
    text = (WORKFLOWS / name).read_text()
    data = yaml.safe_load(text)
    for job in data["jobs"]:
        assert f"`{job}`" in GUIDE, f"{name}: job {job} is not in the guide"
    for kind in ("vars", "secrets"):
        for used in set(re.findall(rf"\b{kind}\.([A-Z_]+)", text)) - {"GITHUB_TOKEN"}:
            assert f"`{used}`" in GUIDE, f"{name}: {kind}.{used} is not in the guide"
    assert "concurrency" in data, f"{name} has no concurrency group"
    assert data.get("defaults", {}).get("run", {}).get("shell") == "bash"


def test_the_replay_mapping_names_every_action_it_stands_for():
    for action in ACTIONS:
        assert f"`{action.rsplit('/', 1)[-1] if action.startswith('peter-evans') else action}`" in GUIDE or \
            f"`{action.split('/', 1)[1]}`" in GUIDE, f"{action} is not in the guide's replay table"


def test_runner_labels_in_the_guide_are_the_planners():
    from skupin.builder.matrix import HOSTED

    assert "`[self-hosted, linux, x64, build]`" in GUIDE
    assert "`[self-hosted, linux, x64, gpu, <hardware_class>]`" in GUIDE
    for label in HOSTED.values():
        assert f"`{label}`" in GUIDE


def test_no_run_step_interpolates_an_expression():
    """`${{ }}` inside a `run:` script is pasted into the shell before it runs: every value goes through `env:`."""
    import yaml

    found = []
    for path in sorted(WORKFLOWS.glob("*.yml")):
        for job, spec in yaml.safe_load(path.read_text())["jobs"].items():
            found += [(path.name, job, step.get("name")) for step in spec.get("steps", [])
                      if "${{" in str(step.get("run", ""))]
    assert found == []


@pytest.mark.parametrize("value, passed", [("true", True), ("false", False), ("", False)])
def test_images_dispatch_input_include_uncalibrated_reaches_the_matrix(tmp_path, value, passed):
    """images.yml's workflow_dispatch boolean `include_uncalibrated` (default off; empty on a push) adds
    `--include-uncalibrated` to `skupin matrix`: the matrix step's script, run with a stub skupin that records its
    arguments."""
    import os
    import subprocess

    data = yaml.safe_load((WORKFLOWS / "images.yml").read_text())
    spec = data[True]["workflow_dispatch"]["inputs"]["include_uncalibrated"]  # YAML 1.1 reads `on` as True
    assert spec["type"] == "boolean" and spec["default"] is False and spec["required"] is False
    assert "include_uncalibrated" in GUIDE
    (step,) = [s for s in data["jobs"]["matrix"]["steps"] if s.get("id") == "matrix"]
    assert step["env"]["INCLUDE_UNCALIBRATED"] == "${{ inputs.include_uncalibrated }}"
    stub = tmp_path / "bin" / "skupin"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path / "args"}\n')
    stub.chmod(0o755)
    env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "INCLUDE_UNCALIBRATED": value, "SKUS": "skus/a.yaml",
           "REGISTRY": "r.example/o/skupin", "SKUPIN_WHEELHOUSE": "", "GITHUB_OUTPUT": str(tmp_path / "out"),
           "GITHUB_STEP_SUMMARY": str(tmp_path / "summary")}
    run = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], env=env, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0, run.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert ("--include-uncalibrated" in args) is passed
    assert args[0] == "matrix" and args[-1] == "skus/a.yaml" and "" not in args
