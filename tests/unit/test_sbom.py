"""The SBOM (skupin/publishing/sbom.py) and its signed statement: read from a small synthetic layer set (tar layers indexed
and merged exactly as the gate indexes an image's layers), written with cyclonedx-python-lib and validated against the
CycloneDX 1.6 schema by that library's validator; then signed, opened and judged by `evaluate_sbom`. No Docker, no
network."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from skupin.builder.catalog.lockfile import Lock, LockedBase, LockedPackage
from skupin.common.errors import PublishError
from skupin.common.model import canonical_json
from skupin.imageview.layers import BlobStore, FileView, kept_for_checks, merge, scan_layer_tar
from skupin.publishing.attest import BOM_PREDICATE_TYPE, PAYLOAD_TYPE, STATEMENT_TYPE, bom_statement
from skupin.publishing.policy import evaluate_sbom
from skupin.publishing.sbom import (
    DebianPackage,
    ImageInventory,
    PythonDistribution,
    bom_summary,
    build_bom,
    read_inventory,
    serial_number,
)
from tests.unit.test_attest import SIGNER, STRANGER, TRUSTED

DIGEST = "sha256:" + "ab" * 32
OTHER_DIGEST = "sha256:" + "cd" * 32
IMAGE_ID = "sha256:" + "1" * 64
SITE = "opt/skupin/venv/lib/python3.11/site-packages"
TORCH_SHA = "e" * 64
STATUS = """Package: libc6
Status: install ok installed
Architecture: amd64
Version: 2.36-9+deb12u7

Package: base-files
Status: install ok installed
Architecture: amd64
Version: 12.4+deb12u5

Package: removed-one
Status: deinstall ok config-files
Architecture: amd64
Version: 1.0-1

Package: tzdata
Status: install ok installed
Architecture: all
Version: 2024a-0+deb12u1
"""
OS_RELEASE = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n'


def _layer(files: dict[str, bytes], links: dict[str, str] | None = None, whiteouts: tuple[str, ...] = ()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        paths = [*files, *(links or {}), *whiteouts]
        for folder in sorted({"/".join(p.split("/")[:n]) for p in paths for n in range(1, p.count("/") + 1)}):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size, info.mtime = len(data), 1
            tar.addfile(info, io.BytesIO(data))
        for path, target in (links or {}).items():
            info = tarfile.TarInfo(path)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for path in whiteouts:
            folder, _, name = path.rpartition("/")
            info = tarfile.TarInfo(f"{folder}/.wh.{name}")
            tar.addfile(info, io.BytesIO(b""))
    return buf.getvalue()


def view_of(tmp_path: Path, layers: list[bytes]) -> FileView:
    """The merged view of tar layers, indexed as the gate indexes an image's `docker save` stream."""
    store = BlobStore(tmp_path / "blobs", kept_for_checks)
    indexes = [scan_layer_tar(io.BytesIO(data), diff_id=f"sha256:{n:064x}", store=store) for n, data in enumerate(layers)]
    return FileView(entries=merge(indexes), layers=tuple(i.diff_id for i in indexes),
                    read=lambda rel, entry, limit: store.path(entry.sha256).read_bytes()[:limit])


def synthetic(tmp_path: Path) -> FileView:
    base = _layer({"var/lib/dpkg/status": STATUS.encode(), "usr/lib/os-release": OS_RELEASE.encode(),
                   f"{SITE}/numpy-1.26.0.dist-info/METADATA": b"Name: numpy\n"},
                  links={"etc/os-release": "../usr/lib/os-release"})
    upper = _layer({f"{SITE}/torch-2.13.0+cpu.dist-info/METADATA": b"Name: torch\n",
                    f"{SITE}/numpy-2.1.0.dist-info/METADATA": b"Name: numpy\n",
                    f"{SITE}/Jinja2-3.1.4.dist-info/METADATA": b"Name: Jinja2\n",
                    f"{SITE}/setuptools/_vendor/wheel-0.46.3.dist-info/METADATA": b"Name: wheel\n",
                    f"{SITE}/setuptools/_vendor/wheel-0.46.3.dist-info/RECORD": b""},
                   whiteouts=(f"{SITE}/numpy-1.26.0.dist-info",))
    return view_of(tmp_path, [base, upper])


