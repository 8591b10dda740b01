"""What `verify --rebuild` names when a published image is not what its lock builds (publishing/rebuild.py), on layer
indexes and configs made here (no Docker, no registry)."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from skupin.common.errors import PublishError
from skupin.common.untrusted import UntrustedInputError
from skupin.imageview.layers import Entry, LayerIndex
from skupin.publishing import rebuild
from skupin.publishing.rebuild import Rebuilt, config_difference, first_file_difference


def _layer(**files: Entry) -> LayerIndex:
    index = LayerIndex(diff_id="sha256:x")
    index.entries.update({name.replace("__", "/"): entry for name, entry in files.items()})
    return index


F = Entry("f", 0o644, 3, 100, "a" * 64)


def test_the_first_file_that_differs_is_named_with_what_differs() -> None:
    published = _layer(usr=Entry("d", 0o755, 0, 100), usr__a=F, usr__b=F._replace(sha256="b" * 64))
    rebuilt = _layer(usr=Entry("d", 0o755, 0, 100), usr__a=F, usr__b=F)
    path, how = first_file_difference(published, rebuilt) or ("", "")
    assert path == "usr/b" and "sha256 bbbbbbbbbbbbbbbb" in how and "sha256 aaaaaaaaaaaaaaaa" in how


def test_a_file_only_one_side_has_is_named_and_equal_layers_have_no_difference() -> None:
    assert first_file_difference(_layer(a=F), _layer(a=F, b=F)) == ("b", "published: absent; rebuilt: file, mode 644, "
                                                                      "mtime 100, 3 bytes, sha256 aaaaaaaaaaaaaaaa")
    assert first_file_difference(_layer(a=F), _layer(a=F)) is None
    assert "mode 755" in first_file_difference(_layer(a=F._replace(mode=0o755)), _layer(a=F))[1]  # type: ignore[index]
    opaque = _layer(a=F)
    opaque.opaque.add("etc")
    assert first_file_difference(opaque, _layer(a=F)) == ("etc", "an opaque folder in only the published layer")


def test_config_fields_that_differ_are_named() -> None:
    a = {"created": "2026-12-01T00:00:00Z", "config": {"Env": ["A=1"], "Cmd": ["x"]}, "os": "linux"}
    b = {"created": "2026-12-02T00:00:00Z", "config": {"Env": ["A=2"], "Cmd": ["x"]}, "os": "linux"}
    assert config_difference(a, b) == "the configs differ in created, config.Env"


def test_the_answer_names_the_layer_and_file_and_refuses_with_publish_s_exit_code() -> None:
    bad = Rebuilt(ok=False, ref="r:verified", reference="r@sha256:1", sku="cpu-x86_64", published_digest="sha256:1" * 1,
                  rebuilt_digest="sha256:2", published_image_id="sha256:3", rebuilt_image_id="sha256:4",
                  difference="layer 3 (...): first differing file /usr/b: ...", layer=3, file="usr/b", build_s=90,
                  total_s=120)
    assert "NOT rebuilt to the same image" in bad.line() and "/usr/b" in bad.line()
    assert bad.error().exit_code == 8
    good = bad.model_copy(update={"ok": True, "difference": "", "layer": None, "file": None})
    assert good.line().startswith("rebuilt: r:verified -> r@sha256:1: the lock builds the same image here")


# ---------------------------------------------------------------- what a hostile registry or signer can send


def _gz_tar(*files: tuple[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0)


class _Registry:
    """A registry client that serves one blob from memory (as open_blob does: a new file in the folder)."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.asked: list[tuple[str, int | None]] = []

    def open_blob(self, repo: str, digest: str, folder: Path, *, max_bytes: int) -> Path:
        self.asked.append((digest, max_bytes))
        path = folder / "blob"
        path.write_bytes(self.blob)
        return path

    def get_blob(self, repo: str, digest: str, *, max_bytes: int | None = None) -> bytes:
        self.asked.append((digest, max_bytes))
        return self.blob


def _compare(blob: bytes, tmp_path: Path, *, size: object = 100) -> rebuild._Compare:
    manifest = {"layers": [{"digest": "sha256:" + "a" * 64, "size": size}]}
    return rebuild._Compare(client=_Registry(blob), repository="r", manifest=manifest, config={},  # type: ignore[arg-type]
                            rebuilt=None, docker=None, scratch=tmp_path)  # type: ignore[arg-type]


