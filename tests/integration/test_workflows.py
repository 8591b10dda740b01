"""Replay the image workflow for the CPU SKU on this machine (tests/workflow_replay.py): matrix -> build -> gate ->
publish -> verify, ending in a verified digest in a loopback registry (Debian's docker-registry)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from skupin.clients.oci import RegistryClient
from skupin.publishing.local_registry import LocalRegistry, registry_down, registry_up
from skupin.publishing.publish import read_attestation_layers
from tests.paths import REPO
from tests.workflow_replay import Leg, Replay

pytestmark = pytest.mark.integration

WORKFLOWS = REPO / ".github" / "workflows"
OWNER = "Skupin-Org"  # capitals on purpose: registries refuse them, the workflow must lower-case


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=replay", "-c", "user.email=replay@localhost", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, str]:
    """A git repository holding this working tree as it is (committed or not): what checkout exports."""
    repo = tmp_path_factory.mktemp("source")
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_symlink():  # skupin/{builder,gates,templates}: links in git, as in a clone
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).symlink_to(os.readlink(src))
        elif src.is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / rel)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "the working tree")
    return repo, git(repo, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def python_bin() -> Path:
    """What actions/setup-python stands for: a virtual environment with skupin's dependencies (made once, kept in
    .skupin/replay-venv-<pyproject hash>); each job's own `pip install -e .` then installs its checkout."""
    key = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:12]
    venv = REPO / ".skupin" / f"replay-venv-{key}"
    if not (venv / ".ready").is_file():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-e", str(REPO)], check=True,
                       timeout=900)
        (venv / ".ready").write_text("")
    return venv / "bin"


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[LocalRegistry]:
    reg = LocalRegistry(addr=f"127.0.0.1:{free_port()}", folder=tmp_path_factory.mktemp("registry"))
    registry_up(registry=reg)
    yield reg
    registry_down(registry=reg)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp("keys")
    subprocess.run([str(REPO / ".venv" / "bin" / "skupin"), "keys", "generate", "--out", str(folder)], check=True,
                   capture_output=True, cwd=REPO)
    return (folder / "signing.key").read_text(), folder / "signing.pub"


def replay(source: tuple[Path, str], root: Path, python_bin: Path, registry: LocalRegistry, keys: tuple[str, Path],
           **kw) -> Replay:
    repo, commit = source
    return Replay(
        source=repo, commit=commit, root=root, python_bin=python_bin, owner=OWNER,
        # a shared cache folder stands for actions/cache's store: warm across test sessions, as on GitHub
        cache_dir=REPO / ".skupin" / "replay-cache",
        vars={"SKUPIN_REGISTRY_HOST": registry.addr,
              # download.pytorch.org is not reachable here: the runner's wheelhouse stands for the locked URL
              "SKUPIN_WHEELHOUSE": os.environ.get("SKUPIN_WHEELHOUSE", "/opt/wheels"),
              "SKUPIN_TRUSTED_KEY": keys[1].read_text()},
        secrets={"SKUPIN_SIGNING_KEY": keys[0], "GITHUB_TOKEN": ""},
        env={"SKUPIN_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt"}, **kw)


def report(legs: list[Leg]) -> None:
    """Per leg and step, the seconds it took (the cold/warm numbers in docs/guide-ci-point-releases.md)."""
    for leg in legs:
        steps = ", ".join(f"{name[:40]} {sec:.0f} s" for name, sec in leg.step_seconds.items() if sec >= 1)
        print(f"{leg.job}({leg.matrix.get('sku', '')}): {leg.status} in {leg.seconds:.0f} s [{steps}]")


def legs_of(legs: list[Leg], job: str) -> dict[str, Leg]:
    return {leg.matrix.get("sku", ""): leg for leg in legs if leg.job == job}


