"""The rewrite that makes a built image's id reproducible (builder/reproducible.py), on tars made here (no Docker)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from skupin.builder.reproducible import _Rewrite, normal_config, normalise_layer
from skupin.common.errors import BuildError

EPOCH = 1_796_133_825


def _layer(entries: list[tuple[str, bytes | None, int]], *, fmt: int = tarfile.GNU_FORMAT, uname: str = "root",
           xattr: str | None = None) -> bytes:
    """A layer tar: (name, content or None for a folder, mtime) in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data, mtime in entries:
            info = tarfile.TarInfo(name)
            info.mtime, info.uname, info.gname = mtime, uname, uname
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                if xattr is not None and fmt == tarfile.PAX_FORMAT:
                    info.pax_headers = {"SCHILY.xattr.security.capability": xattr, "atime": "123.5"}
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _rewrite(raw: bytes) -> tuple[str, str, bytes]:
    out = io.BytesIO()
    new, _ = normalise_layer(io.BytesIO(raw), out, epoch=EPOCH)
    return "sha256:" + hashlib.sha256(raw).hexdigest(), new, out.getvalue()


def test_build_times_are_clamped_and_older_times_kept() -> None:
    raw = _layer([("usr/", None, EPOCH + 5000), ("usr/a.py", b"print(1)\n", EPOCH + 99), ("usr/deb.txt", b"x", 1_600_000_000)])
    old, new, out = _rewrite(raw)
    assert old == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert new == "sha256:" + hashlib.sha256(out).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        got = {m.name: (m.mtime, m.uname, tar.extractfile(m).read() if m.isreg() else None) for m in tar}  # type: ignore[union-attr]
    assert got == {"usr": (EPOCH, "", None), "usr/a.py": (EPOCH, "", b"print(1)\n"), "usr/deb.txt": (1_600_000_000, "", b"x")}


def test_two_builds_that_differ_only_in_build_time_and_encoding_rewrite_to_one_layer() -> None:
    first = _layer([("etc/", None, EPOCH + 10), ("etc/ld.so.cache", b"cache", EPOCH + 11)], fmt=tarfile.GNU_FORMAT)
    second = _layer([("etc/", None, EPOCH + 7000), ("etc/ld.so.cache", b"cache", EPOCH + 7001)], fmt=tarfile.PAX_FORMAT,
                    uname="builder")
    assert first != second
    assert _rewrite(first)[1:] == _rewrite(second)[1:]


def test_content_modes_and_order_are_kept_so_a_changed_file_changes_the_layer() -> None:
    honest = _layer([("a", b"1", EPOCH), ("b", b"2", EPOCH)])
    changed = _layer([("a", b"1", EPOCH), ("b", b"3", EPOCH)])
    reordered = _layer([("b", b"2", EPOCH), ("a", b"1", EPOCH)])
    ids = {_rewrite(t)[1] for t in (honest, changed, reordered)}
    assert len(ids) == 3


def test_extended_attributes_stay_and_access_times_go() -> None:
    raw = _layer([("bin/ping", b"elf", EPOCH)], fmt=tarfile.PAX_FORMAT, xattr="\x01\x00\x00\x02")
    with tarfile.open(fileobj=io.BytesIO(_rewrite(raw)[2])) as tar:
        member = tar.getmember("bin/ping")
    assert member.pax_headers == {"SCHILY.xattr.security.capability": "\x01\x00\x00\x02"}


def test_the_rewrite_is_byte_stable() -> None:
    """LAYER_FORMAT's promise: this input rewrites to these bytes with every Python that runs skupin (a change here
    changes every published image id, so it must come with a new LAYER_FORMAT)."""
    raw = _layer([("opt/", None, EPOCH + 1), ("opt/x", b"x" * 700, EPOCH + 2), ("opt/" + "l" * 120, b"long", 5)])
    assert _rewrite(raw)[1] == "sha256:6c4e0f61dff70bdd669e94b6a17fc428b415d217cb550bb21d7ef36bf95dab63"


def test_an_unreadable_layer_is_a_build_error() -> None:
    with pytest.raises(BuildError, match="not a readable tar"):
        normalise_layer(io.BytesIO(b"\x01" * 1024), io.BytesIO(), epoch=EPOCH)


def test_the_config_keeps_what_the_dockerfile_set_and_drops_every_build_time() -> None:
    config = {"architecture": "amd64", "os": "linux", "created": "2026-12-02T16:00:01.123Z",
              "config": {"Env": ["A=1"], "Labels": {"x": "y"}},
              "history": [{"created": "2023-06-10T00:00:00Z", "comment": "Imported from -"},
                          {"created": "2026-12-02T16:00:00Z", "created_by": "RUN x", "comment": "buildkit.dockerfile.v0"}],
              "rootfs": {"type": "layers", "diff_ids": ["sha256:a", "sha256:b"]},
              "moby.buildkit.cache.v0": "e30="}
    out = normal_config(config, diff_ids=["sha256:a", "sha256:c"], epoch=EPOCH)
    assert out["config"] == config["config"] and "moby.buildkit.cache.v0" not in out
    assert out["rootfs"]["diff_ids"] == ["sha256:a", "sha256:c"]
    assert {h["created"] for h in out["history"]} == {out["created"]} == {"2026-12-01T14:03:45Z"}
    assert config["history"][1]["created"] == "2026-12-02T16:00:00Z"  # the input is not changed