def lock_with(*packages: LockedPackage) -> Lock:
    return Lock(sku="cpu-x86_64", manifest_sha256="a" * 64, python="3.11", platform="linux/amd64",
                base=LockedBase(kind="bootstrap", reference="skupin-base/x:1", recipe_sha256="b" * 64),
                layers={"framework": packages, "compiler": (), "engine": (), "extras": ()},
                resolver="none", tool_version="0.1.0", created="2026-11-29T00:00:00Z")


LOCK = lock_with(
    LockedPackage(name="torch", version="2.13.0+cpu", filename="torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl",
                  sha256=TORCH_SHA),
    LockedPackage(name="numpy", version="2.0.0", filename="numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl",
                  sha256="f" * 64),
    LockedPackage(name="jinja2", version="3.1.4", filename="jinja2-3.1.4.tar.gz", sha256="9" * 64))


# ---------------------------------------------------------------- reading the layers


def test_the_inventory_is_every_dist_info_and_installed_debian_package_after_the_merge(tmp_path: Path):
    inv = read_inventory(synthetic(tmp_path))
    assert inv.python == (
        PythonDistribution(name="jinja2", version="3.1.4", path=f"{SITE}/Jinja2-3.1.4.dist-info", vendored=False),
        PythonDistribution(name="numpy", version="2.1.0", path=f"{SITE}/numpy-2.1.0.dist-info", vendored=False),
        PythonDistribution(name="torch", version="2.13.0+cpu", path=f"{SITE}/torch-2.13.0+cpu.dist-info", vendored=False),
        PythonDistribution(name="wheel", version="0.46.3", path=f"{SITE}/setuptools/_vendor/wheel-0.46.3.dist-info",
                           vendored=True),
    )  # numpy 1.26.0 was whited out by the upper layer
    assert inv.debian == (DebianPackage(name="base-files", version="12.4+deb12u5", arch="amd64"),
                          DebianPackage(name="libc6", version="2.36-9+deb12u7", arch="amd64"),
                          DebianPackage(name="tzdata", version="2024a-0+deb12u1", arch="all"))  # not removed-one
    assert (inv.os_id, inv.os_version) == ("debian", "12")  # through the etc/os-release link


def test_an_image_without_dpkg_or_python_has_an_empty_inventory(tmp_path: Path):
    inv = read_inventory(view_of(tmp_path, [_layer({"usr/bin/sleep": b"\x7fELF"})]))
    assert inv == ImageInventory() and inv.os_version is None


@pytest.mark.parametrize("files, words", [
    ({f"{SITE}/torch.dist-info/METADATA": b""}, "not a distribution's dist-info folder"),
    ({f"{SITE}/torch-not!a!version.dist-info/METADATA": b""}, "is not a Python version"),
    ({"var/lib/dpkg/status": b"Package: Bad_Name\nStatus: install ok installed\nArchitecture: amd64\nVersion: 1\n"},
     "field Package 'Bad_Name'"),
    ({"var/lib/dpkg/status": b"Package: ok\nStatus: install ok installed\nArchitecture: amd64\nVersion: 1 2\n"},
     "field Version '1 2'"),
    ({"var/lib/dpkg/status": b"\xff\xfe not utf-8"}, "/var/lib/dpkg/status: unreadable"),
])
def test_what_is_not_a_name_or_version_is_refused_naming_the_file(tmp_path: Path, files, words):
    with pytest.raises(PublishError, match="nothing was pushed") as caught:
        read_inventory(view_of(tmp_path, [_layer(files)]))
    assert words in str(caught.value)


# ---------------------------------------------------------------- the document