def test_images_workflow_builds_gates_publishes_and_verifies_the_cpu_sku(docker, tmp_path, source, python_bin,
                                                                          registry, keys):
    if not Path(os.environ.get("SKUPIN_WHEELHOUSE", "/opt/wheels")).is_dir():
        pytest.skip("needs the CPU torch wheel's wheelhouse (SKUPIN_WHEELHOUSE)")
    run = replay(source, tmp_path, python_bin, registry, keys,
                 inputs={"skus": "skus/cpu-x86_64.yaml skus/amd-mi300x-vllm.yaml"})
    legs = run.run(WORKFLOWS / "images.yml")
    matrix = legs_of(legs, "matrix")[""]
    assert matrix.status == "success", matrix.steps
    plan = json.loads(matrix.outputs["matrix"])
    assert [e["sku"] for e in plan["include"]] == ["cpu-x86_64"]  # the SKU that cannot lock is left out, with why
    assert "| `amd-mi300x-vllm` | no lock (" in matrix.summary
    for job in ("build", "gate", "publish"):
        leg = legs_of(legs, job)["cpu-x86_64"]
        assert leg.status == "success", (job, leg.steps)
    assert legs_of(legs, "build")["cpu-x86_64"].runs_on == ["ubuntu-latest"]  # a CPU SKU needs no self-hosted runner
    assert legs_of(legs, "gate")["cpu-x86_64"].runs_on == ["ubuntu-latest"]
    assert "## Gate: `cpu-x86_64`" in legs_of(legs, "gate")["cpu-x86_64"].summary
    assert "| model | pass |" in legs_of(legs, "gate")["cpu-x86_64"].summary

    # staged by digest under the lower-cased owner; published and verified under the same
    staged = json.loads((tmp_path / "artifacts" / "build-cpu-x86_64" / "staged.json").read_text())
    assert staged["staged"].startswith(f"{registry.addr}/skupin-org/skupin-staging/cpu-x86_64@sha256:")
    publish_ws = legs_of(legs, "publish")["cpu-x86_64"].workspace
    assert publish_ws is not None
    published = json.loads((publish_ws / "published.json").read_text())
    assert published["reference"].startswith(f"{registry.addr}/skupin-org/skupin/cpu-x86_64@sha256:")
    assert (publish_ws / "verified.txt").read_text().startswith(
        f"verified: {registry.addr}/skupin-org/skupin/cpu-x86_64:verified -> {published['reference']}")
    with RegistryClient(registry.url, retries=0) as client:
        assert client.resolve("skupin-org/skupin/cpu-x86_64", "verified") == published["digest"]
    # and an operator's verify, outside the replay, with the trusted public key
    check = subprocess.run([str(REPO / ".venv" / "bin" / "skupin"), "verify",
                            f"{registry.addr}/skupin-org/skupin/cpu-x86_64:verified", "--key", str(keys[1])],
                           capture_output=True, text=True, cwd=REPO, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    # the wheel store was saved under the lock's hash for the next runner
    lock_sha = plan["include"][0]["lock_sha256"]
    # the keyless step was handed the digest and the key-signed predicate (its replay keeps what it would sign)
    keyless = json.loads((tmp_path / "attestations" / f"{published['digest'].split(':', 1)[1]}.json").read_text())
    with RegistryClient(registry.url, retries=0) as client:
        (_kind, envelope), *_rest = read_attestation_layers(client=client, repository="skupin-org/skupin/cpu-x86_64",
                                                            digest=published["digest"])
    signed = json.loads(base64.b64decode(json.loads(envelope)["payload"]))
    assert keyless["predicate"] == signed["predicate"]  # exactly what the key signed
    assert keyless["predicate_type"] == signed["predicateType"] == "https://skupin.dev/verification/v1"
    assert keyless["subject"] == f"{registry.addr}/skupin-org/skupin/cpu-x86_64@{published['digest']}"
    assert keyless["predicate"]["lock_sha256"] == lock_sha
    assert (REPO / ".skupin" / "replay-cache" / f"wheels-cpu-x86_64-{lock_sha}").is_dir()
    report(legs)


# ---------------------------------------------------------------- a simulated engine point release


def repackage(wheel: Path, version: str, out: Path) -> Path:
    """The same wheel as another version: dist-info renamed, METADATA's Version and RECORD's hashes rewritten."""
    import base64
    import zipfile

    name, old = wheel.name.split("-")[:2]
    new_name = wheel.name.replace(f"-{old}-", f"-{version}-", 1)
    old_info, new_info = f"{name}-{old}.dist-info/", f"{name}-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as src:
        files = {i.filename.replace(old_info, new_info, 1): src.read(i) for i in src.infolist() if not i.is_dir()}
    meta = files[f"{new_info}METADATA"].decode()
    files[f"{new_info}METADATA"] = re.sub(r"(?m)^Version: .*$", f"Version: {version}", meta, count=1).encode()
    record = []
    for path, data in files.items():
        if path == f"{new_info}RECORD":
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{new_info}RECORD,,")
    files[f"{new_info}RECORD"] = ("\n".join(record) + "\n").encode()
    dest = out / new_name
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return dest


def json_index(root: Path, wheels: dict[str, list[Path]]) -> Path:
    """A PEP 691 index in `root` (tests/data/index/server.py's layout): simple/<name>.json, files/<wheel> (a link)
    and files/<wheel>.metadata (PEP 658), as `serve_index` serves them."""
    import zipfile

    (root / "simple").mkdir(parents=True)
    (root / "files").mkdir()
    for name, paths in wheels.items():
        entries, versions = [], []
        for path in paths:
            (root / "files" / path.name).symlink_to(path.resolve())
            with zipfile.ZipFile(path) as zf:
                meta = next(zf.read(n) for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            (root / "files" / f"{path.name}.metadata").write_bytes(meta)
            versions.append(path.name.split("-")[1])
            entries.append({"filename": path.name, "url": f"../../files/{path.name}",
                            "hashes": {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()},
                            "core-metadata": {"sha256": hashlib.sha256(meta).hexdigest()}, "yanked": False})
        page = {"meta": {"api-version": "1.1"}, "name": name, "versions": versions, "files": entries}
        (root / "simple" / f"{name}.json").write_text(json.dumps(page))
    return root


def placeholder(registry: LocalRegistry, repository: str, tag: str, *, sku: str, lock_sha256: str,
                signing_key: str) -> None:
    """A tiny image under `tag`: the registry already holds that version tag (published before the release), with an
    attestation the trusted key signed for that SKU and lock (an unattested tag is squatted, not published)."""
    from skupin.clients.oci import Manifest
    from skupin.publishing.attest import ReferencePin, VerificationPredicate, load_signer, statement
    from skupin.publishing.publish import OCI_MANIFEST, attestation_artifact, attestation_tag

    with RegistryClient(registry.url, retries=0) as client:
        config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}).encode()
        digest = client.push_blob(repository, config)
        body = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                      "size": len(config), "digest": digest}, "layers": []}).encode()
        stored = client.put_manifest(repository, tag, body, "application/vnd.docker.distribution.manifest.v2+json")
        predicate = VerificationPredicate(
            sku=sku, repository=repository, image_id=digest, lock_sha256=lock_sha256, lock={},
            reference=ReferencePin(sha256="0" * 64), tolerance=None, decision="pass", reason="placeholder", checks=(),
            verdict_sha256="0" * 64, gate_created=None, gate_tool_version=None, tool_version="0", published="2026-01-01")
        key = Path(registry.folder) / "placeholder.key"
        key.write_text(signing_key)
        key.chmod(0o600)
        envelope = load_signer(key).sign_statement(statement(repository=repository, digest=stored, predicate=predicate))
        art = attestation_artifact(envelope=envelope, subject=Manifest(
            media_type="application/vnd.docker.distribution.manifest.v2+json", digest=stored, body=body))
        client.push_blob(repository, art.config)
        for layer in art.layers:
            client.push_blob(repository, layer)
        client.put_manifest(repository, attestation_tag(stored), art.manifest, OCI_MANIFEST)


