"""builder/wheels.py without a network: the store, the wheelhouse, and what is refused before any download."""

from __future__ import annotations

import hashlib
import os

import pytest

from skupin.builder.catalog.lockfile import LockedPackage
from skupin.builder.wheels import fetch_wheels, store_path
from skupin.common.errors import BuildError


def _pkg(name: str, data: bytes, *, source: str = "index", url: str | None = "https://files.example/x.whl") -> LockedPackage:
    return LockedPackage(name=name, version="1.0", filename=f"{name}-1.0-py3-none-any.whl",
                         sha256=hashlib.sha256(data).hexdigest(), url=url, source=source)


def test_a_wheel_in_the_store_costs_no_download(tmp_path):
    store = tmp_path / "store"
    pkg = _pkg("a", b"wheel a")
    stored = store_path(store, pkg)
    stored.parent.mkdir(parents=True)
    stored.write_bytes(b"wheel a")
    events: list[str] = []
    # The URL cannot be reached: a download attempt would fail.
    got = fetch_wheels([pkg.model_copy(update={"url": "https://127.0.0.1:9/a.whl"})], store=store, on_event=events.append)
    assert got == {pkg.sha256: stored}
    assert events == [f"wheels: 1 locked, 1 in the store {store}"]


def test_wheelhouse_files_are_checked_and_linked_into_the_store(tmp_path):
    house, store = tmp_path / "house", tmp_path / "store"
    house.mkdir()
    pkg = _pkg("torch", b"the torch wheel", source="wheelhouse", url=None)
    (house / pkg.filename).write_bytes(b"the torch wheel")
    events: list[str] = []
    got = fetch_wheels([pkg, pkg], store=store, wheelhouse=house, on_event=events.append)
    stored = got[pkg.sha256]
    assert stored == store / pkg.sha256[:2] / pkg.sha256 / pkg.filename
    assert stored.stat().st_ino == (house / pkg.filename).stat().st_ino  # a hard link, not a copy
    assert events == [f"wheels: 1 locked, 0 in the store {store}, 1 from the wheelhouse"]
    assert [p.name for p in stored.parent.iterdir()] == [pkg.filename]  # no temporary file left


def test_a_wheelhouse_file_with_another_hash_is_refused(tmp_path):
    house, store = tmp_path / "house", tmp_path / "store"
    house.mkdir()
    pkg = _pkg("torch", b"locked bytes", source="wheelhouse", url=None)
    (house / pkg.filename).write_bytes(b"other bytes")
    with pytest.raises(BuildError) as err:
        fetch_wheels([pkg], store=store, wheelhouse=house)
    assert f"{house / pkg.filename}: sha256 {hashlib.sha256(b'other bytes').hexdigest()}" in str(err.value)
    assert f"the lock says {pkg.sha256}" in str(err.value)
    assert not store_path(store, pkg).exists()


def test_everything_that_cannot_be_gathered_is_reported_together_before_any_download(tmp_path):
    missing = _pkg("torch", b"t", source="wheelhouse", url=None)
    no_url = _pkg("odd", b"o", url=None)
    git = _pkg("vllm", b"v", url="git+https://github.com/vllm-project/vllm@v0.25.1")
    with pytest.raises(BuildError) as err:
        fetch_wheels([missing, no_url, git, _pkg("fine", b"f", url="https://127.0.0.1:9/fine.whl")], store=tmp_path / "s")
    text = str(err.value)
    assert "torch-1.0-py3-none-any.whl: locked from a wheelhouse but not in (no --wheelhouse given)" in text
    assert "odd-1.0-py3-none-any.whl: the lock records no download URL (none)" in text
    assert "vllm-1.0-py3-none-any.whl: the lock records no download URL (git+https://" in text
    assert not (tmp_path / "s").exists()  # nothing was attempted


