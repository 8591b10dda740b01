"""Layer indexes: overlay2 folders and OCI tars read the same way, merged as overlayfs does, links never followed."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from skupin.common.untrusted import UntrustedInputError
from skupin.imageview.layers import Entry, FileView, LayerIndex, merge, open_in_layer, scan_layer_dir, scan_layer_tar
from tests.data.threads import finishes


def _tar(members: list[tuple[str, bytes | str | None]]) -> io.BytesIO:
    """A layer tar: (name, bytes) files, (name, None) folders, (name, '->target') symlinks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data[2:]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def test_a_tar_layer_records_files_links_and_whiteouts() -> None:
    layer = scan_layer_tar(_tar([("usr/", None), ("usr/bin/tool", b"\x7fELF..."), ("usr/lib/x.py", b"print(1)\n"),
                                 ("usr/lib/link.py", "->/etc/hook"), ("usr/.wh.gone", b""),
                                 ("opt/.wh..wh..opq", b"")]), diff_id="sha256:1")
    assert layer.entries["usr/bin/tool"].elf and layer.entries["usr/bin/tool"].kind == "f"
    assert layer.entries["usr/lib/x.py"].size == 9 and len(layer.entries["usr/lib/x.py"].sha256) == 64
    assert layer.entries["usr/lib/link.py"] == Entry("l", 0o644, 0, 1_700_000_000, target="/etc/hook")
    assert layer.entries["usr/gone"].kind == "w" and layer.opaque == {"opt"}


def test_merge_applies_whiteouts_opaque_folders_and_replacements() -> None:
    f = Entry("f", 0o644, 1, 0, "a" * 64, "b" * 32)
    low = LayerIndex("l0", {"a": Entry("d", 0o755, 0, 0), "a/x": f, "b/y": f, "c": Entry("d", 0o755, 0, 0), "c/z": f,
                            "keep": f})
    high = LayerIndex("l1", {"a": Entry("w", 0, 0, 0), "b/new": f, "c": Entry("f", 0o644, 1, 0, "c" * 64)},
                      opaque={"b"})
    merged = merge([low, high])
    assert set(merged) == {"b/new", "c", "keep"}
    assert merged["keep"].layer == 0 and merged["b/new"].layer == 1 and merged["c"].kind == "f"


def test_a_folder_layer_is_read_without_following_links(tmp_path: Path) -> None:
    root = tmp_path / "layer"
    (root / "site").mkdir(parents=True)
    (root / "site" / "mod.py").write_text("x = 1\n")
    (root / "site" / "evil.py").symlink_to("/etc/passwd")
    (root / "lib").symlink_to("/etc")  # a folder link in the layer must not be walked into
    os.mkfifo(root / "site" / "fifo")
    layer = scan_layer_dir(root, diff_id="sha256:2")
    assert layer.entries["site/evil.py"].kind == "l" and layer.entries["site/evil.py"].target == "/etc/passwd"
    assert layer.entries["lib"].kind == "l" and not any(p.startswith("lib/") for p in layer.entries)
    assert layer.entries["site/fifo"].kind == "o"
    with pytest.raises(OSError):
        open_in_layer(root, "lib/passwd")  # the link component is refused (O_NOFOLLOW on every step)
    with pytest.raises(OSError):
        open_in_layer(root, "site/evil.py")
    with pytest.raises(UntrustedInputError):
        open_in_layer(root, "site/../../x")
    with os.fdopen(open_in_layer(root, "site/mod.py"), "rb") as handle:
        assert handle.read() == b"x = 1\n"


def test_index_round_trips_through_its_cache_format() -> None:
    layer = scan_layer_tar(_tar([("a/b.py", b"1"), ("a/l", "->b.py")]), diff_id="sha256:3")
    again = LayerIndex.from_json(layer.to_json(), diff_id="sha256:3")
    assert again.entries == layer.entries
    with pytest.raises(ValueError):
        LayerIndex.from_json(layer.to_json(), diff_id="sha256:other")


def test_resolve_follows_the_images_links_inside_the_image_only() -> None:
    d, f = Entry("d", 0o755, 0, 0), Entry("f", 0o644, 1, 0)
    view = FileView(entries={"usr": d, "usr/bin": d, "usr/bin/python3.11": f, "bin": Entry("l", 0, 0, 0, target="usr/bin"),
                             "usr/bin/python3": Entry("l", 0, 0, 0, target="python3.11"),
                             "loop": Entry("l", 0, 0, 0, target="/loop"),
                             "up": Entry("l", 0, 0, 0, target="../../../usr/bin/python3")}, layers=())
    assert view.resolve("bin/python3") == "usr/bin/python3.11"
    assert view.resolve("/up") == "usr/bin/python3.11"  # .. never leaves the image's root
    assert view.resolve("loop") is None and view.resolve("usr/nothing") is None