def bom_of(tmp_path: Path, digest: str = DIGEST, timestamp: str = "2026-11-30T12:00:00Z") -> dict:
    return build_bom(read_inventory(synthetic(tmp_path)), registry="127.0.0.1:5000", repository="cpu-x86_64",
                     digest=digest, image_id=IMAGE_ID, timestamp=timestamp, lock=LOCK, sku="cpu-x86_64")


def test_the_bom_lists_exactly_the_image_with_the_lock_hashes(tmp_path: Path):
    bom = bom_of(tmp_path)
    assert (bom["bomFormat"], bom["specVersion"], bom["version"]) == ("CycloneDX", "1.6", 1)
    assert bom["serialNumber"] == f"urn:uuid:{serial_number(DIGEST)}"
    meta = bom["metadata"]
    assert meta["timestamp"] == "2026-11-30T12:00:00+00:00"
    assert [(t["name"], t["type"]) for t in meta["tools"]["components"]] == [("skupin", "application")]
    image = meta["component"]
    assert image["type"] == "container" and image["version"] == DIGEST
    assert image["purl"] == f"pkg:oci/cpu-x86_64@sha256:{'ab' * 32}?repository_url=127.0.0.1:5000/cpu-x86_64"
    assert image["hashes"] == [{"alg": "SHA-256", "content": "ab" * 32}]
    assert {p["name"]: p["value"] for p in image["properties"]} == {
        "skupin:image-id": IMAGE_ID, "skupin:sku": "cpu-x86_64", "skupin:lock-sha256": LOCK.content_hash()}
    by_purl = {c["purl"]: c for c in bom["components"]}
    assert sorted(by_purl) == [
        "pkg:deb/debian/base-files@12.4%2Bdeb12u5?arch=amd64&distro=debian-12",
        "pkg:deb/debian/libc6@2.36-9%2Bdeb12u7?arch=amd64&distro=debian-12",
        "pkg:deb/debian/tzdata@2024a-0%2Bdeb12u1?arch=all&distro=debian-12",
        "pkg:pypi/jinja2@3.1.4", "pkg:pypi/numpy@2.1.0", "pkg:pypi/torch@2.13.0%2Bcpu", "pkg:pypi/wheel@0.46.3"]
    torch = by_purl["pkg:pypi/torch@2.13.0%2Bcpu"]
    assert (torch["name"], torch["version"], torch["type"]) == ("torch", "2.13.0+cpu", "library")
    assert torch["hashes"] == [{"alg": "SHA-256", "content": TORCH_SHA}]  # the locked wheel's hash
    assert {p["name"]: p["value"] for p in torch["properties"]} == {
        "skupin:path": f"/{SITE}/torch-2.13.0+cpu.dist-info",
        "skupin:lock-file": "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"}
    assert "hashes" not in by_purl["pkg:pypi/numpy@2.1.0"]  # the lock pins another version: no hash claimed
    assert "hashes" not in by_purl["pkg:pypi/jinja2@3.1.4"]  # the lock has its sdist, not the wheel installed
    wheel = by_purl["pkg:pypi/wheel@0.46.3"]
    assert {"name": "skupin:vendored", "value": "true"} in wheel["properties"] and "hashes" not in wheel
    libc = by_purl["pkg:deb/debian/libc6@2.36-9%2Bdeb12u7?arch=amd64&distro=debian-12"]
    assert (libc["name"], libc["version"]) == ("libc6", "2.36-9+deb12u7")
    # the image contains every component
    (root,) = [d for d in bom["dependencies"] if d["ref"] == image["bom-ref"]]
    assert sorted(root["dependsOn"]) == sorted(c["bom-ref"] for c in bom["components"])


def test_the_bom_is_valid_cyclonedx_1_6_and_the_validator_catches_a_broken_one(tmp_path: Path):
    validator = JsonStrictValidator(SchemaVersion.V1_6)
    bom = bom_of(tmp_path)
    assert validator.validate_str(json.dumps(bom)) is None
    broken = {**bom, "components": [{**bom["components"][0], "type": "not-a-type"}]}
    assert validator.validate_str(json.dumps(broken)) is not None
    with pytest.raises(PublishError, match="not valid CycloneDX 1.6"):
        bom_summary(broken)


