"""The build planner (pure: no Docker, no network, no files) and its executor on a fake Docker adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skupin.builder.build import (
    CA_SECRET_ID,
    EnsureBase,
    ExportCache,
    FetchResult,
    GatherWheels,
    Normalise,
    RunBuildKit,
    TagImage,
    VerifyInstalled,
    WriteContext,
    WriteRecord,
    build_inputs_key,
    execute_build,
    plan_build,
    result_reference,
)
from skupin.builder.catalog.lockfile import image_tag
from skupin.builder.check import resolve
from skupin.builder.imageconfig import ImageConfig, config_of
from skupin.builder.render import render, render_manifest
from skupin.builder.reproducible import IMAGE_EPOCH
from skupin.common.errors import BuildError, DockerError, LockError
from skupin.dockerd import ImageInfo, RunResult
from tests.paths import SKUS

CPU = SKUS / "cpu-x86_64.yaml"


@pytest.fixture(scope="module")
def rendered():
    """The CPU SKU rendered from its committed lock."""
    return render(resolve(CPU, require_lock=True))


def test_the_plan_is_every_step_in_order_with_what_it_needs(rendered, tmp_path):
    stack = rendered.stack
    lock = stack.lock
    steps = plan_build(rendered, wheelhouse=tmp_path / "house", records=tmp_path / "records",
                       wheel_store=tmp_path / "store", contexts=tmp_path / "contexts", bases=tmp_path / "bases")
    # the wheels come first: a missing or mismatched wheel refuses the build before debootstrap or a pull
    assert [step.kind for step in steps] == ["wheels", "base", "context", "buildkit", "normalise", "verify", "tag",
                                             "record"]
    wheels, base, context, buildkit, normalise, verify, tag, record = steps
    assert base == EnsureBase(manifest=stack.manifest, bases=tmp_path / "bases", locked=lock.base)
    assert wheels == GatherWheels(packages=tuple(lock.packages().values()), store=tmp_path / "store",
                                  wheelhouse=tmp_path / "house")
    assert context == WriteContext(folder=tmp_path / "contexts" / "cpu-x86_64")
    assert buildkit == RunBuildKit(build_args={"SKUPIN_BASE": stack.manifest.base.reference,
                                               "SKUPIN_LOCK_HASH": lock.content_hash(),
                                               "SKUPIN_DOCKERFILE_SHA256": rendered.sha256})
    assert normalise == Normalise(epoch=IMAGE_EPOCH)  # one constant: the installed files' mtimes
    assert verify == VerifyInstalled(locked={name: p.version for name, p in lock.packages().items()})
    assert tag == TagImage(tag=image_tag(sku="cpu-x86_64", engine_version=stack.manifest.stack.engine.version, lock=lock,
                                         dockerfile_sha256=rendered.sha256))
    assert record == WriteRecord(folder=tmp_path / "records")
    assert plan_build(rendered, wheelhouse=tmp_path / "house", records=tmp_path / "records", bases=tmp_path / "bases",
                      wheel_store=tmp_path / "store", contexts=tmp_path / "contexts") == steps  # a plan is a value


def test_a_registry_cache_is_read_first_for_this_builds_image_then_by_buildkit_and_pushed_after_the_tag(rendered):
    cache = "127.0.0.1:5000/cache/cpu-x86_64:buildcache"
    steps = plan_build(rendered, cache=cache)
    lock = rendered.stack.lock
    assert [step.kind for step in steps] == ["fetch", "wheels", "base", "context", "buildkit", "normalise", "verify",
                                             "tag", "cache"]  # only a verified image is cached
    buildkit = steps[4]
    assert isinstance(buildkit, RunBuildKit) and buildkit.cache_from == cache
    assert buildkit.build_args["BUILDKIT_INLINE_CACHE"] == "1"
    assert steps[5] == Normalise(epoch=IMAGE_EPOCH, inline_cache=True)  # the cache image over its layers
    key = build_inputs_key(rendered, build_args=buildkit.build_args, lock=lock)
    fetch = steps[0]
    assert isinstance(fetch, FetchResult) and fetch.reference == result_reference(cache, key)
    assert fetch.base_diff_id == lock.base.diff_id and fetch.config == config_of(rendered.text, ImageConfig())
    assert fetch.labels["io.skupin.dockerfile-sha256"] == rendered.sha256  # every label, build arguments expanded
    assert fetch.labels["io.skupin.lock-sha256"] == lock.content_hash() and fetch.labels["io.skupin.sku"] == "cpu-x86_64"
    assert steps[-1] == ExportCache(reference=cache, result=result_reference(cache, key))
    assert "BUILDKIT_INLINE_CACHE" not in next(s for s in plan_build(rendered) if isinstance(s, RunBuildKit)).build_args
    assert "fetch" not in [s.kind for s in plan_build(rendered, cache=cache, no_cache=True)]  # --no-cache builds


def test_the_result_reference_hashes_every_input_of_the_image(rendered):
    args = {"SKUPIN_BASE": "b", "SKUPIN_LOCK_HASH": "l", "SKUPIN_DOCKERFILE_SHA256": rendered.sha256}
    lock = rendered.stack.lock
    key = build_inputs_key(rendered, build_args=args, lock=lock)
    assert key == build_inputs_key(rendered, build_args=args | {"BUILDKIT_INLINE_CACHE": "1"}, lock=lock)
    name, text = next(iter(rendered.files.items()))
    folder, wheels = next((f, w) for f, w in rendered.wheels.items() if w)
    changed = [
        rendered.model_copy(update={"text": rendered.text + "# more\n"}),
        rendered.model_copy(update={"files": rendered.files | {name: text + " "}}),
        rendered.model_copy(update={"wheels": rendered.wheels | {folder: {n: "0" * 64 for n in wheels}}}),
    ]
    others = {build_inputs_key(r, build_args=args, lock=lock) for r in changed}
    others.add(build_inputs_key(rendered, build_args=args | {"SKUPIN_LOCK_HASH": "m"}, lock=lock))
    others.add(build_inputs_key(rendered, build_args=args, lock=lock.model_copy(
        update={"base": lock.base.model_copy(update={"diff_id": "sha256:" + "9" * 64})})))
    assert len(others) == 5 and key not in others
    assert result_reference("h:5000/c/cpu:buildcache", key) == f"h:5000/c/cpu:buildcache-{key[:32]}"
    for bad in ("h:5000/c/cpu", "h:5000/c/cpu:", "h:5000/c/cpu@sha256:" + "a" * 64, "h:5000/c/cpu:-x", "cpu:tag"):
        with pytest.raises(BuildError, match="not a registry reference with a tag and no digest"):
            result_reference(bad, key)  # a port is not a tag; a digest cannot be rewritten by the next build
        with pytest.raises(BuildError, match="--cache"):
            plan_build(rendered, cache=bad)
    assert len(result_reference("r/c:" + "t" * 128, key).rpartition(":")[2]) == 128


def test_no_record_step_without_a_record_folder(rendered):
    assert "record" not in [step.kind for step in plan_build(rendered)]


def test_the_ca_bundle_reaches_buildkit_only_where_the_dockerfile_mounts_it(rendered, tmp_path):
    ca = tmp_path / "ca.pem"
    locked = plan_build(rendered, ca_bundle=ca)
    buildkit = next(step for step in locked if isinstance(step, RunBuildKit))
    assert buildkit.secrets == {} and buildkit.ca_given  # locked steps need no CA
    assert next(step for step in locked if isinstance(step, GatherWheels)).ca_bundle == ca  # the downloads trust it
    mounting = rendered.model_copy(update={"text": rendered.text + f"RUN --mount=type=secret,id={CA_SECRET_ID} true\n"})
    buildkit = next(step for step in plan_build(mounting, ca_bundle=ca) if isinstance(step, RunBuildKit))
    assert buildkit.secrets == {CA_SECRET_ID: ca}


def test_a_render_without_a_current_lock_is_never_planned(rendered):
    stale = rendered.stack.model_copy(update={"lock_state": "stale", "lock_note": "the manifest changed since the lock"})
    with pytest.raises(LockError, match="cannot build from a lock that is stale .the manifest changed"):
        plan_build(render(stale))
    with pytest.raises(LockError, match="cannot build from a lock that is stale"):
        plan_build(rendered.model_copy(update={"stack": stale}))  # locked text, but the stack's lock moved
    with pytest.raises(BuildError, match="bare manifest"):
        plan_build(render_manifest(manifest=rendered.stack.manifest, lock=rendered.stack.lock))


class _FakeDocker:
    """The adapter calls the executor makes for base, verify and tag; every call is logged."""

    def __init__(self, installed: dict[str, str], layers: tuple[str, ...] = ()) -> None:
        self.installed, self.layers, self.calls = installed, layers, []

    def inspect_image(self, ref: str) -> ImageInfo:
        self.calls.append(("inspect", ref))
        return ImageInfo(id="sha256:" + "1" * 64, tags=(ref,), repo_digests=(), labels={"io.skupin.sku": "cpu-x86_64"},
                         size=123, layers=self.layers, created="now")

    def run(self, spec, *, deadline_s=None) -> RunResult:
        self.calls.append(("run", spec.image))
        return RunResult(exit_code=0, stdout_bytes=json.dumps(self.installed).encode(), stderr="", timed_out=False,
                         seconds=0.1)

    def tag(self, image: str, tag: str) -> None:
        self.calls.append(("tag", image, tag))

    def ping(self) -> str:
        return "20.10.24"

    def remove_image(self, ref: str, *, force: bool = False) -> bool:
        self.calls.append(("remove", ref))
        return True

    def image_config(self, ref: str) -> dict:
        return {}


def _without_buildkit(steps):
    """The plan less the steps that need the wheel store, a context folder and BuildKit."""
    return tuple(step for step in steps if step.kind not in ("wheels", "context", "buildkit", "normalise"))


def test_the_executor_runs_the_steps_in_order_and_records_what_it_returns(rendered, tmp_path, tmp_path_factory):
    lock = rendered.stack.lock
    docker = _FakeDocker({name: p.version for name, p in lock.packages().items()}, layers=(lock.base.diff_id,))
    steps = _without_buildkit(plan_build(rendered, records=tmp_path, bases=tmp_path_factory.mktemp("bases")))
    built = execute_build(steps, rendered=rendered, docker=docker)  # type: ignore[arg-type]
    tag = steps[-2].tag
    assert [call[0] for call in docker.calls] == ["inspect", "inspect", "run", "tag", "inspect"]
    assert docker.calls[3] == ("tag", "", tag) and built.image == tag and built.stack == rendered.stack
    assert list(built.phases) == ["base", "verify", "tag"]
    record = json.loads((tmp_path / "cpu-x86_64.json").read_text())
    assert record == json.loads(built.model_dump_json()) and "stack" not in record  # the record leaves the stack out


def test_an_image_that_is_not_its_lock_is_never_tagged(rendered, tmp_path, tmp_path_factory):
    lock = rendered.stack.lock
    installed = {name: p.version for name, p in lock.packages().items()} | {"evil": "1.0"}
    docker = _FakeDocker(installed, layers=(lock.base.diff_id,))
    with pytest.raises(BuildError, match="(?s)does not contain its locked set .1 difference.*evil: image has 1.0"):
        execute_build(_without_buildkit(plan_build(rendered, records=tmp_path, bases=tmp_path_factory.mktemp("bases"))),
                      rendered=rendered, docker=docker)  # type: ignore[arg-type]
    assert "tag" not in [call[0] for call in docker.calls] and not list(Path(tmp_path).iterdir())
    assert "remove" not in [call[0] for call in docker.calls]  # the image it inspected carries a tag: it stays


def test_a_base_that_is_not_the_locked_one_is_refused_before_anything_is_built(rendered, tmp_path, tmp_path_factory):
    lock = rendered.stack.lock
    other = "sha256:" + "9" * 64
    docker = _FakeDocker({name: p.version for name, p in lock.packages().items()}, layers=(other,))
    with pytest.raises(BuildError, match=f"lock names layer {lock.base.diff_id}, this host's base has {other}"):
        execute_build(_without_buildkit(plan_build(rendered, records=tmp_path, bases=tmp_path_factory.mktemp("bases"))),
                      rendered=rendered, docker=docker)  # type: ignore[arg-type]
    assert [call[0] for call in docker.calls] == ["inspect", "inspect"] and not list(Path(tmp_path).iterdir())


def test_a_failed_build_removes_the_untagged_image_it_made(rendered, tmp_path_factory, monkeypatch):
    from skupin.builder import build as building

    lock = rendered.stack.lock

    class Untagged(_FakeDocker):
        def inspect_image(self, ref: str) -> ImageInfo:
            info = super().inspect_image(ref)
            return info.model_copy(update={"tags": ()}) if ref == "sha256:made" else info

    installed = {name: p.version for name, p in lock.packages().items()} | {"evil": "1.0"}
    docker = Untagged(installed, layers=(lock.base.diff_id,))
    verify = building._verify_installed

    def verify_what_was_made(step, run):  # BuildKit and Normalise left an untagged image; it fails the lock
        run.image_id = "sha256:made"
        verify(step, run)

    monkeypatch.setattr(building, "_verify_installed", verify_what_was_made)
    with pytest.raises(BuildError, match="does not contain its locked set"):
        execute_build(_without_buildkit(plan_build(rendered, bases=tmp_path_factory.mktemp("bases"))),
                      rendered=rendered, docker=docker)  # type: ignore[arg-type]
    assert ("remove", "sha256:made") in docker.calls


class _Registry(_FakeDocker):
    """A fake engine whose pull finds `pulled` (an image id) with `labels`, or fails as a registry miss does."""

    def __init__(self, installed, *, layers, labels, pulled: str | None) -> None:
        super().__init__(installed, layers=layers)
        self.labels, self.pulled = labels, pulled

    def pull(self, ref: str, *, hint: bool = True) -> str:
        self.calls.append(("pull", ref))
        if self.pulled is None:
            raise DockerError(f"cannot pull {ref}: manifest unknown")
        return self.pulled

    def inspect_image(self, ref: str) -> ImageInfo:
        info = super().inspect_image(ref)
        return info.model_copy(update={"labels": self.labels, "id": self.pulled or info.id,
                                       "repo_digests": (f"127.0.0.1:5000/cache/cpu-x86_64@sha256:{'d' * 64}",)})

    def image_config(self, ref: str) -> dict:
        return self.config

    config: dict = {}


def _fetch_plan(rendered, tmp_path):
    return plan_build(rendered, cache="127.0.0.1:5000/cache/cpu-x86_64:buildcache", records=tmp_path)


def _engine(config: ImageConfig) -> dict:
    """`config` as `docker inspect` reports an image's Config."""
    return {"Env": [f"{k}={v}" for k, v in config.env], "Entrypoint": list(config.entrypoint) or None,
            "Cmd": list(config.cmd) or None, "WorkingDir": config.working_dir, "User": config.user,
            "Shell": list(config.shell) or None, "ExposedPorts": {p: {} for p in config.exposed_ports},
            "Volumes": {v: {} for v in config.volumes} or None, "OnBuild": list(config.on_build) or None,
            "StopSignal": config.stop_signal or None}