def version_tags(catalog: Path) -> dict[str, str]:
    """Every locked SKU's current version tag in `catalog`."""
    from skupin.builder.check import check_paths
    from skupin.builder.render import render
    from skupin.common.paths import use_root
    from skupin.publishing.publish import version_tag

    use_root(catalog)
    try:
        tags = {}
        for report in check_paths([catalog / "skus"]):
            stack = report.stack
            if stack is not None and stack.lock_state == "ok" and stack.lock is not None:
                tags[stack.manifest.name] = version_tag(
                    sku=stack.manifest.name, engine_version=stack.manifest.stack.engine.version, lock=stack.lock,
                    dockerfile_sha256=render(stack).sha256)
        return tags
    finally:
        use_root(None)


@pytest.fixture
def contextlib_stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


def test_an_engine_point_release_rebuilds_and_publishes_only_its_sku(docker, tmp_path, source, python_bin, registry,
                                                                      keys, contextlib_stack):
    from skupin.builder.catalog.lockfile import read_lock
    from skupin.builder.wheels import fetch_wheels, store_path
    from tests.data.index.server import serve_index

    wheelhouse = Path(os.environ.get("SKUPIN_WHEELHOUSE", "/opt/wheels"))
    if not wheelhouse.is_dir():
        pytest.skip("needs the CPU torch wheel's wheelhouse (SKUPIN_WHEELHOUSE)")
    repo, base = source
    lock = read_lock(repo / "skus" / "cpu-x86_64.lock.json")
    store = REPO / ".skupin" / "replay-cache" / f"wheels-cpu-x86_64-{lock.content_hash()}"  # warm after the first test
    fetch_wheels(lock.packages().values(), store=store, wheelhouse=wheelhouse)
    wheels: dict[str, list[Path]] = {}
    for pkg in lock.packages().values():
        wheels.setdefault(pkg.name, []).append(store_path(store, pkg))
    old = lock.packages()["transformers"]
    wheels["transformers"].append(repackage(store_path(store, old), "5.24.1", tmp_path))
    index_root = json_index(tmp_path / "index", wheels)

    # the release is known to the compatibility data (as `skupin compat refresh` records it from its metadata)
    compat = repo / "builder" / "data" / "compat.yaml"
    row = '  - {engine: transformers, version: 5.24.0, torch: ">=2.6"'
    text = compat.read_text()
    assert row in text
    git(repo, "checkout", "-q", base)
    compat.write_text(text.replace(row, row.replace("5.24.0", "5.24.1", 1) + ', source: "replay", date: 2026-12-01}\n'
                                   + row, 1))
    git(repo, "commit", "-q", "-am", "compat: transformers 5.24.1")
    released = git(repo, "rev-parse", "HEAD")

    # the index stays up to the end: the new lock records the release's URL there, as it would PyPI's
    index = contextlib_stack.enter_context(serve_index(index_root))
    watch = replay((repo, released), tmp_path / "watch", python_bin, registry, keys, inputs={"skus": "cpu-x86_64"})
    watch.vars["SKUPIN_INDEX_URL"] = index
    legs = watch.run(WORKFLOWS / "watch.yml")
    leg = legs_of(legs, "watch")["cpu-x86_64"]
    assert leg.status == "success", leg.steps
    pull = json.loads((tmp_path / "watch" / "pulls" / "skupin_watch_cpu-x86_64").read_text())
    assert pull["branch"] == "skupin/watch/cpu-x86_64" and pull["title"] == "Point release: cpu-x86_64"
    assert sorted(pull["files"]) == ["skus/cpu-x86_64.lock.json", "skus/cpu-x86_64.yaml",  # one SKU per pull request
                                     "skus/pylock.cpu-x86_64.toml"]
    merged = git(repo, "rev-parse", "skupin/watch/cpu-x86_64")
    git(repo, "checkout", "-q", released)
    before = {sku: tag for sku, tag in version_tags(repo).items() if sku != "cpu-x86_64"}
    git(repo, "checkout", "-q", merged)
    assert read_lock(repo / "skus" / "cpu-x86_64.lock.json").packages()["transformers"].version == "5.24.1"

    # every other SKU is already published at its current version tag (cpu-x86_64 is not among them: this process's
    # compatibility data does not know the release, so it cannot compute that tag, and need not)
    tags = {sku: tag for sku, tag in version_tags(repo).items() if sku != "cpu-x86_64"}
    assert {"cpu-x86_64-vllm", "cpu-x86_64-llamacpp", "nvidia-h200-vllm"} <= set(tags)
    assert tags == before  # the bump changed no other SKU's image: their tags are the ones published before it
    for sku, tag in tags.items():
        placeholder(registry, f"skupin-org/skupin/{sku}", tag, sku=sku, signing_key=keys[0],
                    lock_sha256=read_lock(repo / "skus" / f"{sku}.lock.json").content_hash())
    images = replay((repo, merged), tmp_path / "images", python_bin, registry, keys, event="push", run_id="4343")
    legs = images.run(WORKFLOWS / "images.yml")
    plan = json.loads(legs_of(legs, "matrix")[""].outputs["matrix"])
    assert [e["sku"] for e in plan["include"]] == ["cpu-x86_64"]
    assert {leg.matrix.get("sku") for leg in legs if leg.job in ("build", "gate", "publish")} == {"cpu-x86_64"}
    for job in ("build", "gate", "publish"):
        assert legs_of(legs, job)["cpu-x86_64"].status == "success", (job, legs_of(legs, job)["cpu-x86_64"].steps)
    publish_ws = legs_of(legs, "publish")["cpu-x86_64"].workspace
    assert publish_ws is not None
    published = json.loads((publish_ws / "published.json").read_text())
    new_tag = next(t for t in published["tags"] if t.startswith("5.24.1-"))  # the released engine's version tag
    summary = legs_of(legs, "matrix")[""].summary
    for sku in tags:  # every other SKU was current: not rebuilt, named in the summary
        assert f"`{sku}:{tags[sku]}`" in summary
    check = subprocess.run([str(REPO / ".venv" / "bin" / "skupin"), "verify",
                            f"{registry.addr}/skupin-org/skupin/cpu-x86_64:{new_tag}", "--key", str(keys[1])],
                           capture_output=True, text=True, cwd=repo, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    report(legs)
