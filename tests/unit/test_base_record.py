"""The host's record of a bootstrap base (builder/base.py) and how `pins` finds the locked base of an image with it:
a local tag anything can re-point is never what the base's layers are taken from."""

from __future__ import annotations

from pathlib import Path

import pytest

from skupin.builder.base import base_record_path, ensure_base, read_base_record, record_base
from skupin.builder.catalog.lockfile import Lock, LockedBase
from skupin.builder.catalog.manifest import load_manifest
from skupin.common.errors import BuildError
from skupin.dockerd import ImageInfo
from skupin.gates.integrity.static import locked_base_layers
from tests.paths import SKUS

MANIFEST = load_manifest(SKUS / "cpu-x86_64.yaml")
RECIPE = MANIFEST.base.bootstrap
BASE_LAYERS = ("sha256:" + "a" * 64,)
HOSTILE_LAYERS = ("sha256:" + "e" * 64,)


def info(layers: tuple[str, ...], *, image_id: str = "sha256:" + "1" * 64, digests: tuple[str, ...] = ()) -> ImageInfo:
    return ImageInfo(id=image_id, tags=(), repo_digests=digests, labels={}, size=1, layers=layers, created="now")


class FakeDocker:
    """Images by reference; image_config answers the same config for all."""

    def __init__(self, images: dict[str, ImageInfo], config: dict | None = None) -> None:
        self.images, self.config = images, config or {}

    def inspect_image(self, ref: str) -> ImageInfo | None:
        return self.images.get(ref)

    def image_config(self, ref: str) -> dict:
        return dict(self.config)


def lock(**base) -> Lock:
    return Lock(sku="cpu-x86_64", manifest_sha256="0" * 64, python="3.11", platform="linux/amd64",
                base=LockedBase(**base), layers={}, dockerfile_sha256="0" * 64, resolver="test", tool_version="0",
                created="")


BOOTSTRAP = {"kind": "bootstrap", "reference": RECIPE.local_tag(), "recipe_sha256": RECIPE.recipe_sha256()}


def test_a_base_found_under_its_tag_is_recorded_once_and_a_repointed_tag_is_refused(tmp_path: Path) -> None:
    events: list[str] = []
    docker = FakeDocker({RECIPE.local_tag(): info(BASE_LAYERS)}, config={"Env": None})
    ensure_base(manifest=MANIFEST, docker=docker, on_event=events.append, bases=tmp_path)  # type: ignore[arg-type]
    record = read_base_record(RECIPE.recipe_sha256(), folder=tmp_path)
    assert record is not None and record.bases[0].layers == BASE_LAYERS and record.bases[0].origin == "found"
    assert "trust on first use" in events[0]
    assert ensure_base(manifest=MANIFEST, docker=docker, bases=tmp_path) == "sha256:" + "1" * 64  # type: ignore[arg-type]
    docker.images[RECIPE.local_tag()] = info(HOSTILE_LAYERS, image_id="sha256:" + "2" * 64)  # a `docker load` re-points it
    with pytest.raises(BuildError, match="the tag was re-pointed"):
        ensure_base(manifest=MANIFEST, docker=docker, bases=tmp_path)  # type: ignore[arg-type]


def test_pins_takes_a_bootstrap_base_from_the_record_not_from_the_tag(tmp_path: Path) -> None:
    record_base(recipe=RECIPE, info=info(BASE_LAYERS), config={"Env": ["A=1"]}, origin="bootstrapped",
                folder=tmp_path / "bases")
    hostile = FakeDocker({RECIPE.local_tag(): info(HOSTILE_LAYERS)})  # the tag now names the hostile image's bottom
    found = locked_base_layers(docker=hostile, lock=lock(**BOOTSTRAP), layers=(*BASE_LAYERS, "sha256:" + "b" * 64),
                               state=tmp_path)
    assert found.layers == 1 and found.config is not None and found.config.env == (("A", "1"),)
    assert not found.problem and not found.unverifiable
    built_on_hostile = locked_base_layers(docker=hostile, lock=lock(**BOOTSTRAP), layers=(*HOSTILE_LAYERS, "x"),
                                          state=tmp_path)
    assert built_on_hostile.layers == 0 and "not built on a base recorded" in built_on_hostile.problem


def test_no_record_is_an_error_that_says_how_to_make_one(tmp_path: Path) -> None:
    found = locked_base_layers(docker=FakeDocker({}), lock=lock(**BOOTSTRAP), layers=BASE_LAYERS, state=tmp_path)
    assert found.layers == 0 and "fix: skupin base cpu-x86_64" in found.unverifiable
    assert str(base_record_path(RECIPE.recipe_sha256(), folder=tmp_path / "bases")) in found.unverifiable


def test_a_broken_record_is_an_error_not_a_pass(tmp_path: Path) -> None:
    path = base_record_path(RECIPE.recipe_sha256(), folder=tmp_path / "bases")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    found = locked_base_layers(docker=FakeDocker({}), lock=lock(**BOOTSTRAP), layers=BASE_LAYERS, state=tmp_path)
    assert found.layers == 0 and "not a base record" in found.unverifiable


def test_a_registry_base_is_the_engines_image_of_the_locked_digest(tmp_path: Path) -> None:
    digest = "sha256:" + "d" * 64
    ref = f"nvcr.io/nvidia/cuda:12.8.0-runtime-ubuntu24.04@{digest}"
    pinned = lock(kind="image", reference=ref, digest=digest)
    docker = FakeDocker({ref: info(BASE_LAYERS, digests=(f"nvcr.io/nvidia/cuda@{digest}",))},
                        config={"Entrypoint": ["/opt/nvidia/nvidia_entrypoint.sh"]})
    found = locked_base_layers(docker=docker, lock=pinned, layers=(*BASE_LAYERS, "x"), state=tmp_path)
    assert found.layers == 1 and found.config is not None and found.config.entrypoint == ("/opt/nvidia/nvidia_entrypoint.sh",)
    assert "bottom layers differ" in locked_base_layers(docker=docker, lock=pinned, layers=HOSTILE_LAYERS,
                                                        state=tmp_path).problem
    assert "not on this engine" in locked_base_layers(docker=FakeDocker({}), lock=pinned, layers=BASE_LAYERS,
                                                      state=tmp_path).unverifiable
    undigested = FakeDocker({ref: info(BASE_LAYERS)})
    assert "does not carry that digest" in locked_base_layers(docker=undigested, lock=pinned, layers=BASE_LAYERS,
                                                              state=tmp_path).unverifiable
    unpinned = lock(kind="image", reference="nvcr.io/nvidia/cuda:latest", digest=digest)
    assert "not pinned by its digest" in locked_base_layers(docker=docker, lock=unpinned, layers=BASE_LAYERS,
                                                            state=tmp_path).unverifiable