def test_a_result_in_the_registry_cache_skips_every_step_that_makes_an_image(rendered, tmp_path):
    lock = rendered.stack.lock
    steps = _fetch_plan(rendered, tmp_path)
    fetch, tag = steps[0], next(s for s in steps if isinstance(s, TagImage))
    docker = _Registry({name: p.version for name, p in lock.packages().items()}, layers=(lock.base.diff_id, "sha256:x"),
                       labels=fetch.labels, pulled="sha256:" + "2" * 64)
    docker.config = _engine(fetch.config)
    built = execute_build(steps, rendered=rendered, docker=docker)  # type: ignore[arg-type]
    assert [c[0] for c in docker.calls] == ["pull", "inspect", "run", "tag", "inspect", "remove", "inspect"]
    assert docker.calls[0] == ("pull", fetch.reference) and docker.calls[3] == ("tag", "sha256:" + "2" * 64, tag.tag)
    assert docker.calls[5] == ("remove", fetch.reference)  # the pull's tag goes; the version tag stays
    assert built.fetched == f"127.0.0.1:5000/cache/cpu-x86_64@sha256:{'d' * 64}"  # by digest, not the movable tag
    assert built.image_id == "sha256:" + "2" * 64
    assert list(built.phases) == ["fetch", "verify", "tag"]  # no wheels, base, BuildKit, rewrite or cache push
    assert built.reproducible is None  # nothing here rewrote it: the signed record gets no account of a build


