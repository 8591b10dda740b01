"""README's "Where to change what" and docs/ARCHITECTURE.md's "Extension points" are true: in a copy of the repository,
a dummy engine, a dummy family and a dummy statistic are added touching only the files those tables list, and
`skupin check`, `skupin render`, a comparison and the registries' own unit tests then work on them.

A new place one has to touch (a table of names somewhere else) makes a step below fail; a table row that names a file
the additions do not touch, or misses one they do, fails `test_the_tables_list_exactly_the_files_the_additions_touch`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.paths import REPO

ENGINE, FAMILY, STAT, SKU = "dummy", "dummy", "dummy_target", "dummy-sku"
# What each addition touches, relative to the repository root (<name> is the addition's name).
TOUCHES = {
    "engine": {"skupin/engines/<name>.py", "skupin/engines/__init__.py", "skupin/imagetools/probe/skupin_probe_<name>.py",
               "skupin/imagetools/probe/skupin_probe.py", "builder/data/compat.yaml"},
    "family": {"builder/catalog/families.py", "templates/<name>.Dockerfile.j2", "builder/data/compat.yaml"},
    "statistic": {"gates/judge/compare.py", "gates/data/tolerances.yaml"},
}
ROWS = {"engine": "an inference engine", "family": "a family of base", "statistic": "a model statistic"}
PROBE = REPO / "skupin/imagetools/probe/skupin_probe.py"  # the probe's registry (one adapter module per engine)


class Copy:
    """A copy of the repository's code, data and unit tests, and the files an addition changed in it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.touched: dict[str, set[str]] = {kind: set() for kind in TOUCHES}

    def edit(self, kind: str, rel: str, old: str, new: str, *, count: int = 1) -> None:
        path = self.root / rel
        text = path.read_text(encoding="utf-8")
        assert text.count(old) == count, f"{rel}: expected {count} x {old!r} (the extension point moved?)"
        path.write_text(text.replace(old, new), encoding="utf-8")
        self.touched[kind].add(rel)

    def new(self, kind: str, rel: str, text: str) -> None:
        path = self.root / rel
        assert not path.exists(), rel
        path.write_text(text, encoding="utf-8")
        self.touched[kind].add(rel)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(self.root), "SKUPIN_ROOT": str(self.root), "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run([sys.executable, *argv], cwd=self.root, env=env, capture_output=True, text=True,
                              timeout=300)
        if check:
            assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done


def _copy(tmp: Path) -> Copy:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "references", "integration", ".mypy_cache")
    for folder in ("builder", "gates", "templates", "skupin", "skus", "tests"):
        shutil.copytree(REPO / folder, tmp / folder, symlinks=True, ignore=skip)  # skupin/{builder,gates,templates} links
    (tmp / "gates/references").symlink_to(REPO / "gates/references")  # `check` verifies the bundles (45 MB: not copied)
    return Copy(tmp)


def add_engine(c: Copy) -> None:
    """A module in skupin/engines/ (here llama.cpp's, renamed, installed as a distribution of its name), its registry line,
    its probe adapter and its engine_torch row."""
    text = (REPO / "skupin/engines/llamacpp.py").read_text(encoding="utf-8")
    for old, new in (('NAME: Final = "llamacpp"', f'NAME: Final = "{ENGINE}"'),
                     ('PROBE_ADAPTER: Final = "llamacpp"', f'PROBE_ADAPTER: Final = "{ENGINE}"'),
                     ('Distribution(name="llama-cpp-python"', f'Distribution(name="{ENGINE}"')):
        assert old in text
        text = text.replace(old, new)
    c.new("engine", f"skupin/engines/{ENGINE}.py", text)
    c.edit("engine", "skupin/engines/__init__.py", "from skupin.engines import llamacpp,",
           f"from skupin.engines import {ENGINE}, llamacpp,")
    c.edit("engine", "skupin/engines/__init__.py", '    "llamacpp": llamacpp,\n',
           f'    "llamacpp": llamacpp,\n    "{ENGINE}": {ENGINE},\n')
    c.edit("engine", "builder/data/compat.yaml", "\nengine_torch:\n",
           f'\nengine_torch:\n  - {{engine: {ENGINE}, version: 1.0.0, torch: none, reason: "its own tensor library (test)", '
           'source: "tests/unit/test_extension.py", date: 2026-11-29}\n')
    probe = "skupin/imagetools/probe/skupin_probe.py"
    c.new("engine", f"skupin/imagetools/probe/skupin_probe_{ENGINE}.py",
          (REPO / "skupin/imagetools/probe/skupin_probe_llamacpp.py").read_text(encoding="utf-8"))
    c.edit("engine", probe, "\nENGINES = (", f'\nENGINES = ("{ENGINE}", ')
    c.edit("engine", probe, "\nADAPTERS = {", f'\nADAPTERS = {{"{ENGINE}": "skupin_probe_{ENGINE}", ')
    c.edit("engine", probe, "\nENGINE_DISTRIBUTIONS = {", f'\nENGINE_DISTRIBUTIONS = {{"{ENGINE}": ("{ENGINE}",), ')
    c.edit("engine", probe, "\nENGINE_IMPORTS = {", f'\nENGINE_IMPORTS = {{"{ENGINE}": "{ENGINE}", ')


