"""skupin/common/paths.py: which catalog a command acts on (--root, SKUPIN_ROOT, the nearest folder holding skus/), and
where shipped data is read from; never another checkout (issue 20)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from skupin.cli import main
from skupin.common import paths
from skupin.common.errors import ManifestError
from tests.paths import REPO


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A folder outside any catalog, with discovery's inputs cleared."""
    monkeypatch.delenv(paths.ROOT_ENV, raising=False)
    monkeypatch.delenv(paths.STATE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "empty"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def _catalog(root: Path) -> Path:
    (root / "skus").mkdir(parents=True)
    shutil.copy(REPO / "skus" / "cpu-x86_64.yaml", root / "skus")
    shutil.copy(REPO / "skus" / "cpu-x86_64.lock.json", root / "skus")
    shutil.copy(REPO / "skus" / "pylock.cpu-x86_64.toml", root / "skus")
    return root


def test_the_nearest_folder_holding_skus_is_the_catalog(elsewhere, tmp_path, monkeypatch):
    assert paths.find_catalog() is None  # the package's own checkout is never picked up from outside it
    with pytest.raises(ManifestError, match="no catalog: no skus/ folder in .* fix: .*--root DIR.*SKUPIN_ROOT"):
        paths.catalog()
    assert paths.state_dir() == tmp_path / "cache" / "skupin"
    cat = _catalog(tmp_path / "cat")
    deep = cat / "a" / "b"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert paths.find_catalog() == cat.resolve()
    assert paths.sku_path("cpu-x86_64") == cat.resolve() / "skus" / "cpu-x86_64.yaml"
    assert paths.state_dir() == cat.resolve() / ".skupin"
    monkeypatch.setenv(paths.STATE_ENV, str(tmp_path / "state"))
    assert paths.state_dir() == tmp_path / "state"


def test_root_and_the_environment_come_before_discovery(elsewhere, tmp_path, monkeypatch):
    one, two = _catalog(tmp_path / "one"), _catalog(tmp_path / "two")
    monkeypatch.chdir(one)
    monkeypatch.setenv(paths.ROOT_ENV, str(two))
    assert paths.find_catalog() == two.resolve()
    paths.use_root(one)
    try:
        assert paths.find_catalog() == one.resolve()
    finally:
        paths.use_root(None)
    monkeypatch.setenv(paths.ROOT_ENV, str(tmp_path))
    with pytest.raises(ManifestError, match=f"SKUPIN_ROOT {tmp_path}: not a catalog"):
        paths.find_catalog()
    with pytest.raises(ManifestError, match="--root .*: not a catalog"):
        paths.use_root(tmp_path / "nope")


def test_shipped_data_unless_the_catalog_holds_its_own(elsewhere, tmp_path, monkeypatch):
    cat = _catalog(tmp_path / "cat")
    monkeypatch.chdir(cat)
    reference = "gates/references/tiny-llama/h200-float32"
    assert paths.data_path(reference) == paths.PACKAGE_ROOT / reference
    assert paths.templates_dir() == paths.SHIPPED_TEMPLATES and (paths.SHIPPED_TEMPLATES / "base.Dockerfile.j2").is_file()
    (cat / reference).mkdir(parents=True)
    (cat / "templates").mkdir()
    assert paths.data_path(reference) == cat.resolve() / reference
    assert paths.templates_dir() == cat.resolve() / "templates"


def test_a_catalogs_templates_override_the_shipped_ones(elsewhere, tmp_path, monkeypatch, capsys):
    cat = _catalog(tmp_path / "cat")
    shutil.copytree(paths.SHIPPED_TEMPLATES, cat / "templates")
    base = cat / "templates" / "base.Dockerfile.j2"
    base.write_text(base.read_text() + "# a catalog's own line\n")
    assert main(["--root", str(cat), "render", "cpu-x86_64"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("# a catalog's own line")
    monkeypatch.chdir(cat)
    assert main(["check", "cpu-x86_64"]) == 0  # a template edit changes the image (its tag), not the installed set
    assert "lock: ok" in capsys.readouterr().out


def test_a_template_that_changes_what_apt_installs_makes_the_lock_stale(elsewhere, tmp_path, monkeypatch, capsys):
    """The lock holds a version of every package the Dockerfile apt-installs: a template adding one (or dropping
    one) leaves it stale (exit 4) before any build, naming the package."""
    cat = _catalog(tmp_path / "cat")
    shutil.copytree(paths.SHIPPED_TEMPLATES, cat / "templates")
    base = cat / "templates" / "base.Dockerfile.j2"
    text = base.read_text()
    assert "install -y --no-install-recommends ca-certificates " in text
    base.write_text(text.replace("install -y --no-install-recommends ca-certificates ",
                                 "install -y --no-install-recommends ca-certificates curl ", 1))
    monkeypatch.chdir(cat)
    assert main(["check", "cpu-x86_64"]) == 4
    assert "the Dockerfile apt-installs curl, which the lock has no version of" in capsys.readouterr().out
    base.write_text(text.replace("install -y --no-install-recommends ca-certificates ",
                                 "install -y --no-install-recommends ", 1))
    assert main(["check", "cpu-x86_64"]) == 4
    assert "the lock pins apt packages the Dockerfile no longer installs: ca-certificates" in capsys.readouterr().out


def test_the_cli_names_the_way_out_when_there_is_no_catalog(elsewhere, capsys):
    assert main(["check"]) == 2
    assert "fix: run it inside a catalog" in capsys.readouterr().err
    assert main(["--root", str(REPO), "render", "cpu-x86_64"]) == 0
    assert paths.find_catalog() is None  # --root lasts one command


def test_a_catalog_calibrates_into_its_own_tolerances(elsewhere, tmp_path, monkeypatch):
    from skupin.gates.judge.tolerance import DEFAULT_PATH, catalog_tolerances, writable_tolerances

    cat = _catalog(tmp_path / "cat")
    monkeypatch.chdir(cat)
    assert catalog_tolerances() == paths.PACKAGE_ROOT / "gates/data/tolerances.yaml"  # the shipped entries
    assert writable_tolerances() == cat.resolve() / "gates/data/tolerances.yaml"  # never the installed package
    (cat / "gates/data").mkdir(parents=True)
    (cat / "gates/data/tolerances.yaml").write_text(DEFAULT_PATH.read_text())
    assert catalog_tolerances() == cat.resolve() / "gates/data/tolerances.yaml"


def test_the_state_folder_of_a_catalog_ignores_itself_before_a_key_lands_in_it(elsewhere, tmp_path, monkeypatch):
    from skupin.publishing.attest import generate_keys

    cat = _catalog(tmp_path / "cat")
    monkeypatch.chdir(cat)
    pair = generate_keys()
    assert Path(pair.private).is_relative_to(cat.resolve() / ".skupin")
    assert (cat / ".skupin" / ".gitignore").read_text().splitlines()[-1] == "*"


def test_every_committed_lock_is_current_the_examples_too():
    """`skupin check` in CI reads skus/; the example SKUs under docs/examples/ are built by the integration tests, so a
    change that leaves their locks stale must fail here, not in a build."""
    from skupin.builder.check import check_paths

    for folder in (REPO / "skus", REPO / "docs" / "examples" / "skus"):
        states = {r.stack.manifest.name: (r.stack.lock_state, r.stack.lock_note) for r in check_paths([folder])
                  if r.stack is not None and r.stack.lock_state != "unlocked"}
        assert states and all(state == "ok" for state, _note in states.values()), states


@pytest.mark.parametrize("other", ["docs/examples/skus/cpu-x86_64-llamacpp-q8_0.yaml", "skus/cpu-x86_64-llamacpp-bf16.yaml"])
def test_a_gguf_variant_of_the_llamacpp_sku_is_its_image_but_the_cmd(other: str):
    """The Q8_0 example and the BF16 SKU are "the llama.cpp image otherwise" (another GGUF, another CMD): every step
    before CMD and every locked package (the context the steps bind) must be the SKU's, or BuildKit's cache misses and
    CI compiles llama.cpp again (about 260 s on 2 cores, as it did while the example's lock lagged the SKU's apt closure)
    and the variant serves another HTTP stack than the image it claims to be."""
    from skupin.builder.check import resolve
    from skupin.builder.render import render

    def steps(path: Path) -> tuple[list[str], set[tuple[str, str, str, str]]]:
        stack = resolve(path, require_lock=True)
        text = render(stack).text
        lock = stack.lock
        assert lock is not None
        return ([line for line in text.split("\nCMD ", 1)[0].splitlines() if not line.startswith("# Rendered by")],
                {(layer, p.name, p.version, p.sha256) for layer, pkgs in lock.layers.items() for p in pkgs})

    sku, variant = steps(REPO / "skus" / "cpu-x86_64-llamacpp.yaml"), steps(REPO / other)
    assert len(sku[0]) > 50 and variant[0] == sku[0]
    assert len(sku[1]) > 20 and variant[1] == sku[1]