@pytest.mark.parametrize("change, why", [
    (lambda labels, config, layers: (labels | {"io.skupin.lock-sha256": "x"}, config, layers),
     "label io.skupin.lock-sha256: 'x', not"),
    (lambda labels, config, layers: (labels | {"io.skupin.sandbox": "1"}, config, layers),
     "label 'io.skupin.sandbox' the render does not set"),
    (lambda labels, config, layers: ({k: v for k, v in labels.items() if "dockerfile" not in k}, config, layers),
     "label io.skupin.dockerfile-sha256: 'None', not"),
    (lambda labels, config, layers: (labels, config | {"Volumes": {"/data": {}}}, layers), "config volumes differs"),
    (lambda labels, config, layers: (labels, config | {"Env": [*config["Env"], "LD_PRELOAD=/x.so"]}, layers),
     "config env differs"),
    (lambda labels, config, layers: (labels, config, ("sha256:" + "9" * 64,)), "its first layer is not the locked base"),
])
def test_a_cached_result_that_is_not_these_inputs_is_not_used_before_it_runs(rendered, tmp_path, change, why):
    lock = rendered.stack.lock
    steps = _fetch_plan(rendered, tmp_path)
    lines: list[str] = []
    labels, config, layers = change(steps[0].labels, _engine(steps[0].config), (lock.base.diff_id,))
    docker = _Registry({}, layers=layers, labels=labels, pulled="sha256:" + "3" * 64)
    docker.config = config
    with pytest.raises(BuildError, match="ends before the image was tagged"):  # a build would follow
        execute_build(steps[:1], rendered=rendered, docker=docker, on_line=lines.append)  # type: ignore[arg-type]
    assert any(why in line and line.endswith("building") for line in lines), lines
    assert ("remove", steps[0].reference) in docker.calls and "run" not in [c[0] for c in docker.calls]


