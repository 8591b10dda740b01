"""Reproducible images on the real engine and a real registry (issue 32).

- `verify --rebuild` (publishing/rebuild.py) passes on the CPU SKU's published image and, on the same image with one
  file of its top layer changed (published with a signature the verifier trusts: the building machine is the one not
  trusted), names that layer and file;
- (heavy, opt-in with SKUPIN_HEAVY=1) two builds of the CPU SKU from fresh clones, each in a Docker engine of its own
  with an empty data root, push under one manifest digest (bench/reproducible.py measures the same, and the vLLM SKU).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from skupin.builder.render import render
from skupin.builder.reproducible import config_bytes
from skupin.clients.oci import RegistryClient
from skupin.dockerd import Docker
from skupin.publishing.local_registry import LocalRegistry, registry_down, registry_up, untag_on_disk
from skupin.publishing.policy import Expected
from skupin.publishing.publish import parse_target, plan_publish, publish_image, verdict_facts
from skupin.publishing.rebuild import rebuild_reference
from skupin.publishing.verify import verify_reference
from tests.integration.test_publish import BUNDLE, SIGNER, TOL_ENTRY, TOL_KEY, TRUSTED, free_port, make_verdict

pytestmark = pytest.mark.integration
SKU = "cpu-x86_64"


def _expected(lock) -> Expected:
    from skupin.publishing.attest import tolerance_sha256

    return Expected(sku=SKU, lock_sha256=lock.content_hash(), bundle_sha256=BUNDLE, tolerance_key=TOL_KEY,
                    tolerance_sha256=tolerance_sha256(TOL_ENTRY), catalog="test")


@pytest.fixture
def registries(tmp_path: Path) -> Iterator[list[LocalRegistry]]:
    """Two loopback registries: the honest publish and the tampered one (a version tag never moves)."""
    regs = [LocalRegistry(addr=f"127.0.0.1:{free_port()}", folder=tmp_path / f"registry{i}") for i in range(2)]
    for reg in regs:
        registry_up(registry=reg)
    yield regs
    for reg in regs:
        registry_down(registry=reg)


def _publish(docker: Docker, registry: LocalRegistry, *, image_id: str, stack) -> str:
    """Publish `image_id` as the CPU SKU, signed by the test key, with a verdict made here; its verified reference."""
    lock = stack.lock
    verdict = make_verdict(image_id=image_id, lock=lock, sku=SKU)
    target = parse_target(registry.addr)
    plan = plan_publish(sku=SKU, engine_version=stack.manifest.stack.engine.version, lock=lock,
                        dockerfile_sha256=render(stack).sha256, image_id=image_id, verdict=verdict_facts(verdict),
                        target=target, expected=_expected(lock))
    with RegistryClient(target.url, retries=1, backoff=0.1) as client:
        published = publish_image(plan=plan, docker=docker, client=client, signer=SIGNER, trusted=TRUSTED,
                                  untag=lambda repo, tag: untag_on_disk(registry=registry, repository=repo, tag=tag))
    return published.reference


def _one_file_changed(docker: Docker, image: str, scratch: Path) -> tuple[str, int, str]:
    """`image` with the first non-empty file of its top layer changed (a line appended); (its id, that layer's index,
    the file's path). Only the top layer is rewritten, so every other layer stays the engine's own."""
    saved = tarfile.open(fileobj=io.BufferedReader(docker.save_image(image), 1 << 20), mode="r|")  # type: ignore[arg-type]
    layers: dict[str, Path] = {}
    config: dict = {}
    for member in saved:
        source = saved.extractfile(member) if member.isreg() else None
        if source is None:
            continue
        if member.name.endswith("/layer.tar"):
            path = scratch / f"{len(layers)}.tar"
            sha = hashlib.sha256()
            with open(path, "wb") as out:
                while chunk := source.read(1 << 20):
                    sha.update(chunk)
                    out.write(chunk)
            layers["sha256:" + sha.hexdigest()] = path
        elif member.name.endswith(".json") and "/" not in member.name and member.name != "manifest.json":
            config = json.loads(source.read())
    diff_ids = config["rootfs"]["diff_ids"]
    top = layers[diff_ids[-1]]
    changed, name = scratch / "changed.tar", ""
    with tarfile.open(top) as src, tarfile.open(changed, "w", format=tarfile.PAX_FORMAT) as dst:
        for info in src:
            data = src.extractfile(info).read() if info.isreg() else None  # type: ignore[union-attr]
            if data and not name:
                name, data = info.name, data + b"\n# changed after the build\n"
                info.size = len(data)
            dst.addfile(info, io.BytesIO(data) if data is not None else None)
    new_id = "sha256:" + hashlib.sha256(changed.read_bytes()).hexdigest()
    config["rootfs"]["diff_ids"] = [*diff_ids[:-1], new_id]
    body = config_bytes(config)
    load = io.BytesIO()
    with tarfile.open(fileobj=load, mode="w") as out:
        out.add(changed, arcname=f"{new_id[7:]}/layer.tar")
        for fname, data in ((hashlib.sha256(body).hexdigest() + ".json", body),
                            ("manifest.json", json.dumps([{"Config": hashlib.sha256(body).hexdigest() + ".json",
                                                           "RepoTags": None,
                                                           "Layers": [f"{d[7:]}/layer.tar" for d in
                                                                      config["rootfs"]["diff_ids"]]}]).encode())):
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return docker.load_image([load.getvalue()]), len(diff_ids) - 1, name


def test_verify_rebuild_passes_on_the_published_image_and_names_the_one_changed_file(
        docker: Docker, honest_image: str, stack, registries: list[LocalRegistry], tmp_path: Path) -> None:
    def verify(**kw):
        return verify_reference(**kw, expect=lambda _sku: _expected(stack.lock))

    honest = _publish(docker, registries[0], image_id=honest_image, stack=stack)
    # BuildKit's cache may serve these rebuilds (the command's default is no cache): the cold path and separate engines
    # are the heavy test's and bench/reproducible.py's, the comparison and the naming are this test's
    result = rebuild_reference(ref=honest, docker=docker, trusted=TRUSTED, verify=verify, no_cache=False)
    assert result.ok, result.line()
    assert result.rebuilt_digest == result.published_digest and result.rebuilt_image_id == honest_image

    tampered_id, layer, path = _one_file_changed(docker, honest_image, tmp_path)
    try:
        tampered = _publish(docker, registries[1], image_id=tampered_id, stack=stack)
        result = rebuild_reference(ref=tampered, docker=docker, trusted=TRUSTED, verify=verify, no_cache=False)
    finally:
        docker.remove_image(tampered_id, force=True)
    assert not result.ok and result.layer == layer and result.file == path, result.line()
    assert f"layer {layer}" in result.line() and f"/{path}" in result.line()
    assert result.error().exit_code == 8


@pytest.mark.heavy
def test_two_builds_in_separate_empty_engines_push_under_one_digest(tmp_path: Path) -> None:
    """bench/reproducible.py's two cold runs of the CPU SKU: fresh clones, separate empty dockerds (data root, bridge),
    the base made in each, pushed to one registry by the publish's push: one manifest digest (about 10 minutes)."""
    import subprocess
    import sys

    from tests.paths import REPO

    out = tmp_path / "reproducible.json"
    subprocess.run([sys.executable, "-m", "bench.reproducible", "--sku", SKU, "--runs", "cold,cold", "--out", str(out)],
                   cwd=REPO, check=True)
    result = json.loads(out.read_text())["skus"][SKU]
    digests = {run["digest"] for run in result["runs"]}
    assert result["same_digest"] and len(digests) == 1 and len(result["runs"]) == 2, result


def test_the_registry_cache_holds_the_rewritten_layers_with_buildkits_cache_and_hands_the_image_to_the_next_build(
        docker: Docker, honest_image: str, stack, wheelhouse, host_ca_bundle, registries: list[LocalRegistry]) -> None:
    """`skupin build --cache REF`: after a verified build REF holds the rewritten layers under BuildKit's inline cache and
    the result reference the image itself; the next build of the same inputs pulls that and builds nothing.
    (The cold and warm times in engines with no local state are bench/reproducible.py's.)"""
    from skupin.builder.build import build, result_reference

    cache = f"{registries[0].addr}/cache/{SKU}:buildcache"
    first = build(render(stack), docker, wheelhouse=wheelhouse, ca_bundle=host_ca_bundle, cache=cache)
    assert first.image_id == honest_image and first.cache == cache and first.fetched is None  # one lock, one image
    info = docker.inspect_image(first.image_id)
    assert info is not None
    with RegistryClient(f"http://{registries[0].addr}") as client:
        cached = client.get_manifest(f"cache/{SKU}", "buildcache").json()
        config = json.loads(client.get_blob(f"cache/{SKU}", cached["config"]["digest"]))
        result_tag = next(t for t in client.list_tags(f"cache/{SKU}") if t.startswith("buildcache-"))
        pushed = client.get_manifest(f"cache/{SKU}", result_tag)
        result = pushed.json()
    assert config["rootfs"]["diff_ids"] == list(info.layers)  # BuildKit's cache over the rewritten layers
    assert isinstance(config.get("moby.buildkit.cache.v0"), str)
    assert result["config"]["digest"] == first.image_id  # the image itself, layers shared with the cache
    assert [layer["digest"] for layer in result["layers"]] == [layer["digest"] for layer in cached["layers"]]

    second = build(render(stack), docker, wheelhouse=wheelhouse, ca_bundle=host_ca_bundle, cache=cache)
    assert second.fetched == f"{registries[0].addr}/cache/{SKU}@{pushed.digest}"  # named by digest
    assert result_tag == result_reference(cache, result_tag.removeprefix("buildcache-")).rpartition(":")[2]
    assert second.image_id == first.image_id and "buildkit" not in second.phases and "normalise" not in second.phases
    assert second.reproducible is None and first.reproducible is not None  # no claim of a rewrite it did not make
    assert second.installed == first.installed  # still checked against the lock in the image's own Python
    tags = docker.inspect_image(second.image_id).tags  # type: ignore[union-attr]
    assert f"{registries[0].addr}/cache/{SKU}:{result_tag}" not in tags and second.image in tags  # the pull's tag goes
