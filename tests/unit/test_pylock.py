"""The PEP 751 form of a lock (builder/catalog/pylock.py): exact text, valid for tomllib and packaging's reader, written
by every relock, and checked beside every committed lock."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from skupin.builder.catalog.lockfile import Lock, LockedBase, LockedPackage, lock_path, read_lock
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.catalog.pylock import environment_marker, pylock_path, pylock_problem, pylock_text, write_pylock
from skupin.builder.check import check_file
from tests.paths import REPO, SKUS

A, B, C, D = "a" * 64, "b" * 64, "c" * 64, "d" * 64
U = "https://f.example/"


def _pylock_reader():
    """packaging's PEP 751 reader and validator (packaging.pylock, in recent packaging; pyproject asks only >=23)."""
    return pytest.importorskip("packaging.pylock")


def _lock(**update) -> Lock:
    lock = Lock(
        sku="tiny", manifest_sha256=A, python="3.12", platform="linux/arm64",
        base=LockedBase(kind="image", reference="debian@sha256:" + A, digest="sha256:" + A),
        layers={
            "framework": (LockedPackage(name="Torch", version="2.13+cpu", sha256=B, source="wheelhouse",
                                        filename="torch-2.13+cpu-py3-none-any.whl"),),
            "engine": (LockedPackage(name="llama_cpp_python", version="0.3.36", filename="llama_cpp_python-0.3.36.tar.gz",
                                     sha256=C, url="https://f.example/llama_cpp_python-0.3.36.tar.gz", source="sdist"),
                       LockedPackage(name="anyio", version="4.16.0", filename="anyio-4.16.0-py3-none-any.whl", sha256=D,
                                     url="https://f.example/anyio-4.16.0-py3-none-any.whl")),
        },
        build=(LockedPackage(name="scikit-build-core", version="0.11.0", filename="scikit_build_core-0.11.0-py3-none-any.whl",
                             sha256=A, url="https://f.example/scikit_build_core-0.11.0-py3-none-any.whl"),),
        resolver="uv 0.13.9", tool_version="0.1.0", created="2026-12-02T10:00:00Z",
    )
    return lock.model_copy(update=update) if update else lock


def test_the_exact_text():
    lock = _lock()
    assert pylock_text(lock) == f'''lock-version = "1.0"
environments = ["sys_platform == 'linux' and platform_machine == 'aarch64'"]
requires-python = "==3.12.*"
created-by = "skupin"

[[packages]]
name = "anyio"
version = "4.16.0"
wheels = [{{ name = "anyio-4.16.0-py3-none-any.whl", url = "{U}anyio-4.16.0-py3-none-any.whl", hashes = {{ sha256 = "{D}" }} }}]

[[packages]]
name = "llama-cpp-python"
version = "0.3.36"
sdist = {{ name = "llama_cpp_python-0.3.36.tar.gz", url = "{U}llama_cpp_python-0.3.36.tar.gz", hashes = {{ sha256 = "{C}" }} }}

[[packages]]
name = "torch"
version = "2.13+cpu"
wheels = [{{ name = "torch-2.13+cpu-py3-none-any.whl", path = "torch-2.13+cpu-py3-none-any.whl", hashes = {{ sha256 = "{B}" }} }}]

[tool.skupin]
sku = "tiny"
lock-sha256 = "{lock.content_hash()}"
'''


def test_the_same_lock_the_same_text_whatever_its_time_or_layer_order():
    lock = _lock()
    swapped = lock.model_copy(update={"created": "2030-01-01T00:00:00Z",
                                      "layers": {"engine": lock.layers["engine"], "framework": lock.layers["framework"]}})
    assert pylock_text(swapped) == pylock_text(lock)
    names = [line for line in pylock_text(lock).splitlines() if line.startswith("name = ")]
    assert names == sorted(names)  # by name, not by layer


def test_the_text_is_a_valid_pep751_lock():
    data = tomllib.loads(pylock_text(_lock()))
    pylock = _pylock_reader().Pylock.from_dict(data)  # packaging's own validator
    assert str(pylock.lock_version) == "1.0" and pylock.created_by == "skupin"
    assert [str(p.name) for p in pylock.packages] == ["anyio", "llama-cpp-python", "torch"]
    assert pylock.packages[1].sdist is not None and pylock.packages[1].wheels is None
    assert "scikit-build-core" not in {str(p.name) for p in pylock.packages}  # the build stage's wheels: not installed


@pytest.mark.parametrize(("platform", "marker"), [
    ("linux/amd64", "sys_platform == 'linux' and platform_machine == 'x86_64'"),
    ("linux/arm64", "sys_platform == 'linux' and platform_machine == 'aarch64'"),
    ("linux/riscv64", "sys_platform == 'linux'"),
])
def test_the_environment_is_the_images_platform(platform, marker):
    assert environment_marker(platform) == marker


def test_the_file_is_named_as_pep751_names_it():
    path = pylock_path(SKUS / "cpu-x86_64.lock.json")
    assert path == SKUS / "pylock.cpu-x86_64.toml" and _pylock_reader().is_valid_pylock_path(path)