def add_family(c: Copy) -> None:
    """Its row in ALL_FAMILIES, its template (here the cpu family's) and its compatibility rows (its family, its
    vendor's arches)."""
    c.edit("family", "builder/catalog/families.py", "builds_sdist=True),\n)}",
           f'builds_sdist=True),\n    FamilyInfo(name="{FAMILY}", vendors=("{FAMILY}",), driver_check="none", '
           f'torch_device="cpu", builds_sdist=True),\n)}}')
    c.new("family", f"templates/{FAMILY}.Dockerfile.j2", (REPO / "templates/cpu.Dockerfile.j2").read_text(encoding="utf-8"))
    c.edit("family", "builder/data/compat.yaml", "\nfamilies:\n",
           f'\nfamilies:\n  - {{family: {FAMILY}, compiler: none, drivers: [none], source: "tests/unit/test_extension.py", '
           f'date: 2026-11-29}}\n')
    c.edit("family", "builder/data/compat.yaml", "\narches:\n",  # its vendor's arches (here one, a CPU's)
           f'\narches:\n  - {{vendor: {FAMILY}, arch: x86_64, platform: linux/amd64, hardware_class: {FAMILY}-x86_64, '
           f'source: "tests/unit/test_extension.py", date: 2026-12-02}}\n')


def add_statistic(c: Copy) -> None:
    """Its Statistic in STATISTICS, and in every tolerance entry a threshold or the reason it has none."""
    c.edit("statistic", "gates/judge/compare.py", "= {s.name: s for s in (\n",
           '= {s.name: s for s in (\n'
           f'    Statistic(name="{STAT}", title="mean |target logprob delta|",\n'
           '              compute=lambda p: p.mean(np.abs(p.target_delta)),\n'
           '              floors={"float32": 1e-6, "bfloat16": 1e-2, "float16": 1e-3}),\n')
    rel = "gates/data/tolerances.yaml"
    text = (c.root / rel).read_text(encoding="utf-8")
    entries = text.count("\n    alpha: ")
    assert entries >= 1
    c.edit("statistic", rel, "\n    alpha: 0.001\n",
           f"\n    alpha: 0.001\n    omitted:\n      {STAT}: not calibrated yet (a test statistic)\n", count=entries)


def _dummy_sku(c: Copy) -> None:
    """A SKU of the dummy family and engine (a SKU is one manifest, no code: not one of the additions)."""
    text = (REPO / "skus/cpu-x86_64-llamacpp.yaml").read_text(encoding="utf-8")
    for old, new in (("name: cpu-x86_64-llamacpp", f"name: {SKU}"), ("vendor: cpu", f"vendor: {FAMILY}"),
                     ("family: cpu", f"family: {FAMILY}"), ("name: llamacpp", f"name: {ENGINE}"),
                     ("    package: llama-cpp-python\n", ""), ("version: 0.3.36", "version: 1.0.0"),
                     ("hardware_class: cpu-x86_64", f"hardware_class: {FAMILY}-x86_64"),
                     ("tolerance_class: cpu-x86_64", f"tolerance_class: {FAMILY}-x86_64")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (c.root / f"skus/{SKU}.yaml").write_text(text, encoding="utf-8")


COMPARISON = textwrap.dedent(f"""
    import json, numpy as np
    import skupin
    from skupin.calibration.calibrate import HonestRun, derive_entry
    from skupin.gates.judge.compare import DECISION_STATS, model_statistics
    from skupin.gates.judge.tolerance import DEFAULT_PATH, ToleranceKey, load_tolerances
    from skupin.gates.judge.verdict import judge_model
    from tests.unit.test_compare import candidate, probe_tensors, synthetic

    hidden, head, ids = synthetic()
    ref = probe_tensors(hidden @ head, hidden, ids)
    cands = [candidate(hidden, head, ids, 1e-6, seed=5 + i) for i in range(2)]
    stats = model_statistics(ref, cands[0])
    expected = np.abs(cands[0]["model.target_logprob"].astype(float) - ref["model.target_logprob"].astype(float)).mean(-1)
    runs = [HonestRun(label=str(i), tensors=t, env={{}}) for i, t in enumerate(cands)]
    fresh = derive_entry(key=ToleranceKey(hardware_class="cpu-x86_64", dtype="float32", model="tiny-llama"),
                         reference=ref, reference_sha256="a" * 64, runs=runs, margin=4.0, image="x", kernels=False)
    tolerances = load_tolerances(DEFAULT_PATH)
    committed = tolerances.entries[0]
    check, decisions, _ = judge_model(stats=stats, entry=committed, hard=tolerances.hard_bounds, dtype="bfloat16")
    judged, judged_decisions, _ = judge_model(stats=stats, entry=fresh, hard=tolerances.hard_bounds, dtype="float32")
    print(json.dumps({{"package": skupin.__file__, "decides": "{STAT}" in DECISION_STATS,
                      "available": "{STAT}" in stats.available,
                      "equal": bool(np.allclose(stats.per_prompt["{STAT}"], expected, rtol=1e-12, atol=0)),
                      "threshold": fresh.model.per_prompt.get("{STAT}"),
                      "not_judged": check.details.get("not_judged", {{}}),
                      "judged": [d.stat for d in judged_decisions], "status": judged.status}}))
""")


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory) -> Copy:
    assert PROBE.is_file(), "the probe's registry of engine adapters (skupin/imagetools/probe/skupin_probe.py) moved"
    c = _copy(tmp_path_factory.mktemp("extended"))
    add_engine(c)
    add_family(c)
    add_statistic(c)
    _dummy_sku(c)
    c.run("-m", "skupin", "schema", "--write")  # generated: skus/schema.json spells the family and vendor names
    return c


