"""Layer indexes: overlay2 folders and OCI tars read the same way, merged as overlayfs does, links never followed."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from common.untrusted import UntrustedInputError
from gates.static.layers import Entry, FileView, LayerIndex, merge, open_in_layer, scan_layer_dir, scan_layer_tar


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