def test_a_folder_layer_with_more_folders_than_open_files_is_indexed(tmp_path: Path) -> None:
    import resource

    root = tmp_path / "layer"
    for n in range(400):
        (root / "wide" / f"d{n:03d}" / "sub").mkdir(parents=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64, hard))
    try:
        layer = scan_layer_dir(root, diff_id="sha256:wide")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(layer.entries) == 1 + 400 * 2 and layer.entries["wide/d399/sub"].kind == "d"


def test_a_folder_layer_nested_too_deep_is_refused(tmp_path: Path) -> None:
    from skupin.imageview.layers import MAX_DEPTH

    root = tmp_path / "layer"
    deep = root.joinpath(*["d"] * (MAX_DEPTH + 1))
    deep.mkdir(parents=True)
    with pytest.raises(UntrustedInputError, match=f"deeper than {MAX_DEPTH}"):
        scan_layer_dir(root, diff_id="sha256:deep")
    ok = tmp_path / "ok"
    ok.joinpath(*["d"] * MAX_DEPTH).mkdir(parents=True)
    assert len(scan_layer_dir(ok, diff_id="sha256:ok").entries) == MAX_DEPTH


@pytest.mark.parametrize("data", [b"not a tar archive" * 40, _tar([("a/b.py", b"x" * 2000)]).getvalue()[:1024]])
def test_a_broken_layer_tar_is_untrusted_input_not_a_traceback(data: bytes) -> None:
    from skupin.imageview.layers import iter_saved_layers

    with pytest.raises(UntrustedInputError, match="tar"):
        scan_layer_tar(io.BytesIO(data), diff_id="sha256:broken")
    with pytest.raises(UntrustedInputError, match="tar"):
        list(iter_saved_layers(io.BytesIO(data)))


def _merge_as_specified(layers: list[LayerIndex]) -> dict[str, Entry]:
    """merge() as it was first written (one scan of the merged map per whiteout): the semantics to keep."""
    def drop_under(merged: dict[str, Entry], folder: str) -> None:
        prefix = folder.rstrip("/") + "/"
        for path in [p for p in merged if p.startswith(prefix)]:
            del merged[path]

    merged: dict[str, Entry] = {}
    for number, layer in enumerate(layers):
        for folder in layer.opaque:
            drop_under(merged, folder)
        for path, entry in layer.entries.items():
            if entry.kind == "w":
                merged.pop(path, None)
                drop_under(merged, path)
        for path, entry in layer.entries.items():
            if entry.kind == "w":
                continue
            old = merged.get(path)
            if entry.kind != "d" and old is not None and old.kind == "d":
                drop_under(merged, path)
            merged[path] = entry._replace(layer=number)
    return merged


def _random_layers(seed: int) -> list[LayerIndex]:
    """Well-formed layers (every path's parents are folders in it) over a small tree, so paths collide often."""
    import random

    rng = random.Random(seed)
    names = ["a", "b", "c", "ab", "a.b"]
    layers = []
    for number in range(rng.randint(1, 6)):
        entries: dict[str, Entry] = {}
        opaque: set[str] = set()
        for _ in range(rng.randint(0, 25)):
            parts = [rng.choice(names) for _ in range(rng.randint(1, 4))]
            for depth in range(1, len(parts)):
                parent = "/".join(parts[:depth])
                if entries.get(parent, Entry("d", 0, 0, 0)).kind != "d":
                    break
                entries[parent] = Entry("d", 0o755, 0, number)
            else:
                path = "/".join(parts)
                if any(p.startswith(path + "/") for p in entries):
                    continue
                kind = rng.choice("fdwl")
                entries[path] = Entry(kind, 0o644, 1, number)
                if kind == "d" and rng.random() < 0.3:
                    opaque.add(path)
        layers.append(LayerIndex(f"l{number}", entries, opaque))
    return layers


@pytest.mark.parametrize("seed", range(300))
def test_merge_keeps_its_semantics_on_random_layers(seed: int) -> None:
    layers = _random_layers(seed)
    merged = merge(layers)
    want = _merge_as_specified(layers)
    assert merged == want and list(merged) == list(want)


def test_merge_takes_linear_time_in_whiteouts() -> None:
    f = Entry("f", 0o644, 1, 0, "a" * 64, "b" * 32)
    low = LayerIndex("l0", {f"pkg{n}/mod{m}.py": f for n in range(20_000) for m in range(10)})
    high = LayerIndex("l1", {f"pkg{n}/mod0.py": Entry("w", 0, 0, 0) for n in range(0, 20_000, 2)}
                      | {f"pkg{n}": Entry("w", 0, 0, 0) for n in range(1, 20_000, 4)})
    merged = finishes(lambda: merge([low, high]))  # 15,000 whiteouts over 200,000 paths
    assert len(merged) == 200_000 - 10_000 - 5_000 * 10
    assert "pkg0/mod1.py" in merged and "pkg0/mod0.py" not in merged and "pkg1/mod5.py" not in merged