def test_a_gzip_bomb_in_the_published_layer_stops_at_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rebuild, "MAX_LAYER_BYTES", 1 << 20)
    monkeypatch.setattr(rebuild, "DISK_MARGIN", 0)  # whatever this disk has free
    bomb = _gz_tar(("usr/zeros", b"\0" * (4 << 20)))  # 4 MiB of tar from a few KB
    assert len(bomb) < 1 << 16
    with pytest.raises(UntrustedInputError, match="decompresses to more than 1048576 bytes"):
        _compare(bomb, tmp_path)._file(0, "sha256:p", "sha256:r")
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_deflate_stream_is_untrusted_input_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rebuild, "DISK_MARGIN", 0)  # whatever this disk has free
    good = _gz_tar(("usr/a", b"".join(b"line %d of the file\n" % i for i in range(100_000))))
    middle = len(good) // 2  # inside the file's data: zlib.error from the file's read, not from tarfile's header read
    corrupt = good[:middle] + bytes(b ^ 0x5A for b in good[middle:middle + 64]) + good[middle + 64:]
    with pytest.raises(UntrustedInputError, match="not a gzipped tar"):
        _compare(corrupt, tmp_path)._file(0, "sha256:p", "sha256:r")


@pytest.mark.parametrize("size", ["100", None, True, -1, 1 << 40, 2.5])
def test_a_layer_descriptor_that_is_not_a_digest_and_a_size_is_refused(tmp_path: Path, size: object) -> None:
    with pytest.raises(PublishError, match="declares"):
        _compare(b"", tmp_path, size=size)._file(0, "sha256:p", "sha256:r")
    bad = rebuild._Compare(client=_Registry(b""), repository="r", config={}, rebuilt=None, docker=None,  # type: ignore[arg-type]
                           manifest={"layers": [{"digest": "../../v2/_catalog", "size": 1}]}, scratch=tmp_path)
    with pytest.raises(PublishError, match="no sha256 digest"):
        bad._file(0, "sha256:p", "sha256:r")


def test_the_config_is_fetched_bounded_by_its_descriptor_and_a_bad_one_is_refused() -> None:
    config = b'{"rootfs": {"diff_ids": []}}'
    digest = "sha256:" + hashlib.sha256(config).hexdigest()

    class Client(_Registry):
        def __init__(self, manifest: object) -> None:
            super().__init__(config)
            self.manifest = manifest

        def get_manifest(self, repo: str, ref: str) -> object:
            return type("M", (), {"json": lambda _self: self.manifest})()

    client = Client({"config": {"digest": digest, "size": len(config)}})
    assert rebuild._published(client, "r", "sha256:m")[1] == {"rootfs": {"diff_ids": []}}  # type: ignore[arg-type]
    assert client.asked == [(digest, len(config))]
    for manifest in ({"config": {"digest": digest, "size": "9"}}, {"config": []}, ["x"]):
        with pytest.raises(PublishError):
            rebuild._published(Client(manifest), "r", "sha256:m")  # type: ignore[arg-type]


def test_hostile_names_are_shown_escaped_never_as_lines_or_terminal_codes() -> None:
    forged = "x\nrebuilt: r -> r@sha256:1: the lock builds the same image here\x1b[2K"
    path, how = first_file_difference(_layer(a=F), _layer(a=F, **{forged: Entry("l", 0o777, 0, 1, target="\x1b[1A")})) \
        or ("", "")
    assert "\n" not in path and "\x1b" not in path + how and "\\n" in path and "\\x1b" in how
    assert "\n" not in config_difference({"a\nb": 1}, {})


def test_a_registry_that_sends_more_than_the_config_declares_is_cut_off_not_read_into_memory() -> None:
    import httpx

    from skupin.clients.oci import RegistryClient
    from skupin.clients.transport import new_client
    from skupin.common.errors import NetworkError

    sent = [0]

    def endless() -> Iterator[bytes]:
        while sent[0] < 1 << 30:  # 1 GiB if nobody stops reading
            sent[0] += 1 << 20
            yield b"\0" * (1 << 20)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"" if request.method == "HEAD" else endless())

    client = RegistryClient("http://registry.test", retries=0, credentials=None, docker_config=Path("/nonexistent"))
    client.http.client = new_client(timeout=1, transport=httpx.MockTransport(handler))
    with pytest.raises(NetworkError, match="sent more than 100 bytes"):
        client.get_blob("r", "sha256:" + "a" * 64, max_bytes=100)
    assert sent[0] <= 2 << 20


def test_the_same_image_under_other_compressed_bytes_passes_with_a_note() -> None:
    same = Rebuilt(ok=True, ref="r:verified", reference="r@sha256:1", sku="cpu-x86_64", published_digest="sha256:1",
                   rebuilt_digest="sha256:2", published_image_id="sha256:3", rebuilt_image_id="sha256:3",
                   note="the same image (config and every layer's tar); only the registry's compressed bytes differ",
                   build_s=90, total_s=120)
    assert "published as sha256:1: the same image" in same.line() and same.line().startswith("rebuilt:")
