"""skupin as people install it (issue 20): the built wheel, installed non-editable into a fresh venv, works from a copy
of the catalog (check, render, lock against a loopback index) and, with no catalog at all, verifies, inspects and
pulls from a local registry; the checkout the wheel was built from is never touched.

The venv gets the wheel's dependencies from PyPI (pip's cache makes a second run quick); the lock itself runs
offline: every locked wheel is served from this host's wheel store by a loopback index, torch from the wheelhouse.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from skupin.builder.catalog.lockfile import read_lock
from skupin.builder.wheels import store_path, wheel_store
from tests.data.index.server import serve_wheels
from tests.integration.test_publish import SIGNER, make_lock, make_verdict, publish, registry, tiny  # noqa: F401
from tests.paths import REPO, SKUS

pytestmark = pytest.mark.integration
CPU_LOCK = SKUS / "cpu-x86_64.lock.json"


def _run(*cmd, cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _checkout_state() -> tuple[str, dict[str, str]]:
    status = _run("git", "status", "--porcelain", cwd=REPO).stdout
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(SKUS.iterdir()) if p.is_file()}
    return status, files


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Iterator[tuple[Path, dict[str, str]]]:
    """(the venv's skupin, an environment without this checkout in it), from a wheel of a copy of the source."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    keep = ("pyproject.toml", "README.md", "builder", "gates", "templates", "skupin")
    for name in keep:  # skupin/{builder,gates,templates} stay links, as in a clone
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, symlinks=True)
        else:
            shutil.copy(REPO / name, src / name)
    for junk in src.rglob("__pycache__"):
        shutil.rmtree(junk)
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", tmp / "dist", src, cwd=tmp)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("skupin-*.whl")
    with zipfile.ZipFile(wheel) as whl:  # one import package: nothing else lands in site-packages
        tops = {name.split("/")[0] for name in whl.namelist() if not name.split("/")[0].endswith(".dist-info")}
        assert tops == {"skupin"}, tops
        names = set(whl.namelist())
    assert {"skupin/templates/base.Dockerfile.j2", "skupin/builder/data/compat.yaml", "skupin/gates/data/tolerances.yaml",
            "skupin/imagetools/probe/skupin_probe.py", "skupin/imagetools/probe/skupin_probe_vllm.py"} <= names
    venv = tmp / "venv"
    assert _run("python3", "-m", "venv", venv, cwd=tmp).returncode == 0
    pip = _run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel, cwd=tmp)
    assert pip.returncode == 0, pip.stderr[-3000:]
    code = "import skupin.builder, skupin.gates as g; print(skupin.builder.__file__, g.__file__)"
    where = _run(venv / "bin" / "python", "-c", code,
                 cwd=tmp)
    assert "site-packages" in where.stdout and str(REPO) not in where.stdout, where.stdout  # not this checkout
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKUPIN_") and k != "PYTHONPATH"}
    env.update(XDG_CACHE_HOME=str(tmp / "cache"))
    yield venv / "bin" / "skupin", env