def test_prune_keeps_what_the_locks_name_and_drops_the_rest(tmp_path, capsys):
    import shutil

    from skupin.builder.catalog.lockfile import lock_path, read_lock
    from skupin.cli import main
    from tests.paths import SKUS

    skus = tmp_path / "skus"
    skus.mkdir()
    shutil.copy(SKUS / "cpu-x86_64.yaml", skus)
    shutil.copy(lock_path(SKUS / "cpu-x86_64.yaml"), skus)
    locked = next(iter(read_lock(lock_path(skus / "cpu-x86_64.yaml")).packages().values()))
    store = tmp_path / "store"
    kept = store_path(store, locked)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"locked")
    (kept.parent / f".{kept.name}.123.part").write_bytes(b"half")  # an interrupted download
    old = _pkg("transformers", b"an older engine wheel")
    stale = store_path(store, old)
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an older engine wheel")

    assert main(["wheels", "prune", str(skus), "--store", str(store), "--dry-run"]) == 0
    assert "would remove 2 file(s)" in capsys.readouterr().out and stale.exists()

    assert main(["wheels", "prune", str(skus), "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert f"removed {old.filename}" in out and "removed 2 file(s), 0.0 MB; 1 wheel(s) kept" in out
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]
    assert not stale.parent.exists() and not stale.parent.parent.exists()


def test_a_wheelhouse_of_links_stores_the_files_they_name(tmp_path):
    """A wheelhouse whose wheels are symbolic links (relative, absolute, a chain): the store holds the file itself, never
    the link (a stored relative link led nowhere inside the build: "no wheel has sha256 ...")."""
    real, house, store = tmp_path / "cache", tmp_path / "house", tmp_path / "store"
    real.mkdir()
    house.mkdir()
    pkgs = [_pkg(name, f"the {name} wheel".encode(), source="wheelhouse", url=None) for name in ("rel", "abs", "chain")]
    for pkg in pkgs:
        (real / pkg.filename).write_bytes(f"the {pkg.name} wheel".encode())
    (house / pkgs[0].filename).symlink_to(f"../cache/{pkgs[0].filename}")
    (house / pkgs[1].filename).symlink_to(real / pkgs[1].filename)
    (tmp_path / "hop").symlink_to(real / pkgs[2].filename)
    (house / pkgs[2].filename).symlink_to(tmp_path / "hop")
    got = fetch_wheels(pkgs, store=store, wheelhouse=house)
    for pkg in pkgs:
        stored = got[pkg.sha256]
        assert not stored.is_symlink() and stored.is_file()
        assert stored.stat().st_ino == (real / pkg.filename).stat().st_ino  # the file, hard-linked
        assert hashlib.sha256(stored.read_bytes()).hexdigest() == pkg.sha256
        assert [p.name for p in stored.parent.iterdir()] == [pkg.filename]


def test_a_link_stored_by_an_older_version_is_replaced_by_the_file(tmp_path):
    house, store = tmp_path / "house", tmp_path / "store"
    house.mkdir()
    pkg = _pkg("torch", b"the torch wheel", source="wheelhouse", url=None)
    (house / pkg.filename).write_bytes(b"the torch wheel")
    stored = store_path(store, pkg)
    stored.parent.mkdir(parents=True)
    stored.symlink_to(house / pkg.filename)  # what the store held before: resolves, but is a link
    events: list[str] = []
    fetch_wheels([pkg], store=store, wheelhouse=house, on_event=events.append)
    assert not stored.is_symlink() and stored.read_bytes() == b"the torch wheel"
    assert events == [f"wheels: 1 locked, 0 in the store {store}, 1 from the wheelhouse"]


def test_a_wheelhouse_link_to_a_non_regular_file_or_nothing_is_refused(tmp_path):
    house, store = tmp_path / "house", tmp_path / "store"
    house.mkdir()
    fifo, dev, folder, nothing, loop = (_pkg(n, n.encode(), source="wheelhouse", url=None)
                                        for n in ("fifo", "dev", "folder", "nothing", "loop"))
    os.mkfifo(tmp_path / "a-fifo")
    (house / fifo.filename).symlink_to(tmp_path / "a-fifo")
    (house / dev.filename).symlink_to("/dev/zero")
    (house / folder.filename).symlink_to(tmp_path)
    (house / nothing.filename).symlink_to(tmp_path / "gone.whl")
    (house / loop.filename).symlink_to(house / loop.filename)
    with pytest.raises(BuildError) as err:
        fetch_wheels([fifo, dev, folder, nothing, loop], store=store, wheelhouse=house)
    text = str(err.value)
    for pkg in (fifo, dev, folder):
        assert f"{house / pkg.filename} (a link to " in text and "is not a regular file" in text
    for pkg in (nothing, loop):
        assert f"{house / pkg.filename}: a link in the wheelhouse that leads to no file" in text
    assert not store.exists()  # refused before anything was stored


def test_a_linked_wheel_with_another_hash_is_refused_naming_the_link_and_its_file(tmp_path):
    house, store = tmp_path / "house", tmp_path / "store"
    house.mkdir()
    pkg = _pkg("torch", b"locked bytes", source="wheelhouse", url=None)
    (tmp_path / "other.whl").write_bytes(b"other bytes")
    (house / pkg.filename).symlink_to(tmp_path / "other.whl")
    with pytest.raises(BuildError, match=f"a link to {tmp_path / 'other.whl'}\\): sha256"):
        fetch_wheels([pkg], store=store, wheelhouse=house)
    assert not any(p.is_file() for p in store.rglob("*"))  # no stored file, no temporary one
    assert (tmp_path / "other.whl").read_bytes() == b"other bytes"