def test_two_gates_caching_one_layer_do_not_share_a_temporary_file(tmp_path: Path, monkeypatch) -> None:
    from skupin.imageview import layers

    layer = scan_layer_tar(_tar([("a/b.py", b"1")]), diff_id="sha256:" + "c" * 64)
    seen: list[str] = []
    real_replace = os.replace

    def replace(src, dst) -> None:
        seen.append(str(src))
        real_replace(src, dst)

    monkeypatch.setattr(layers.os, "replace", replace)
    (tmp_path / ("c" * 64 + ".dir.json.part")).write_bytes(b"another gate's half-written index")
    layers._cache(layer, tmp_path, "dir")
    layers._cache(layer, tmp_path, "dir")
    assert len(set(seen)) == 2 and all(Path(s).parent == tmp_path for s in seen)  # a fresh name each time
    assert (tmp_path / ("c" * 64 + ".dir.json.part")).read_bytes() == b"another gate's half-written index"
    assert layers._cached(tmp_path, layer.diff_id, "dir").entries == layer.entries
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c" * 64 + ".dir.json.gz", "c" * 64 + ".dir.json.part"]


# ---------------------------------------------------------------- hostile tar headers (BoundedTarInfo)


def _header(name: str, kind: bytes, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _pax(payload: bytes) -> bytes:
    return _header("././@PaxHeader", tarfile.XHDTYPE, len(payload)) + payload + b"\0" * (-len(payload) % 512)


def _file(name: str, data: bytes = b"x") -> bytes:
    return _header(name, tarfile.REGTYPE, len(data)) + data + b"\0" * (-len(data) % 512)


END = b"\0" * 1024


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME])
def test_an_extended_header_larger_than_go_reads_is_refused_before_it_is_read(kind: bytes) -> None:
    # tarfile would read all 8 GiB into memory (a few MB of gzip make them); the stream here holds only its header
    stream = io.BytesIO(_header("././@LongLink", kind, 8 * 1024**3 - 1) + b"\0" * 4096)
    with pytest.raises(UntrustedInputError, match="extended tar header of 8589934591 bytes"):
        scan_layer_tar(stream, diff_id="sha256:1")


def test_pax_records_are_parsed_in_linear_time() -> None:
    # CPython 3.11.7 looks for hdrcharset with a regex that is quadratic in a run of digits (CVE-2024-6232): this
    # header took minutes there; a record of 1,000,000 digits is read here in a blink
    value = b"1" * 1_000_000
    record = b" comment=" + value + b"\n"
    length = len(record) + 7
    assert len(str(length)) == 7
    stream = io.BytesIO(_pax(b"%d%s" % (length, record)) + _file("usr/a") + END)
    assert finishes(lambda: scan_layer_tar(stream, diff_id="sha256:1"), within=10).entries["usr/a"].size == 1


@pytest.mark.parametrize("payload", [b"3 a" * 1000 + b"=", b"5 x=1", b"99 path=a\n", b"6 =ab\n", b"6 path=\n" + b"junk"])
def test_a_malformed_pax_record_is_refused(payload: bytes) -> None:
    # the first: tarfile's own parser keeps a keyword per 3 bytes, each the rest of the header (quadratic memory)
    with pytest.raises(UntrustedInputError, match="pax record|after the pax records"):
        scan_layer_tar(io.BytesIO(_pax(payload) + _file("usr/a") + END), diff_id="sha256:1")


def test_pax_names_and_binary_xattrs_read_as_tarfile_reads_them() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("a" * 300, "\udcffname"):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = 1, 1.5
            info.pax_headers = {"SCHILY.xattr.security.capability": "\x01\udc80"}
            tar.addfile(info, io.BytesIO(b"z"))
    layer = scan_layer_tar(io.BytesIO(buf.getvalue()), diff_id="sha256:1")
    assert set(layer.entries) == {"\udcffname", "a" * 300} and layer.entries["a" * 300].mtime == 1


def test_sparse_files_and_endless_header_chains_are_refused() -> None:
    sparse = _header("usr/s", tarfile.GNUTYPE_SPARSE, 0)
    with pytest.raises(UntrustedInputError, match="sparse"):
        scan_layer_tar(io.BytesIO(sparse + END), diff_id="sha256:1")
    with pytest.raises(UntrustedInputError, match="sparse"):
        scan_layer_tar(io.BytesIO(_pax(b"22 GNU.sparse.major=1\n") + _file("usr/a") + END), diff_id="sha256:1")
    # 2000 long names in a row: tarfile recursed once per header (RecursionError, a traceback)
    chain = b"".join(_header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 1) + b"a" + b"\0" * 511 for _ in range(2000))
    with pytest.raises(UntrustedInputError, match="in a row"):
        scan_layer_tar(io.BytesIO(chain + _file("usr/a") + END), diff_id="sha256:1")


def test_an_invalid_header_after_the_first_is_an_error_not_the_end_of_the_layer() -> None:
    # tarfile ends the archive silently at a bad checksum: every later entry would be missing from the index
    bad = bytearray(_file("usr/hidden"))
    bad[148:156] = b"0000000\0"
    with pytest.raises(UntrustedInputError, match="invalid tar header"):
        scan_layer_tar(io.BytesIO(_file("usr/a") + bytes(bad) + _file("usr/b") + END), diff_id="sha256:1")