def test_the_bom_is_deterministic_for_one_image_and_time(tmp_path: Path):
    first = canonical_json(bom_of(tmp_path / "a"))
    assert canonical_json(bom_of(tmp_path / "b")) == first  # layers indexed anew: the same bytes
    other = bom_of(tmp_path / "c", digest=OTHER_DIGEST)
    assert other["serialNumber"] != json.loads(first)["serialNumber"]
    later = bom_of(tmp_path / "d", timestamp="2026-12-01T00:00:00Z")
    assert later["serialNumber"] == json.loads(first)["serialNumber"] and canonical_json(later) != first


def test_the_summary_counts_installed_vendored_and_debian(tmp_path: Path):
    summary = bom_summary(bom_of(tmp_path))
    assert (summary.python, summary.python_vendored, summary.debian, summary.components) == (3, 1, 3, 7)
    assert summary.image == DIGEST and summary.line() == "3 Python distributions (+1 vendored), 3 Debian packages"


# ---------------------------------------------------------------- the signed statement and its policy


def test_the_sbom_statement_is_signed_like_the_attestation_and_passes_its_policy(tmp_path: Path):
    bom = bom_of(tmp_path)
    envelope = json.loads(SIGNER.sign_statement(bom_statement(repository="cpu-x86_64", digest=DIGEST, bom=bom)))
    assert envelope["payloadType"] == PAYLOAD_TYPE and envelope["signatures"][0]["keyid"] == ""
    stmt = json.loads(base64.b64decode(envelope["payload"]))
    assert stmt["_type"] == STATEMENT_TYPE and stmt["predicateType"] == BOM_PREDICATE_TYPE == "https://cyclonedx.org/bom"
    assert stmt["subject"] == [{"name": "cpu-x86_64", "digest": {"sha256": "ab" * 32}}] and stmt["predicate"] == bom
    result = evaluate_sbom(canonical_json(envelope), trusted=TRUSTED, digest=DIGEST)
    assert result.ok and result.keyid == SIGNER.keyid and result.bom == bom
    assert result.summary is not None and result.summary.python == 3


def _tampered(envelope: bytes, change) -> bytes:
    env = json.loads(envelope)
    stmt = json.loads(base64.b64decode(env["payload"]))
    change(stmt)
    env["payload"] = base64.b64encode(canonical_json(stmt)).decode()
    return canonical_json(env)


def test_the_sbom_policy_refuses(tmp_path: Path):
    bom = bom_of(tmp_path)
    honest = SIGNER.sign_statement(bom_statement(repository="cpu-x86_64", digest=DIGEST, bom=bom))
    cases = {
        "unknown key": (STRANGER.sign_statement(bom_statement(repository="cpu-x86_64", digest=DIGEST, bom=bom)),
                        DIGEST, f"signed by a key this catalog does not trust: {STRANGER.keyid}"),
        "payload changed": (_tampered(honest, lambda s: s["predicate"]["components"].pop()), DIGEST,
                            "does not verify with the key that claims it"),
        "another image": (honest, OTHER_DIGEST, "a signature over another image"),
        "not a BOM": (SIGNER.sign_statement({**json.loads(base64.b64decode(json.loads(honest)["payload"])),
                                             "predicate": {"bomFormat": "SPDX"}}), DIGEST, "not a CycloneDX"),
        "BOM of another image": (SIGNER.sign_statement(bom_statement(
            repository="cpu-x86_64", digest=DIGEST, bom=bom_of(tmp_path / "o", digest=OTHER_DIGEST))),
            DIGEST, "the SBOM describes sha256:cdcdcdcdcdcd"),
    }
    for why, (envelope, digest, words) in cases.items():
        result = evaluate_sbom(envelope, trusted=TRUSTED, digest=digest)
        assert not result.ok and words in result.reason, (why, result.reason)
