"""skupin.clients.pypi, .oci and `compat refresh` against real HTTP servers on loopback (recorded PyPI metadata,
a small registry)."""

from __future__ import annotations

import base64
import datetime
import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from skupin.builder.catalog.compat import CompatData
from skupin.clients.oci import RegistryClient, docker_credentials, parse_image_ref
from skupin.clients.pypi import IndexClient
from skupin.common.errors import NetworkError
from skupin.releases.compat_refresh import refresh
from tests.data.index.server import serve_index, serve_registry

REPO = Path(__file__).resolve().parents[2]
INDEX = REPO / "tests" / "data" / "index"
COMPAT = REPO / "builder" / "data" / "compat.yaml"

# ../shared/research/compat-facts.md (gathered 2026-11 from PyPI Requires-Dist), an independent check.
FACTS_TORCH = [  # torch, triton requirement, CUDA runtime of the PyPI Linux x86_64 wheel
    ("2.4.0", "==3.0.0", "12.1"), ("2.5.1", "==3.1.0", "12.4"), ("2.6.0", "==3.2.0", "12.4"),
    ("2.7.0", "==3.3.0", "12.6"), ("2.7.1", "==3.3.1", "12.6"), ("2.8.0", "==3.4.0", "12.8"),
    ("2.9.0", "==3.5.0", "12.8"), ("2.9.1", "==3.5.1", "12.8"), ("2.10.0", "==3.6.0", "12.8"),
    ("2.11.0", "==3.6.0", "13.0.2"), ("2.13.0", "==3.7.1", "13.0.3"), ("2.14.0", "~=3.8.0", "13.0.3"),
]
FACTS_VLLM = [
    ("0.8.5", "2.6.0"), ("0.9.2", "2.7.0"), ("0.10.0", "2.7.1"), ("0.10.1", "2.7.1"), ("0.10.1.1", "2.7.1"),
    ("0.10.2", "2.8.0"), ("0.11.0", "2.8.0"), ("0.11.2", "2.9.0"), ("0.12.0", "2.9.0"), ("0.13.0", "2.9.0"),
    ("0.14.0", "2.9.1"), ("0.14.1", "2.9.1"), ("0.15.0", "2.9.1"), ("0.15.1", "2.9.1"), ("0.16.0", "2.9.1"),
    ("0.22.0", "2.11.0"), ("0.22.1", "2.11.0"), ("0.25.0", "2.11.0"), ("0.25.1", "2.11.0"),
    ("0.28.0", "2.13.0"), ("0.30.0", "2.13.0"), ("0.33.0", "2.14.0"),
]


@pytest.fixture(scope="module")
def index_url():
    with serve_index(INDEX) as url:
        yield url


@pytest.fixture(scope="module")
def refreshed(index_url, tmp_path_factory):
    out = tmp_path_factory.mktemp("compat") / "compat.yaml"
    report = refresh(index_url=index_url, out=out, compat_path=COMPAT, today=datetime.date(2026, 11, 30))
    return report, out


def test_refresh_reproduces_every_compat_fact(refreshed):
    report, out = refreshed
    data = CompatData.model_validate(yaml.safe_load(out.read_text(encoding="utf-8")))
    for torch, triton, runtime in FACTS_TORCH:
        row = data.torch_row(Version(torch), "cuda")
        assert row is not None, torch
        assert (row.requires, row.cuda_runtime) == (triton, runtime), torch
        assert row.date == datetime.date(2026, 11, 30) and f"torch {torch} Requires-Dist (torch-{torch}-" in row.source
    for vllm, torch in FACTS_VLLM:
        row = data.engine_row("vllm", Version(vllm))
        assert row is not None, vllm
        assert SpecifierSet(row.torch) == SpecifierSet(f"=={torch}"), vllm
    assert report.torch_rows >= len(FACTS_TORCH) and report.engine_rows >= len(FACTS_VLLM)


def test_refresh_keeps_comments_and_other_rows(refreshed):
    _, out = refreshed
    old, new = COMPAT.read_text(encoding="utf-8"), out.read_text(encoding="utf-8")
    comments = [line for line in old.splitlines() if line.lstrip().startswith("#")]
    assert comments and all(c in new.splitlines() for c in comments)
    old_data, new_data = yaml.safe_load(old), yaml.safe_load(new)
    for section in ("families", "torch_rocm", "cuda_driver", "variants"):
        assert new_data[section] == old_data[section]
    keep = [r for r in old_data["torch_compiler"] if r["family"] != "cuda"]
    assert all(r in new_data["torch_compiler"] for r in keep)
    assert [r for r in new_data["engine_torch"] if r["engine"] == "transformers"] == \
        [r for r in old_data["engine_torch"] if r["engine"] == "transformers"]


def test_refresh_agrees_with_committed_index_rows(refreshed):
    """Every index-derived row already committed says the same as the recorded metadata."""
    _, out = refreshed
    new = CompatData.model_validate(yaml.safe_load(out.read_text(encoding="utf-8")))
    old = CompatData.model_validate(yaml.safe_load(COMPAT.read_text(encoding="utf-8")))
    for row in old.torch_compiler:
        if row.family == "cuda":
            got = new.torch_row(Version(row.torch), "cuda")
            assert got is not None and (got.requires, got.cuda_runtime) == (row.requires, row.cuda_runtime), row.torch
    for row in old.engine_torch:
        if row.engine in ("vllm", "sglang"):
            got = new.engine_row(row.engine, Version(row.version))
            assert got is not None and SpecifierSet(got.torch) == SpecifierSet(row.torch), (row.engine, row.version)