def _package_state(skupin: Path) -> dict[str, tuple[int, int]]:
    """Every file of the installed package (size, mtime): nothing a command does may write into it."""
    site = next(skupin.parent.parent.glob("lib/python3*/site-packages"))
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for name in ("skupin",)
            for p in (site / name).rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_a_copied_catalog_checks_renders_and_locks_offline(installed, tmp_path, honest_image, wheelhouse):
    skupin, env = installed
    before = _checkout_state()
    package = _package_state(skupin)
    catalog = tmp_path / "catalog"
    shutil.copytree(SKUS, catalog / "skus")  # a catalog is its skus/ folder: templates and bundles ship in the wheel
    (catalog / "ops").mkdir()

    check = _run(skupin, "check", "--json", cwd=catalog / "ops", env=env)  # found from a folder below the catalog
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    report = json.loads(check.stdout)
    assert {m["sku"] for m in report["manifests"]} == {p.stem for p in SKUS.glob("*.yaml")}
    assert all(m["file"].startswith(str(catalog)) for m in report["manifests"])
    assert {m["lock"] for m in report["manifests"] if m["sku"].startswith("cpu-")} == {"ok"}

    render = _run(skupin, "render", "cpu-x86_64", cwd=catalog, env=env)
    assert render.returncode == 0, render.stderr
    assert render.stdout == _run(REPO / ".venv" / "bin" / "skupin", "render", "cpu-x86_64", cwd=REPO).stdout

    committed = read_lock(CPU_LOCK)
    files: dict[str, list[tuple[Path, str]]] = {}
    for pkg in committed.packages().values():
        if pkg.source == "index":
            stored = store_path(wheel_store(), pkg)
            assert stored.is_file(), f"{stored}: the honest image's build put every locked wheel in the store"
            files.setdefault(canonicalize_name(pkg.name), []).append((stored, pkg.sha256))
    state: dict = {}
    with serve_wheels(files, state) as index:
        args = ["lock", "cpu-x86_64", "--json", "--index-url", index]
        lock = _run(skupin, *args, *(["--wheelhouse", wheelhouse] if wheelhouse else []), cwd=catalog, env=env)
    assert lock.returncode == 0, lock.stdout[-2000:] + lock.stderr[-3000:]
    assert json.loads(lock.stdout)["lock"] == str(catalog / "skus" / "cpu-x86_64.lock.json")
    assert any(r.startswith("/simple/") for r in state["requests"])  # resolved against the loopback index
    relocked = read_lock(catalog / "skus" / "cpu-x86_64.lock.json")
    same = lambda lk: {(p.name, p.version, p.sha256) for p in lk.packages().values()}  # noqa: E731
    assert same(relocked) == same(committed)  # the same files; only their URLs name the loopback index
    assert _run(skupin, "check", "cpu-x86_64", cwd=catalog, env=env).returncode == 0
    assert _checkout_state() == before  # the checkout the wheel came from was never touched
    assert _package_state(skupin) == package  # nor the installed package


def test_an_operator_with_no_catalog_verifies_inspects_and_pulls(installed, tmp_path, docker, registry, tiny):
    skupin, env = installed
    lock = make_lock()
    image = tiny.make("operator")
    published = publish(docker=docker, registry=registry, image_id=image, lock=lock,
                        verdict=make_verdict(image_id=image, lock=lock))
    key = tmp_path / "team.pub"
    key.write_bytes(SIGNER.public_pem())
    empty = tmp_path / "empty"
    empty.mkdir()
    ref = f"{registry.addr}/tiny-test:verified"

    verify = _run(skupin, "verify", ref, "--key", key, "--json", cwd=empty, env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    answer = json.loads(verify.stdout)
    assert answer["ok"] and answer["digest"] == published.digest and answer["catalog"] is None
    text = _run(skupin, "verify", ref, "--key", key, cwd=empty, env=env).stdout
    assert "no catalog: not compared with a current lock" in text

    shown = _run(skupin, "inspect", ref, "--key", key, cwd=empty, env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"-> {registry.addr}/tiny-test@{published.digest}" in shown.stdout
    assert f"signed by {SIGNER.keyid}" in shown.stdout and "decision         pass: passed" in shown.stdout
    record = json.loads(_run(skupin, "inspect", ref, "--key", key, "--json", cwd=empty, env=env).stdout)
    assert record["records"][0]["predicate"]["lock_sha256"] == lock.content_hash()

    pull = _run(skupin, "pull", "tiny-test", "--registry", registry.addr, "--key", key, "--json", cwd=empty, env=env)
    assert pull.returncode == 0, pull.stdout + pull.stderr
    assert json.loads(pull.stdout)["image_id"] == image
    stranger = _run(skupin, "verify", ref, cwd=empty, env=env)  # no key trusted here: refused, never a pass
    assert stranger.returncode == 8 and "no trusted public keys" in stranger.stdout
    gone = _run(skupin, "verify", "127.0.0.1:9/tiny-test:verified", "--key", key, cwd=empty, env=env)
    assert gone.returncode == 9, gone.stdout + gone.stderr  # the registry cannot be reached: a network error
    gone = _run(skupin, "pull", "tiny-test", "--registry", "127.0.0.1:9", "--key", key, cwd=empty, env=env)
    assert gone.returncode == 9, gone.stdout + gone.stderr  # pull answers the same way
    assert list(empty.iterdir()) == []  # nothing written where the operator stood