def test_skupin_check_accepts_the_dummy_sku_and_every_other(extended: Copy) -> None:
    done = extended.run("-m", "skupin", "check", "--json", check=False)
    report = json.loads(done.stdout)
    assert report["exit_code"] == 0, report
    mine = next(m for m in report["manifests"] if m["sku"] == SKU)
    assert mine["problems"] == [] and mine["lock"] == "unlocked"


def test_skupin_render_builds_the_dummy_family_and_leaves_the_others_unchanged(extended: Copy) -> None:
    dummy = extended.run("-m", "skupin", "render", SKU, "--unlocked").stdout
    assert "FROM ${SKUPIN_BASE} AS" in dummy and f"{ENGINE}==1.0.0" in dummy
    before = subprocess.run([sys.executable, "-m", "skupin", "render", "cpu-x86_64-llamacpp"], cwd=REPO,
                            capture_output=True, text=True, check=True, timeout=300).stdout
    assert extended.run("-m", "skupin", "render", "cpu-x86_64-llamacpp").stdout == before


def test_the_registry_computes_calibrates_and_reports_the_dummy_statistic(extended: Copy) -> None:
    result = json.loads(extended.run("-c", COMPARISON).stdout.strip().splitlines()[-1])
    assert result["package"].startswith(str(extended.root)), result["package"]  # the copy ran, not the checkout
    assert result["decides"] and result["available"] and result["equal"]
    assert result["threshold"] is not None and result["threshold"] > 0  # calibration floors it per dtype
    assert result["not_judged"] == {STAT: "the tolerance entry omits it: not calibrated yet (a test statistic)"}
    assert STAT in result["judged"] and result["status"] == "pass"


def test_the_registries_own_unit_tests_pass_with_the_additions(extended: Copy) -> None:
    """The checks that keep each registry's tables equal (families and templates and compatibility rows, floors and
    tolerance entries, engines and probe adapters, the committed schema) hold in the extended copy."""
    files = ["tests/unit/test_families.py", "tests/unit/test_statistics.py", "tests/unit/test_engines.py"]
    extended.run("-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "tests/unit/test_cli.py", "-k",
                 "not test_cli or schema")


def _table(text: str, heading: str) -> list[str]:
    start = text.index(heading)
    lines = text[start:].splitlines()[1:]
    rows = [line for line in lines[next(i for i, line in enumerate(lines) if line.startswith("|")):]]
    return [row for row in rows[:next((i for i, row in enumerate(rows) if not row.startswith("|")), len(rows))]]


def _paths(row: str, name: str) -> set[str]:
    """The repository files a table row names in backticks (`path` or `path: NAME`), placeholders filled in."""
    found = set()
    for token in re.findall(r"`([^`]+)`", row):
        path = token.split(":", 1)[0].strip()
        if re.fullmatch(r"[\w.<>/-]+\.(py|yaml|j2)", path) and "/" in path:
            found.add(re.sub(r"<[a-z]+>", name, path))
    return found


@pytest.mark.parametrize("doc,heading", [("README.md", "Where to change what"),
                                         ("docs/ARCHITECTURE.md", "## Extension points")])
def test_the_tables_list_exactly_the_files_the_additions_touch(doc: str, heading: str) -> None:
    rows = _table((REPO / doc).read_text(encoding="utf-8"), heading)
    for kind, start in ROWS.items():
        row = next((r for r in rows if r.startswith(f"| {start}")), None)
        assert row is not None, f"{doc}: no row for {start}"
        assert _paths(row, "<name>") == TOUCHES[kind], f"{doc}: the row for {start} is not what the test touches"


def test_the_additions_touch_only_what_the_tables_list(extended: Copy) -> None:
    names = {"engine": ENGINE, "family": FAMILY, "statistic": STAT}
    for kind, touched in extended.touched.items():
        assert touched == {p.replace("<name>", names[kind]) for p in TOUCHES[kind]}, kind