def test_index_client_pages_versions_and_metadata(index_url):
    with IndexClient(index_url) as ix:
        versions = ix.versions("vllm")
        assert Version("0.8.5") in versions and versions == tuple(sorted(versions))
        (wheel,) = ix.files("vllm", "0.33.0")
        assert wheel.core_metadata and wheel.url.startswith(index_url.removesuffix("/simple"))
        assert "torch==2.14.0" in ix.requires_dist("vllm", "0.33.0")
        with pytest.raises(NetworkError, match="HTTP 404"):
            ix.project("no-such-project")


def test_retries_on_503_then_gives_up(tmp_path):
    state = {"fail": 2}
    with serve_index(INDEX, state) as url:
        with IndexClient(url, retries=3, backoff=0.0) as ix:
            assert ix.versions("torch")
        state["fail"] = 5
        with IndexClient(url, retries=1, backoff=0.0) as ix, pytest.raises(NetworkError, match="HTTP 503"):
            ix.versions("triton")


def test_connect_error_is_a_network_error():
    with IndexClient("http://127.0.0.1:9/simple", retries=1, backoff=0.0, timeout=2) as ix:
        with pytest.raises(NetworkError, match="failed after 2 attempt"):
            ix.versions("torch")


def test_metadata_from_wheel_by_range_requests(tmp_path):
    """Without a PEP 658 .metadata file, METADATA is read out of the wheel with HTTP range requests."""
    root = tmp_path / "index"
    shutil.copytree(INDEX / "simple", root / "simple")
    (root / "files").mkdir()
    name = "demo-1.0-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("demo/__init__.py", "x = 1\n" * 200_000)  # ~1.2 MB of payload that must not travel
        z.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                   "Requires-Dist: torch==2.13.0\n")
    (root / "files" / name).write_bytes(buf.getvalue())
    page = {"meta": {"api-version": "1.1"}, "name": "demo", "versions": ["1.0"],
            "files": [{"filename": name, "url": f"../../files/{name}", "hashes": {}}]}
    (root / "simple" / "demo.json").write_text(json.dumps(page))
    state: dict = {}
    with serve_index(root, state) as url, IndexClient(url) as ix:
        assert ix.requires_dist("demo", "1.0") == ("torch==2.13.0",)
    ranged = [p for p in state["requests"] if p.endswith(name)]
    assert ranged and len(ranged) < 5


def test_registry_push_tags_resolve_with_bearer_auth(tmp_path):
    config = tmp_path / "config.json"
    store: dict = {}
    with serve_registry(store, auth=("ci", "s3cret-pass")) as url:
        host = url.removeprefix("http://")
        config.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(b"ci:s3cret-pass").decode()}}}))
        creds = docker_credentials(host, config=config)
        assert creds is not None and "s3cret" not in repr(creds)
        with RegistryClient(url, docker_config=config, backoff=0.0) as reg:
            assert "s3cret" not in repr(reg)
            cfg = reg.push_blob("skupin/cpu", b'{"architecture":"amd64"}')
            assert reg.has_blob("skupin/cpu", cfg) and reg.get_blob("skupin/cpu", cfg) == b'{"architecture":"amd64"}'
            body = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                               "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg,
                                          "size": 24}, "layers": []}).encode()
            digest = reg.put_manifest("skupin/cpu", "v1", body, "application/vnd.oci.image.manifest.v1+json")
            record = f"sha256-{digest.split(':')[1]}.att"
            reg.put_manifest("skupin/cpu", record, body, "application/vnd.oci.image.manifest.v1+json")
            assert set(reg.list_tags("skupin/cpu")) == {"v1", record}
            assert reg.resolve("skupin/cpu", "v1") == digest
            manifest = reg.get_manifest("skupin/cpu", digest)
            assert manifest.body == body and manifest.json()["config"]["digest"] == cfg
        with RegistryClient(url, docker_config=tmp_path / "none.json", backoff=0.0) as anon:
            with pytest.raises(NetworkError) as err:
                anon.list_tags("skupin/cpu")
            assert "s3cret" not in str(err.value)


def test_parse_image_ref():
    ref = parse_image_ref("docker.io/rocm/dev-ubuntu-24.04:7.2.1-complete@sha256:" + "a" * 64)
    assert (ref.registry, ref.repository, ref.tag) == ("registry-1.docker.io", "rocm/dev-ubuntu-24.04", "7.2.1-complete")
    assert ref.reference == "sha256:" + "a" * 64
    assert parse_image_ref("localhost:5000/skupin/cpu:1").registry == "localhost:5000"
    assert parse_image_ref("ubuntu:24.04").repository == "library/ubuntu"


def test_the_lock_finds_a_source_built_engines_sdist_with_the_indexs_sha256(index_url):
    """builder/sdist.find_sdist over PEP 691: the one .tar.gz of the release, its URL made absolute, the index's sha256
    (the recorded llama-cpp-python page; the 76 MB file itself is not recorded)."""
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.builder.sdist import find_sdist
    from skupin.common.errors import LockError

    pin = load_manifest(REPO / "skus" / "cpu-x86_64-llamacpp.yaml").stack.engine
    pkg = find_sdist(pin, index_url)
    assert (pkg.name, pkg.version, pkg.filename, pkg.source) == ("llama-cpp-python", "0.3.36",
                                                                   "llama_cpp_python-0.3.36.tar.gz", "sdist")
    assert pkg.sha256 == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert pkg.url == index_url.removesuffix("/simple") + "/files/llama_cpp_python-0.3.36.tar.gz"
    with pytest.raises(LockError, match="0 source distributions"):
        find_sdist(pin.model_copy(update={"version": "0.3.35"}), index_url)
