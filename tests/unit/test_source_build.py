"""A source-built engine (stack.engine.source kind sdist): grammar, the lock's sdist record, the render, the
host's record of the built wheel, and the pins check of the files that wheel installs. No Docker, no network."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path

import pytest
import yaml

from skupin.builder.catalog.lockfile import Lock, LockedPackage, read_lock
from skupin.builder.catalog.manifest import load_manifest, parse_manifest
from skupin.builder.lock import BUILD_STAGE, PipRequest, lock_sku, lock_status
from skupin.builder.render import ENGINE_BUILD_STAGE, ENGINE_WHEEL_STAGE, render_manifest
from skupin.builder.sdist import applicable, read_sdist
from skupin.builder.sourcebuild import BuiltWheel, export_wheel, read_built, write_built
from skupin.builder.wheels import store_path
from skupin.common.errors import BuildError, LockError
from skupin.gates.integrity.static import built_wheels
from tests.data.wheels import make_wheel
from tests.unit.test_integrity import Image, _check, _installed, honest  # noqa: F401 - honest is a fixture

ROOT = Path(__file__).resolve().parents[2]
SKU = ROOT / "skus" / "cpu-x86_64-llamacpp.yaml"
SNAPSHOT = Path(__file__).parent / "snapshots" / "cpu-x86_64-llamacpp.locked.Dockerfile"
ENV = {"python_version": "3.11", "sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux",
       "implementation_name": "cpython", "os_name": "posix", "platform_python_implementation": "CPython",
       "python_full_version": "3.11.0", "implementation_version": "3.11.0", "platform_release": "", "platform_version": ""}


# ---------------------------------------------------------------- grammar


def _manifest_with(tmp_path: Path, edit) -> tuple[object, list]:
    data = yaml.safe_load(SKU.read_text())
    edit(data)
    path = tmp_path / "cpu-x86_64-llamacpp.yaml"
    path.write_text(yaml.safe_dump(data))
    return parse_manifest(path)


def test_the_llamacpp_manifest_builds_its_engine_from_the_sdist() -> None:
    manifest = load_manifest(SKU)
    engine = manifest.stack.engine
    assert engine.is_sdist and not engine.is_python and engine.source.kind == "sdist"
    assert [p.name for p in engine.source.build_packages] == ["cmake", "make"]
    assert "-DGGML_NATIVE=OFF" in engine.source.cmake_args
    assert manifest.stack.framework.name == "none" and "kernels" not in manifest.gate.checks


@pytest.mark.parametrize("edit, field, words", [
    (lambda d: d["stack"]["framework"].update(name="x", version="1", source={"kind": "sdist"}), "stack",
     "is for the engine only"),
    (lambda d: d["stack"]["compiler"].update(source={"kind": "none"}), "stack", "must then come from apt"),
    (lambda d: d["base"].update(family="cuda"), "(top)", "cpu family's template only"),
    (lambda d: d["stack"]["engine"]["source"].update(cmake_args=["-DX=1; rm -rf /"]), "stack.engine.source.cmake_args[0]",
     "should match pattern"),
    (lambda d: d["stack"]["engine"]["source"].update(build_packages=[{"name": "cmake"}]),
     "stack.engine.source.build_packages[0].version", "required key is missing"),
    (lambda d: d["stack"]["engine"]["source"].update(build_packages=[{"name": "cmake", "version": "1"} for _ in "ab"]),
     "stack.engine.source", "names a package twice"),
    (lambda d: d["stack"]["engine"]["source"].update(wheels="x"), "stack.engine.source.wheels", "unknown key"),
])
def test_a_bad_source_build_is_refused_naming_file_and_field(tmp_path: Path, edit, field, words) -> None:
    manifest, problems = _manifest_with(tmp_path, edit)
    assert manifest is None
    assert any(p.field == field and words in p.message and p.file.endswith("cpu-x86_64-llamacpp.yaml")
               for p in problems), [(p.field, p.message) for p in problems]


# ---------------------------------------------------------------- the sdist and the lock


def make_sdist(folder: Path, *, name: str = "llama_cpp_python", version: str = "0.3.36",
               requires: tuple[str, ...] = ("numpy>=1.20.0", "uvicorn>=0.22.0; extra == \"server\"",
                                            "pytest; extra == \"test\"", "pywin; sys_platform == \"win32\""),
               build: str = '["scikit-build-core[pyproject]>=0.9.2"]', dynamic: str = "") -> Path:
    path = folder / f"{name}-{version}.tar.gz"
    pkg_info = (f"Metadata-Version: 2.2\nName: {name.replace('_', '-')}\nVersion: {version}\n{dynamic}"
                + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode()
    pyproject = f"[build-system]\nrequires = {build}\nbuild-backend = \"scikit_build_core.build\"\n".encode()
    with tarfile.open(path, "w:gz") as archive:
        for member, data in (("PKG-INFO", pkg_info), ("pyproject.toml", pyproject), ("CMakeLists.txt", b"")):
            info = tarfile.TarInfo(f"{name}-{version}/{member}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _sdist_pkg(path: Path) -> LockedPackage:
    return LockedPackage(name="llama-cpp-python", version="0.3.36", filename=path.name,
                         sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                         url=f"https://files.example/{path.name}", source="sdist")


def test_the_sdist_says_what_it_builds_and_runs_with(tmp_path: Path) -> None:
    path = make_sdist(tmp_path)
    info = read_sdist(path, _sdist_pkg(path))
    assert info.build_requires == ("scikit-build-core[pyproject]>=0.9.2",)
    assert applicable(info.requires_dist, env=ENV, extras=("server",), what="t") == ("numpy>=1.20.0", "uvicorn>=0.22.0")
    assert applicable(info.requires_dist, env=ENV, what="t") == ("numpy>=1.20.0",)


@pytest.mark.parametrize("kwargs, words", [
    ({"dynamic": "Dynamic: Requires-Dist\n"}, "dynamic"),
    ({"build": "[]"}, "no [build-system] requires"),
    ({"version": "0.3.35"}, "not llama-cpp-python 0.3.36"),
])
def test_an_sdist_the_lock_cannot_know_is_refused(tmp_path: Path, kwargs, words) -> None:
    path = make_sdist(tmp_path, **kwargs)
    pkg = _sdist_pkg(path).model_copy(update={"filename": path.name})
    with pytest.raises(LockError, match=re.escape(words)):
        read_sdist(path, pkg)


def _report(items: list[tuple[str, str, tuple[str, ...]]]) -> dict:
    install = []
    for name, version, requires in items:
        filename = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        install.append({"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
                        "download_info": {"url": f"https://files.example/{filename}",
                                          "archive_info": {"hashes": {"sha256": hashlib.sha256(filename.encode()).hexdigest()}}}})
    return {"install": install, "pip_version": "25.3"}


class Resolver:
    """Answers the engine's run requirements, then the build stage's requirements."""

    def __init__(self) -> None:
        self.requests: list[PipRequest] = []

    def __call__(self, request: PipRequest) -> dict:
        self.requests.append(request)
        if request.layer == "build":
            return _report([("scikit-build-core", "1.1.2", ("packaging>=23.2", "pathspec>=0.10.1")),
                            ("packaging", "26.4", ()), ("pathspec", "1.1.1", ())])
        return _report([("numpy", "2.4.6", ()), ("uvicorn", "0.54.0", ("h11>=0.8",)), ("h11", "0.16.0", ())])


def _lock(tmp_path: Path, resolver: Resolver | None = None) -> Lock:
    sdist = make_sdist(tmp_path)
    manifest = load_manifest(SKU)
    return lock_sku(manifest=manifest, manifest_path=SKU, wheelhouse=None, resolve=resolver or Resolver(),
                    reachable=lambda _url: True, sdist=lambda pin, url: (_sdist_pkg(sdist), sdist))


def test_the_lock_records_the_sdist_its_build_wheels_and_its_run_wheels(tmp_path: Path) -> None:
    resolver = Resolver()
    lock = _lock(tmp_path, resolver)
    engine = {p.name: p for p in lock.layers["engine"]}
    assert set(engine) == {"numpy", "uvicorn", "h11", "llama-cpp-python"}
    sdist = engine["llama-cpp-python"]
    assert sdist.source == "sdist" and sdist.filename.endswith(".tar.gz") and sdist.url.startswith("https://")
    assert set(lock.sources()) == {"llama-cpp-python"}
    assert [p.name for p in lock.build] == ["packaging", "pathspec", "scikit-build-core"]
    assert all(p.filename.endswith(".whl") and len(p.sha256) == 64 for p in (*lock.build, *engine.values())
               if p.source != "sdist")
    assert lock.system == {BUILD_STAGE: ("g++-12=12.2.0-14+deb12u1", "cmake=3.25.1-1", "make=4.3-4.1"),
                           "extras": ("libgomp1=12.2.0-14+deb12u1",)}  # the image's own: the OpenMP runtime
    assert [r.layer for r in resolver.requests] == ["engine", "build"]
    assert resolver.requests[0].requirements == ("numpy>=1.20.0", "uvicorn>=0.22.0")
    assert resolver.requests[1].requirements == ("scikit-build-core[pyproject]>=0.9.2",)


def test_a_wheel_only_lock_keeps_its_hash_and_sdists_stay_refused_elsewhere(tmp_path: Path) -> None:
    lock = read_lock(ROOT / "skus" / "nvidia-h200-vllm.lock.json")
    data = json.loads((ROOT / "skus" / "nvidia-h200-vllm.lock.json").read_text())
    assert "build" not in data and lock.build == () and lock.sources() == {}
    assert lock.content_hash() == Lock.model_validate(data).content_hash()
    from skupin.builder.lock import parse_report
    report = {"install": [{"metadata": {"name": "x", "version": "1"},
                           "download_info": {"url": "https://files.example/x-1.tar.gz",
                                             "archive_info": {"hashes": {"sha256": "0" * 64}}}}]}
    with pytest.raises(LockError, match="locks take wheels only"):
        parse_report(report, layer="engine")


def test_the_committed_lock_is_current() -> None:
    manifest = load_manifest(SKU)
    state, note, lock = lock_status(manifest=manifest, manifest_path=SKU)
    assert state == "ok", note
    assert lock is not None and set(lock.sources()) == {"llama-cpp-python"} and lock.build


# ---------------------------------------------------------------- the render


def test_the_locked_render_builds_the_sdist_offline_in_its_own_stage() -> None:
    """Exact text (UPDATE_SNAPSHOTS=1 rewrites): the build stage, the wheel stage, then the image."""
    manifest = load_manifest(SKU)
    lock = read_lock(SKU.with_name("cpu-x86_64-llamacpp.lock.json"))
    rendered = render_manifest(manifest=manifest, lock=lock)
    text = re.sub(r"(; tools sha256 )[0-9a-f]{16}$", r"\1<tools>", rendered.text, flags=re.M)
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(text, encoding="utf-8")
    assert text == SNAPSHOT.read_text(encoding="utf-8")
    sdist = next(iter(lock.sources().values()))
    assert rendered.wheels["wheels/engine-sdist"] == {sdist.filename: sdist.sha256}
    assert rendered.wheels["wheels/build"] == {p.filename: p.sha256 for p in lock.build}
    assert sdist.filename not in "".join(rendered.files.values())  # never a pip step's requirement
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", rendered.text, flags=re.M)
    assert stages == [("${SKUPIN_BASE}", ENGINE_BUILD_STAGE), ("scratch", ENGINE_WHEEL_STAGE), ("${SKUPIN_BASE}", "")]
    image = rendered.text.rsplit("\nFROM ${SKUPIN_BASE}\n", 1)[1]
    assert "g++-12" not in image and "cmake" not in image and sdist.filename not in image
    assert f"--mount=type=bind,from={ENGINE_BUILD_STAGE},source=/out,target=/tmp/skupin-built" in image
    from skupin.builder.imageconfig import apt_installs
    named = ("ca-certificates", "python3.11", "python3.11-venv")  # then the rest of the python layer's apt closure
    closure = [item.partition("=")[0] for item in lock.apt_closure["python"]]  # type: ignore[index]
    assert apt_installs(rendered.text) == (*named, *(n for n in closure if n not in named), "libgomp1")


# ---------------------------------------------------------------- the host's record of the built wheel


def _export(tmp_path: Path, lock: Lock, *, line: str | None = None) -> Path:
    out = tmp_path / "export"
    (out / "wheel").mkdir(parents=True)
    wheel = make_wheel(out / "wheel", name="llama-cpp-python", version="0.3.36",
                       files={"llama_cpp/__init__.py": b"__version__ = '0.3.36'\n", "llama_cpp/lib/libllama.so": b"\x7fELF"},
                       requires=("numpy>=1.20.0",))
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (out / "requirements.txt").write_text((line or f"llama-cpp-python==0.3.36 --hash=sha256:{sha}") + "\n")
    return out


def test_the_built_wheel_is_stored_and_recorded_by_the_lock_it_belongs_to(tmp_path: Path) -> None:
    lock = _lock(tmp_path)
    store, records = tmp_path / "store", tmp_path / "built"
    record = export_wheel(_export(tmp_path, lock), lock=lock, image_id="sha256:abc", store=store)
    assert store_path(store, record.wheel).is_file() and record.sdist == lock.sources()["llama-cpp-python"]
    write_built(record, folder=records)
    assert read_built(lock, folder=records) == record
    other = lock.model_copy(update={"sku": "other"})
    assert read_built(other, folder=records) is None  # another lock, another record


def test_an_export_whose_wheel_is_not_the_one_the_stage_named_is_refused(tmp_path: Path) -> None:
    lock = _lock(tmp_path)
    with pytest.raises(BuildError, match="has sha256"):
        export_wheel(_export(tmp_path, lock, line="llama-cpp-python==0.3.36 --hash=sha256:" + "0" * 64), lock=lock,
                     image_id="x", store=tmp_path / "store")


def test_without_this_hosts_record_the_engine_files_are_unverifiable(tmp_path: Path) -> None:
    lock = _lock(tmp_path)
    found, problems = built_wheels(lock=lock, record=None, store=tmp_path / "store")
    assert found == {} and "no record of the wheel built from" in problems[0]
    record = export_wheel(_export(tmp_path, lock), lock=lock, image_id="x", store=tmp_path / "store")
    found, problems = built_wheels(lock=lock, record=record, store=tmp_path / "store")
    assert problems == [] and found["llama-cpp-python"].name == record.wheel.filename
    store_path(tmp_path / "store", record.wheel).write_bytes(b"swapped")  # the store's copy changed afterwards
    found, problems = built_wheels(lock=lock, record=record, store=tmp_path / "store")
    assert found == {} and "the record says" in problems[0]


# ---------------------------------------------------------------- the pins check of the built files


def test_pins_verifies_the_built_engines_files_against_the_recorded_wheel(honest, tmp_path: Path) -> None:
    image, lock, wheels = honest
    built = make_wheel(tmp_path, name="llama-cpp-python", version="0.3.36",
                       files={"llama_cpp/__init__.py": b"X = 1\n", "llama_cpp/lib/libllama.so": b"\x7fELF lib"},
                       requires=("tiny>=1",))
    sdist = LockedPackage(name="llama-cpp-python", version="0.3.36", filename="llama_cpp_python-0.3.36.tar.gz",
                          sha256="1" * 64, url="https://files.example/llama_cpp_python-0.3.36.tar.gz", source="sdist")
    lock = lock.model_copy(update={"layers": {"engine": (*lock.layers["engine"], sdist)},
                                   "system": {BUILD_STAGE: ("g++-12=12.2.0-14+deb12u1", "cmake=3.25.1-1")}})
    for path, data in _installed(built).items():
        image.add(path, data)
    labels = {"io.skupin.lock-sha256": lock.content_hash()}
    report = _check(image, lock, {**wheels, "llama-cpp-python": built}, labels=labels)
    assert report.ok, [f.line() for f in report.findings]  # the build stage's apt packages are not the image's
    assert report.counts["wheel_files_verified"] >= 4
    lib = next(p for p in _installed(built) if p.endswith("libllama.so"))
    image.add(lib, b"\x7fELF a library the image swapped in")
    report = _check(image, lock, {**wheels, "llama-cpp-python": built}, labels=labels)
    assert [(f.kind, f.path) for f in report.findings] == [("wheel", lib)]
    assert "file of locked llama-cpp-python was changed" in report.findings[0].detail


def test_a_built_wheel_record_is_frozen_json(tmp_path: Path) -> None:
    sdist = LockedPackage(name="a", version="1", filename="a-1.tar.gz", sha256="1" * 64, source="sdist")
    wheel = sdist.model_copy(update={"filename": "a-1-py3-none-linux_x86_64.whl", "sha256": "2" * 64})
    record = BuiltWheel(sku="s", lock_sha256="3" * 64, image_id="i", sdist=sdist, wheel=wheel, created="")
    path = write_built(record, folder=tmp_path)
    assert BuiltWheel.model_validate(json.loads(path.read_text())) == record


def test_the_build_plan_gathers_the_build_wheels_and_records_the_built_wheel(tmp_path: Path) -> None:
    from skupin.builder.build import GatherWheels, RecordBuiltWheel, RunBuildKit, plan_build
    from skupin.builder.check import resolve
    from skupin.builder.render import render

    rendered = render(resolve(SKU, require_lock=True))
    lock = rendered.stack.current_lock
    steps = plan_build(rendered, wheel_store=tmp_path / "store", built=tmp_path / "built", records=tmp_path / "records")
    assert [s.kind for s in steps] == ["wheels", "base", "context", "buildkit", "normalise", "verify", "tag", "built",
                                         "record"]
    gather = next(s for s in steps if isinstance(s, GatherWheels))
    assert set(gather.packages) == {*lock.packages().values(), *lock.build}  # the sdist and the build wheels too
    buildkit = next(s for s in steps if isinstance(s, RunBuildKit))
    assert buildkit.export_stage == ENGINE_WHEEL_STAGE and buildkit.store == tmp_path / "store"
    assert next(s for s in steps if isinstance(s, RecordBuiltWheel)).folder == tmp_path / "built"
