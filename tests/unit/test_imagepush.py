"""The publish's own push bytes (publishing/imagepush.py): one image id, one manifest digest (no Docker, no registry)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from skupin.common.errors import PublishError
from skupin.publishing.imagepush import LAYER_MEDIA, MANIFEST_MEDIA, PackedLayer, compress_layer, pack_image


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Saving:
    """An engine whose `docker save` is a tarball made here."""

    def __init__(self, layers: list[bytes], *, drop_layer: bool = False) -> None:
        diff_ids = ["sha256:" + hashlib.sha256(raw).hexdigest() for raw in layers]
        self.config = json.dumps({"os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
        self.image_id = "sha256:" + hashlib.sha256(self.config).hexdigest()
        files = {f"{i}{'a' * 63}/layer.tar": raw for i, raw in enumerate(layers) if not (drop_layer and i == 0)}
        files[self.image_id.removeprefix("sha256:") + ".json"] = self.config
        files["manifest.json"] = b"[]"
        self.saved = _tar(files)

    def save_image(self, ref: str) -> io.RawIOBase:
        return io.BytesIO(self.saved)  # type: ignore[return-value]


def test_compression_is_deterministic_and_round_trips() -> None:
    raw = _tar({"a": b"x" * 100_000, "b": bytes(range(256)) * 50})
    outs = []
    for _ in range(2):
        out = io.BytesIO()
        diff_id, digest, size = compress_layer(io.BytesIO(raw), out)
        outs.append(out.getvalue())
        assert diff_id == "sha256:" + hashlib.sha256(raw).hexdigest()
        assert digest == "sha256:" + hashlib.sha256(out.getvalue()).hexdigest() and size == len(out.getvalue())
    assert outs[0] == outs[1] and gzip.decompress(outs[0]) == raw
    assert outs[0][4:8] == b"\0\0\0\0"  # the gzip header's mtime: no clock in the bytes


def test_an_image_packs_to_one_manifest_in_its_configs_layer_order(tmp_path: Path) -> None:
    layers = [_tar({"bin/sh": b"sh"}), _tar({"opt/app": b"app" * 1000})]
    engine = _Saving(layers)
    seen: list[tuple[PackedLayer, bytes]] = []
    packed = pack_image(engine, engine.image_id, on_layer=lambda layer, path: seen.append((layer, path.read_bytes())),  # type: ignore[arg-type]
                        scratch=tmp_path)
    again = pack_image(engine, engine.image_id, scratch=tmp_path)  # type: ignore[arg-type]
    assert packed.digest == again.digest == "sha256:" + hashlib.sha256(packed.manifest).hexdigest()
    manifest = json.loads(packed.manifest)
    assert manifest["mediaType"] == MANIFEST_MEDIA and manifest["config"]["digest"] == engine.image_id
    assert [la["digest"] for la in manifest["layers"]] == [la.digest for la in packed.layers]
    assert {la["mediaType"] for la in manifest["layers"]} == {LAYER_MEDIA}
    assert [gzip.decompress(body) for _layer, body in seen] == layers  # every layer went to on_layer, then its file went
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_is_not_the_image_is_refused(tmp_path: Path) -> None:
    engine = _Saving([_tar({"a": b"1"})])
    with pytest.raises(PublishError, match="gave no config with that id"):
        pack_image(engine, "sha256:" + "0" * 64, scratch=tmp_path)  # type: ignore[arg-type]
    missing = _Saving([_tar({"a": b"1"}), _tar({"b": b"2"})], drop_layer=True)
    with pytest.raises(PublishError, match="gave no layer"):
        pack_image(missing, missing.image_id, scratch=tmp_path)  # type: ignore[arg-type]


def _oci_saved(engine: _Saving, layers: list[bytes]) -> bytes:
    """The same image as Docker >= 25 saves it: an OCI layout (config and layers as blobs/sha256/<hex>, the OCI manifest
    a blob too, index.json, oci-layout) with the legacy `<id>/layer.tar` names as links to the blobs."""
    blobs = {engine.image_id.removeprefix("sha256:"): engine.config}
    blobs |= {hashlib.sha256(raw).hexdigest(): raw for raw in layers}
    oci = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": {"digest": engine.image_id}, "layers": []}).encode()
    blobs[hashlib.sha256(oci).hexdigest()] = oci
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for hexname, data in sorted(blobs.items()):
            info = tarfile.TarInfo(f"blobs/sha256/{hexname}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for i, raw in enumerate(layers):
            link = tarfile.TarInfo(f"{i}{'b' * 63}/layer.tar")
            link.type, link.linkname = tarfile.SYMTYPE, f"../blobs/sha256/{hashlib.sha256(raw).hexdigest()}"
            tar.addfile(link)
        for name, data in (("index.json", b'{"schemaVersion": 2, "manifests": []}'), ("oci-layout", b"{}"),
                           ("manifest.json", b"[]")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_docker_25_s_oci_layout_packs_to_the_same_manifest_and_sends_no_manifest_blob(tmp_path: Path) -> None:
    layers = [_tar({"bin/sh": b"sh"}), _tar({}), _tar({"opt/app": b"app" * 1000})]  # an empty layer too
    legacy = _Saving(layers)
    oci = _Saving(layers)
    oci.saved = _oci_saved(oci, layers)
    sent: list[bytes] = []
    want = pack_image(legacy, legacy.image_id, scratch=tmp_path)  # type: ignore[arg-type]
    got = pack_image(oci, oci.image_id, on_layer=lambda layer, path: sent.append(gzip.decompress(path.read_bytes())),  # type: ignore[arg-type]
                     scratch=tmp_path)
    assert got.digest == want.digest and got.manifest == want.manifest
    assert sorted(sent) == sorted(layers)  # every layer once, the OCI manifest blob never


def test_a_failed_blob_put_starts_a_new_upload_session(tmp_path: Path) -> None:
    """An upload session serves one PUT: after a refused PUT (the registry's disk was full, the answer timed out)
    the blob goes again from a new session, not to the spent one (BLOB_UPLOAD_INVALID)."""
    import httpx

    from skupin.clients.oci import RegistryClient
    from skupin.clients.transport import new_client

    blob = tmp_path / "layer.tar.gz"
    blob.write_bytes(b"x" * 3000)
    digest = "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest()
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        if request.method == "HEAD":
            return httpx.Response(404)
        if request.method == "POST":
            return httpx.Response(202, headers={"Location": f"/v2/r/blobs/uploads/{len(seen)}"})
        body = request.read()
        if len([s for s in seen if s.startswith("PUT")]) == 1:
            return httpx.Response(404, json={"errors": [{"code": "BLOB_UPLOAD_INVALID"}]})
        assert body == blob.read_bytes() and request.url.params["digest"] == digest
        return httpx.Response(201)

    client = RegistryClient("http://127.0.0.1:5000", retries=0)
    client.http.client = new_client(timeout=1, transport=httpx.MockTransport(handler))
    assert client.push_blob_file("r", blob, digest=digest, size=3000) is True
    assert seen == ["HEAD /v2/r/blobs/" + digest, "POST /v2/r/blobs/uploads/", "PUT /v2/r/blobs/uploads/2",
                    "POST /v2/r/blobs/uploads/", "PUT /v2/r/blobs/uploads/4"]