@pytest.mark.parametrize("lock_file", sorted([*SKUS.glob("*.lock.json"), *(REPO / "docs/examples/skus").glob("*.lock.json")]),
                         ids=lambda p: p.name)
def test_every_committed_lock_has_its_pylock(lock_file):
    lock = read_lock(lock_file)
    assert pylock_path(lock_file).read_text(encoding="utf-8") == pylock_text(lock)
    pylock = _pylock_reader().Pylock.from_dict(tomllib.loads(pylock_text(lock)))
    assert {str(p.name) for p in pylock.packages} == set(lock.packages())


def test_check_reports_a_different_pylock_as_a_stale_lock_and_a_missing_one_in_its_note(tmp_path):
    for name in ("cpu-x86_64.yaml", "cpu-x86_64.lock.json", "pylock.cpu-x86_64.toml"):
        shutil.copy(SKUS / name, tmp_path / name)
    manifest, pylock = tmp_path / "cpu-x86_64.yaml", tmp_path / "pylock.cpu-x86_64.toml"
    assert check_file(manifest).stack.lock_state == "ok"  # type: ignore[union-attr]
    pylock.write_text(pylock.read_text().replace('created-by = "skupin"', 'created-by = "someone"'))
    stack = check_file(manifest).stack
    assert stack is not None and stack.lock_state == "stale" and "pylock.cpu-x86_64.toml differs from the lock" in stack.lock_note
    pylock.unlink()  # a lock copied alone is still the lock: its note says how to write the PEP 751 form
    stack = check_file(manifest).stack
    assert stack is not None and stack.lock_state == "ok" and "no pylock.cpu-x86_64.toml" in stack.lock_note
    lock = read_lock(tmp_path / "cpu-x86_64.lock.json")
    assert pylock_problem(lock, tmp_path / "cpu-x86_64.lock.json") is None
    pylock.mkdir()  # not a regular file: stale
    assert "not a regular file" in (pylock_problem(lock, tmp_path / "cpu-x86_64.lock.json") or "")
    pylock.rmdir()
    write_pylock(lock, tmp_path / "cpu-x86_64.lock.json")
    assert pylock_problem(lock, tmp_path / "cpu-x86_64.lock.json") is None


def test_check_exits_4_on_a_stale_pylock(tmp_path, monkeypatch, capsys):
    from skupin.cli import main

    (tmp_path / "skus").mkdir()
    for name in ("cpu-x86_64.yaml", "cpu-x86_64.lock.json", "pylock.cpu-x86_64.toml"):
        shutil.copy(SKUS / name, tmp_path / "skus" / name)
    pylock = tmp_path / "skus" / "pylock.cpu-x86_64.toml"
    pylock.write_text(pylock.read_text().replace("==3.11.*", "==3.12.*"))
    monkeypatch.chdir(tmp_path)
    assert main(["--root", str(tmp_path), "check", "cpu-x86_64"]) == 4
    assert "pylock.cpu-x86_64.toml differs from the lock" in capsys.readouterr().out


def test_every_committed_lock_has_its_pylock_beside_it():
    locks = sorted(SKUS.glob("*.lock.json"))
    assert locks and all((SKUS / f"pylock.{p.name.removesuffix('.lock.json')}.toml").is_file() for p in locks)


def test_relock_writes_the_pylock_beside_the_lock(tmp_path, monkeypatch):
    import skupin.builder.lock as locking

    manifest_path = tmp_path / "cpu-x86_64.yaml"
    shutil.copy(SKUS / "cpu-x86_64.yaml", manifest_path)
    shipped = read_lock(SKUS / "cpu-x86_64.lock.json")
    monkeypatch.setattr(locking, "lock_sku", lambda **_kw: shipped)
    assert locking.relock(manifest=load_manifest(manifest_path), manifest_path=manifest_path) == shipped
    assert read_lock(lock_path(manifest_path)) == shipped
    assert (tmp_path / "pylock.cpu-x86_64.toml").read_text(encoding="utf-8") == pylock_text(shipped)
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_module_rewrites_pylocks_from_their_locks(tmp_path, capsys):
    from skupin.builder.catalog.pylock import main

    shutil.copy(SKUS / "cpu-x86_64.lock.json", tmp_path)
    assert main([str(tmp_path / "cpu-x86_64.lock.json")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "pylock.cpu-x86_64.toml")
    assert (tmp_path / "pylock.cpu-x86_64.toml").read_bytes() == (SKUS / "pylock.cpu-x86_64.toml").read_bytes()
    assert main([str(tmp_path / "none.lock.json")]) == 4 and "no lock" in capsys.readouterr().err
    assert main([]) == 2


def test_write_pylock_replaces_the_old_file(tmp_path: Path):
    lock_file = tmp_path / "tiny.lock.json"
    (tmp_path / "pylock.tiny.toml").write_text("old")
    assert write_pylock(_lock(), lock_file) == tmp_path / "pylock.tiny.toml"
    assert (tmp_path / "pylock.tiny.toml").read_text(encoding="utf-8") == pylock_text(_lock())