def _saved(layers: list[bytes], config_extra: dict | None = None, *, top_first: bool = False) -> bytes:
    """A docker-save tarball of `layers` (bottom first in the config; in the tarball bottom first, or top first)."""
    diff_ids = ["sha256:" + hashlib.sha256(raw).hexdigest() for raw in layers]
    config = {"architecture": "amd64", "os": "linux", "created": "2026-12-02T16:00:00Z", "config": {},
              "rootfs": {"type": "layers", "diff_ids": diff_ids}, **(config_extra or {})}
    body = json.dumps(config).encode()
    name = hashlib.sha256(body).hexdigest() + ".json"
    files = [(f"{len(layers) - i if top_first else i:02d}{'0' * 62}/layer.tar", raw) for i, raw in enumerate(layers)]
    files += [(name, body), ("manifest.json", json.dumps([{"Config": name, "Layers": [f for f, _ in files]}]).encode())]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for fname, data in sorted(files):
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _load(chunks: bytes) -> tuple[dict, dict[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(chunks)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
    manifest = json.loads(files.pop("manifest.json"))[0]
    return manifest, files


def test_the_load_tarball_keeps_the_base_by_reference_and_carries_every_rewritten_layer(tmp_path) -> None:
    base = _layer([("bin/", None, 1_686_355_200)])
    upper = _layer([("opt/", None, EPOCH + 9), ("opt/f", b"f", EPOCH + 9)])
    base_id = "sha256:" + hashlib.sha256(base).hexdigest()
    rewrite = _Rewrite(io.BytesIO(_saved([base, upper])), epoch=EPOCH, keep=frozenset({base_id}), scratch=tmp_path,
                       on_event=lambda _: None)
    manifest, files = _load(b"".join(rewrite.chunks()))
    config = json.loads(files[manifest["Config"]])
    assert manifest["Config"] == hashlib.sha256(rewrite.image_config).hexdigest() + ".json"
    assert config["rootfs"]["diff_ids"][0] == base_id
    new_upper = config["rootfs"]["diff_ids"][1]
    assert manifest["Layers"][1] in files and manifest["Layers"][0] not in files  # the engine has the base already
    assert "sha256:" + hashlib.sha256(files[manifest["Layers"][1]]).hexdigest() == new_upper
    assert rewrite.kept == 1 and len(rewrite.renamed) == 1 and list(tmp_path.iterdir()) == []


def test_a_save_without_a_layer_of_its_config_is_refused(tmp_path) -> None:
    upper = _layer([("opt/f", b"f", EPOCH)])
    saved = _saved([upper], config_extra={"rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}})
    rewrite = _Rewrite(io.BytesIO(saved), epoch=EPOCH, keep=frozenset(), scratch=tmp_path, on_event=lambda _: None)
    with pytest.raises(BuildError, match="no layer for 1 diff id"):
        b"".join(rewrite.chunks())


def test_a_rewritten_layer_rewrites_to_itself() -> None:
    """Normalising a normalised image changes nothing (its id stays: a rebuild that hits BuildKit's cache of a loaded
    image, or a second normalise, is a no-op)."""
    raw = _layer([("a/", None, EPOCH + 3), ("a/b", b"b", EPOCH + 4)], fmt=tarfile.GNU_FORMAT)
    once = _rewrite(raw)[2]
    assert _rewrite(once)[2] == once


def test_docker_25_s_oci_layout_rewrites_to_the_same_image(tmp_path) -> None:
    """Docker >= 25 saves an OCI layout (config and layers as blobs/sha256/<hex>, the OCI manifest a blob, the legacy
    layer.tar names as links): the rewrite reads it to the same image as the legacy layout."""
    base = _layer([("bin/", None, 1_686_355_200)])
    upper = _layer([("opt/", None, EPOCH + 9), ("opt/f", b"f", EPOCH + 9)])
    base_id = "sha256:" + hashlib.sha256(base).hexdigest()
    legacy = _saved([base, upper])
    with tarfile.open(fileobj=io.BytesIO(legacy)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
    config_name = json.loads(files["manifest.json"])[0]["Config"]
    image = "sha256:" + config_name.removesuffix(".json")
    oci_manifest = json.dumps({"schemaVersion": 2, "config": {"digest": image}, "layers": []}).encode()
    blobs = {config_name.removesuffix(".json"): files[config_name], hashlib.sha256(oci_manifest).hexdigest(): oci_manifest}
    blobs |= {hashlib.sha256(raw).hexdigest(): raw for raw in (base, upper)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for hexname, data in sorted(blobs.items()):
            info = tarfile.TarInfo(f"blobs/sha256/{hexname}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("0" * 64 + "/layer.tar")
        link.type, link.linkname = tarfile.SYMTYPE, f"../blobs/sha256/{hashlib.sha256(upper).hexdigest()}"
        tar.addfile(link)
        for name, data in (("index.json", b'{"schemaVersion": 2}'), ("manifest.json", b"[]")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    outs = []
    for saved in (legacy, buf.getvalue()):
        rewrite = _Rewrite(io.BytesIO(saved), epoch=EPOCH, keep=frozenset({base_id}), scratch=tmp_path,
                           on_event=lambda _: None, image=image)
        outs.append((b"".join(rewrite.chunks()), rewrite.image_config, rewrite.kept, len(rewrite.renamed)))
    assert outs[0] == outs[1] and outs[1][2:] == (1, 1)


@pytest.mark.parametrize("ordered", [False, True])
def test_layers_already_rewritten_are_not_loaded_again_below_the_first_changed_one(tmp_path, ordered) -> None:
    """BuildKit fed from a registry cache of rewritten layers gives back layers that rewrite to themselves: the engine
    has their chain already, so the load tarball leaves them out, but only while every layer below is unchanged too.
    With the engine's layer order (`ordered`) a held layer is settled as soon as the layers below it are known."""
    lower = _rewrite(_layer([("usr/", None, EPOCH + 1), ("usr/l", b"l", EPOCH + 1)]))[2]  # rewritten before
    middle = _layer([("opt/", None, EPOCH + 9), ("opt/m", b"m", EPOCH + 9)])  # built now: changes
    upper = _rewrite(_layer([("srv/", None, EPOCH + 2), ("srv/u", b"u", EPOCH + 2)]))[2]  # rewritten before
    ids = ["sha256:" + hashlib.sha256(raw).hexdigest() for raw in (lower, middle, upper)]
    rewrite = _Rewrite(io.BytesIO(_saved([lower, middle, upper])), epoch=EPOCH, keep=frozenset(), scratch=tmp_path,
                       on_event=lambda _: None, order=tuple(ids) if ordered else ())
    manifest, files = _load(b"".join(rewrite.chunks()))
    new = json.loads(rewrite.image_config)["rootfs"]["diff_ids"]
    assert new[0] == ids[0] and new[1] != ids[1] and new[2] == ids[2]
    assert manifest["Layers"][0] not in files  # the engine has the chain [lower]
    assert files[manifest["Layers"][1]] and files[manifest["Layers"][2]] == upper  # [lower, new middle, upper] is new
    assert rewrite.unchanged == 1 and list(tmp_path.iterdir()) == []

    all_done = _Rewrite(io.BytesIO(_saved([lower, upper])), epoch=EPOCH, keep=frozenset(), scratch=tmp_path,
                        on_event=lambda _: None, order=(ids[0], ids[2]) if ordered else ())
    manifest, files = _load(b"".join(all_done.chunks()))
    assert files.keys() == {manifest["Config"]} and all_done.unchanged == 2  # a full cache hit loads the config only
    assert json.loads(all_done.image_config)["rootfs"]["diff_ids"] == [ids[0], ids[2]]
    assert list(tmp_path.iterdir()) == []


def test_a_held_layer_is_settled_before_the_stream_ends_when_the_order_is_known(tmp_path) -> None:
    """docker save writes layers in no set order: a layer rewritten already that comes before the layer below it is
    held only until that one is read, so at most the undecided ones sit on disk (not the whole image)."""
    layers = [_rewrite(_layer([(f"d{i}/", None, EPOCH), (f"d{i}/f", bytes([65 + i]), EPOCH)]))[2] for i in range(3)]
    ids = ["sha256:" + hashlib.sha256(raw).hexdigest() for raw in layers]
    seen: list[int] = []
    rewrite = _Rewrite(io.BytesIO(_saved(layers, top_first=True)), epoch=EPOCH, keep=frozenset(), scratch=tmp_path,
                       on_event=lambda _: seen.append(len(rewrite.held)), order=tuple(ids))
    assert b"".join(rewrite.chunks())
    assert seen == [1, 2, 3] and rewrite.held == {} and rewrite.unchanged == 3  # top first: all wait for the bottom
    seen.clear()
    rewrite = _Rewrite(io.BytesIO(_saved(layers)), epoch=EPOCH, keep=frozenset(), scratch=tmp_path,
                       on_event=lambda _: seen.append(len(rewrite.held)), order=tuple(ids))
    assert b"".join(rewrite.chunks())
    assert seen == [1, 1, 1] and rewrite.unchanged == 3  # bottom first: each is dropped as soon as it is read
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(BuildError, match="not the ones its saved config names"):
        b"".join(_Rewrite(io.BytesIO(_saved(layers)), epoch=EPOCH, keep=frozenset(), scratch=tmp_path,
                          on_event=lambda _: None, order=tuple(ids[:2])).chunks())


def test_the_image_epoch_is_the_bootstrapped_base_s() -> None:
    from skupin.builder.base import SOURCE_DATE_EPOCH
    from skupin.builder.reproducible import IMAGE_EPOCH

    assert IMAGE_EPOCH == SOURCE_DATE_EPOCH  # one time for every file skupin writes (docs/REPRODUCIBLE.md)
