"""builder/wheels.py downloads from a real HTTP server on loopback: checked, retried, nothing half-stored."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from skupin.builder.catalog.lockfile import LockedPackage
from skupin.builder.wheels import fetch_wheels, store_path
from skupin.common.errors import NetworkError
from tests.data.index.server import serve_index

pytestmark = pytest.mark.integration


def _served(tmp: Path, files: dict[str, bytes]) -> Path:
    root = tmp / "index"
    (root / "files").mkdir(parents=True)
    for name, data in files.items():
        (root / "files" / name).write_bytes(data)
    return root


def _pkg(url: str, name: str, data: bytes) -> LockedPackage:
    url = url.removesuffix("/simple")  # serve_index yields the index URL; files live next to it
    return LockedPackage(name=name.split("-")[0], version="1.0", filename=name, sha256=hashlib.sha256(data).hexdigest(),
                         url=f"{url}/files/{name}#sha256={hashlib.sha256(data).hexdigest()}")


def test_downloads_in_parallel_into_the_store_and_only_once(tmp_path):
    files = {f"p{i}-1.0-py3-none-any.whl": f"wheel {i}".encode() * 1000 for i in range(6)}
    state: dict = {"requests": []}
    with serve_index(_served(tmp_path, files), state) as url:
        pkgs = [_pkg(url, name, data) for name, data in files.items()]
        events: list[str] = []
        got = fetch_wheels(pkgs, store=tmp_path / "store", on_event=events.append, jobs=3)
        assert {p.sha256: got[p.sha256].read_bytes() for p in pkgs} == {p.sha256: files[p.filename] for p in pkgs}
        assert events[0] == f"wheels: 6 locked, 0 in the store {tmp_path / 'store'}, 6 to download"
        assert sorted(e.split()[1] for e in events[1:]) == sorted(files)
        assert len(state["requests"]) == 6
        fetch_wheels(pkgs, store=tmp_path / "store")
        assert len(state["requests"]) == 6  # the second time, all from the store


def test_a_download_with_another_hash_is_refused_and_not_kept(tmp_path):
    with serve_index(_served(tmp_path, {"a-1.0-py3-none-any.whl": b"what the index serves now"}), {"requests": []}) as url:
        pkg = _pkg(url, "a-1.0-py3-none-any.whl", b"what was locked")
        with pytest.raises(NetworkError) as err:
            fetch_wheels([pkg], store=tmp_path / "store")
    assert f"sha256 {hashlib.sha256(b'what the index serves now').hexdigest()}, but the lock says {pkg.sha256}" in str(err.value)
    folder = store_path(tmp_path / "store", pkg).parent
    assert not folder.exists() or list(folder.iterdir()) == []  # no file and no .part left


def test_busy_server_is_retried_and_a_missing_file_is_a_network_error(tmp_path):
    state: dict = {"requests": [], "fail": 2}
    with serve_index(_served(tmp_path, {"a-1.0-py3-none-any.whl": b"a"}), state) as url:
        pkg = _pkg(url, "a-1.0-py3-none-any.whl", b"a")
        got = fetch_wheels([pkg], store=tmp_path / "store", retries=3, backoff=0.0)
        assert got[pkg.sha256].read_bytes() == b"a" and len(state["requests"]) == 3
        gone = _pkg(url, "b-1.0-py3-none-any.whl", b"b")
        with pytest.raises(
            NetworkError, match="b-1.0-py3-none-any.whl: wheel download: GET .*/files/b-1.0-py3-none-any.whl answered HTTP 404"
        ):
            fetch_wheels([gone], store=tmp_path / "store", retries=1, backoff=0.0)
    with pytest.raises(NetworkError, match="failed after 2 attempt"):
        fetch_wheels([pkg.model_copy(update={"url": "http://127.0.0.1:9/a.whl", "sha256": "e" * 64})],
                     store=tmp_path / "store", retries=1, backoff=0.0, timeout=2)