def test_a_cached_result_that_fails_a_later_check_is_replaced_by_a_build(rendered, tmp_path):
    """A hit whose image fails the lock check does not fail the build: it goes, and the plan runs without the fetch
    (here only verify and tag: the image made then fails the same fake check, so the error is the build's own)."""
    lock = rendered.stack.lock
    steps = _fetch_plan(rendered, tmp_path)
    fetch = steps[0]
    docker = _Registry({name: p.version for name, p in lock.packages().items()} | {"evil": "1.0"},
                       layers=(lock.base.diff_id,), labels=fetch.labels, pulled="sha256:" + "4" * 64)
    docker.config = _engine(fetch.config)
    lines: list[str] = []
    plan = (fetch, *_without_buildkit(steps[1:]))
    with pytest.raises(BuildError, match="does not contain its locked set"):
        execute_build(plan, rendered=rendered, docker=docker, on_line=lines.append)  # type: ignore[arg-type]
    assert any(line.startswith("the image from the registry cache failed: image sha256:4444") and
               line.endswith("building") for line in lines), lines
    assert [c for c in docker.calls if c[0] == "pull"] == [("pull", fetch.reference)]  # fetched once, then built
    assert ("remove", fetch.reference) in docker.calls


def test_a_registry_miss_builds(rendered, tmp_path):
    steps = _fetch_plan(rendered, tmp_path)
    lines: list[str] = []
    docker = _Registry({}, layers=(), labels={}, pulled=None)
    with pytest.raises(BuildError, match="ends before the image was tagged"):  # a build would follow
        execute_build(steps[:1], rendered=rendered, docker=docker, on_line=lines.append)  # type: ignore[arg-type]
    assert docker.calls == [("pull", steps[0].reference)]
    assert any("none to reuse (cannot pull" in line and line.endswith("building") for line in lines), lines
