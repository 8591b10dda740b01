"""Unit tests of builder.lock: pip's recorded reports replayed, no network, no pip subprocess."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from skupin.builder.catalog.lockfile import PY_LAYERS, lock_path, read_lock, write_lock
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.catalog.pylock import write_pylock
from skupin.builder.lock import (
    PipRequest,
    Resolved,
    closure,
    lock_sku,
    lock_status,
    pip_command,
    pip_environment,
    target_environment,
    target_platforms,
)
from skupin.common.errors import LockError
from skupin.common.model import canonical_json

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
CPU = ROOT / "skus" / "cpu-x86_64.yaml"
H200 = ROOT / "skus" / "nvidia-h200-vllm.yaml"
DOCKERFILE = "d" * 64
FAKE_TORCH = b"not really a wheel, but hashed like one"


def _recorded(name: str) -> list[dict]:
    return json.loads((DATA / f"lock-{name}.pip-reports.json").read_text())


class Replay:
    """A resolver that answers each pip request with the next recorded report and remembers the requests."""

    def __init__(self, reports: list[dict]) -> None:
        self.reports = list(reports)
        self.requests: list[PipRequest] = []

    def __call__(self, request: PipRequest) -> dict:
        self.requests.append(request)
        return self.reports[len(self.requests) - 1]


@pytest.fixture
def wheelhouse(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(FAKE_TORCH)
    return folder


def _cpu_reports(wheelhouse: Path) -> list[dict]:
    """The recorded CPU report with the wheelhouse file moved to this test's fake wheelhouse."""
    reports = [r["report"] for r in _recorded("cpu-x86_64")]
    text = json.dumps(reports).replace("file:///opt/wheels/", f"file://{wheelhouse}/")
    return json.loads(text)


def _lock_cpu(wheelhouse: Path, reports: list[dict] | None = None, manifest=None):
    resolver = Replay(reports if reports is not None else _cpu_reports(wheelhouse))
    lock = lock_sku(manifest=manifest or load_manifest(CPU), manifest_path=CPU, wheelhouse=wheelhouse,
                    resolve=resolver, reachable=lambda _url: True)
    return lock, resolver


def _layer_of(lock, name: str) -> str:
    found = [layer for layer, pkgs in lock.layers.items() for p in pkgs if p.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


# ---------------------------------------------------------------- the CPU SKU, replayed


def test_cpu_layers_pins_and_hashes(wheelhouse):
    lock, resolver = _lock_cpu(wheelhouse)
    torch = lock.packages()["torch"]
    # from the wheelhouse, with the URL of its home the manifest names (a hosted runner downloads it from there)
    assert (torch.version, torch.source, torch.url) == (
        "2.13.0+cpu", "wheelhouse", "https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    # The wheelhouse file is hashed here, not taken from pip's report.
    assert torch.sha256 == hashlib.sha256(FAKE_TORCH).hexdigest()
    assert _layer_of(lock, "torch") == "framework"
    assert _layer_of(lock, "sympy") == "framework"  # a dependency of torch
    assert _layer_of(lock, "transformers") == "engine"
    assert _layer_of(lock, "uvicorn") == "engine"  # from transformers[serving]
    # numpy is pinned in extras, but transformers needs it: it lands in the lowest layer that needs it.
    assert _layer_of(lock, "numpy") == "engine"
    assert lock.packages()["numpy"].version == "2.4.6"
    assert lock.system == {"compiler": ("g++-12=12.2.0-14+deb12u1",)}
    assert lock.base.kind == "bootstrap" and lock.base.reference.startswith("skupin-base/debian-bookworm-minbase:")
    assert lock.resolver.startswith("pip ")


def test_cpu_every_package_hashed_and_layers_disjoint(wheelhouse):
    lock, _ = _lock_cpu(wheelhouse)
    names = [p.name for layer in PY_LAYERS for p in lock.layers[layer]]
    assert len(names) == len(set(names))
    recorded = {canonicalize_name(i["metadata"]["name"]) for i in _cpu_reports(wheelhouse)[0]["install"]}
    assert set(names) == recorded
    for pkg in lock.packages().values():
        assert len(pkg.sha256) == 64 and pkg.filename.endswith(".whl")
        if pkg.source == "index":
            assert pkg.url and pkg.url.startswith("https://") and "#" not in pkg.url


def test_cpu_union_is_complete_for_the_target(wheelhouse):
    """Every requirement of every locked package (markers for Python 3.11) is met inside the lock."""
    lock, _ = _lock_cpu(wheelhouse)
    report = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in _cpu_reports(wheelhouse)[0]["install"]}
    env = target_environment(load_manifest(CPU))
    versions = {n: p.version for n, p in lock.packages().items()}
    for name in versions:
        for line in report[name].get("requires_dist", []):
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                dep = canonicalize_name(req.name)
                assert dep in versions, f"{name} needs {req}"
                assert req.specifier.contains(versions[dep], prereleases=True)


def test_cpu_pip_request_targets_the_image(wheelhouse):
    _, resolver = _lock_cpu(wheelhouse)
    (request,) = resolver.requests
    assert request.python == "3.11"
    assert "cp311" in request.abis
    assert "manylinux_2_28_x86_64" in request.platforms and "linux_x86_64" in request.platforms
    assert "manylinux_2_36_x86_64" in request.platforms  # Debian 12's glibc
    assert request.find_links == (str(wheelhouse),)
    assert "torch==2.13.0+cpu" in request.requirements
    assert "transformers[serving]==5.24.0" in request.requirements
    assert request.index_url == "https://pypi.org/simple"


def test_same_inputs_same_content_hash(wheelhouse):
    first, _ = _lock_cpu(wheelhouse)
    second, _ = _lock_cpu(wheelhouse)
    assert first.content_hash() == second.content_hash()
    changed = first.model_copy(update={"resolver": "uv 0.0.1"})
    assert changed.content_hash() != first.content_hash()
    assert first.dockerfile_sha256 is None and "dockerfile_sha256" not in first.model_dump(mode="json", exclude_none=True)
    legacy = first.model_copy(update={"dockerfile_sha256": "e" * 64})  # a lock made before 2026-12-01
    assert legacy.content_hash() != first.content_hash()  # its recorded hash stays its own


def test_canonical_json_bytes(wheelhouse):
    """The canonical form every content hash is made of: sorted keys, no whitespace, ASCII escapes."""
    assert canonical_json({"b": 1, "a": [1, "\u00e9"], "c": None}) == b'{"a":[1,"\\u00e9"],"b":1,"c":null}'
    lk, _ = _lock_cpu(wheelhouse)
    data = lk.model_dump(mode="json", exclude={"created": True, "omitted": True, "build": True,  # each only when set
                                                "dockerfile_sha256": True, "apt_sources": True, "apt_closure": True,
                                                "base": {"diff_id"}})
    assert lk.content_hash() == hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------- refusals


def _with(reports: list[dict], name: str, **changes) -> list[dict]:
    out = copy.deepcopy(reports)
    for item in out[0]["install"]:
        if canonicalize_name(item["metadata"]["name"]) == name:
            for key, value in changes.items():
                section, field = key.split("__")
                if value is None:
                    item[section].pop(field, None)
                else:
                    item[section][field] = value
    return out


def test_moved_pin_is_refused(wheelhouse):
    reports = _with(_cpu_reports(wheelhouse), "transformers", metadata__version="5.24.1")
    with pytest.raises(LockError) as err:
        _lock_cpu(wheelhouse, reports)
    assert any("stack.engine.version" in line and "5.24.1" in line for line in err.value.lines())


def test_local_label_matters(wheelhouse):
    """torch 2.13.0 is not torch 2.13.0+cpu: a resolver that drops the local label moved the pin."""
    reports = _with(_cpu_reports(wheelhouse), "torch", metadata__version="2.13.0")
    with pytest.raises(LockError, match="moved a pin"):
        _lock_cpu(wheelhouse, reports)


def test_missing_hash_is_refused(wheelhouse):
    reports = _with(_cpu_reports(wheelhouse), "sympy", download_info__archive_info=None)
    with pytest.raises(LockError, match="sympy .*no sha256"):
        _lock_cpu(wheelhouse, reports)


def test_sdist_is_refused(wheelhouse):
    reports = _cpu_reports(wheelhouse)
    url = next(i["download_info"]["url"] for i in reports[0]["install"] if i["metadata"]["name"] == "mpmath")
    reports = _with(reports, "mpmath", download_info__url=url.rsplit("/", 1)[0] + "/mpmath-1.3.0.tar.gz")
    with pytest.raises(LockError, match="sdists are not allowed"):
        _lock_cpu(wheelhouse, reports)


def test_incomplete_resolution_is_refused(wheelhouse):
    """A report that lacks a dependency the target needs is re-asked, and refused if pip still omits it."""
    reports = _cpu_reports(wheelhouse)
    reports[0]["install"] = [i for i in reports[0]["install"] if i["metadata"]["name"] != "mpmath"]
    with pytest.raises(LockError, match="mpmath"):
        _lock_cpu(wheelhouse, [reports[0]] * 5)


def test_git_source_cannot_be_locked_here():
    path = ROOT / "skus" / "amd-mi300x-vllm.yaml"
    resolver = Replay([])
    with pytest.raises(LockError) as err:
        lock_sku(manifest=load_manifest(path), manifest_path=path, wheelhouse=None,
                 resolve=resolver, reachable=lambda _url: True)
    lines = err.value.lines()
    assert any("stack.engine.source" in line and "git" in line and "skupin lock amd-mi300x-vllm" in line
               for line in lines)
    assert err.value.exit_code == 4 and resolver.requests == []


def test_unreachable_index_is_named():
    manifest = load_manifest(H200)
    rocm = manifest.stack.framework.model_copy(
        update={"source": manifest.stack.framework.source.model_copy(update={"url": "https://download.pytorch.org/whl/rocm7.2"})}
    )
    manifest = manifest.model_copy(update={"stack": manifest.stack.model_copy(update={"framework": rocm})})
    resolver = Replay([])
    with pytest.raises(LockError) as err:
        lock_sku(manifest=manifest, manifest_path=H200, wheelhouse=None,
                 resolve=resolver, reachable=lambda url: "pytorch.org" not in url)
    (line,) = err.value.lines()
    assert line.endswith(
        "nvidia-h200-vllm.yaml: stack.framework.source.url: index https://download.pytorch.org/whl/rocm7.2 "
        "is unreachable from this machine; fix: make the lock on a machine that reaches it "
        "(skupin lock nvidia-h200-vllm)"
    )
    assert resolver.requests == []


def test_wheelhouse_source_needs_a_wheelhouse():
    with pytest.raises(LockError) as err:
        lock_sku(manifest=load_manifest(CPU), manifest_path=CPU, wheelhouse=None,
                 resolve=Replay([]), reachable=lambda _url: True)
    (line,) = err.value.lines()
    assert "stack.framework.source" in line and "--wheelhouse" in line


# ---------------------------------------------------------------- Python 3.12 target on a 3.11 host, replayed


def test_target_markers_are_fed_back_to_pip():
    """pip on this 3.11 host skips `python_version > "3.11"` requirements; the lock asks again for the 3.12 image."""
    recorded = _recorded("nvidia-h200-vllm")
    resolver = Replay([r["report"] for r in recorded])
    lock = lock_sku(manifest=load_manifest(H200), manifest_path=H200, wheelhouse=None,
                    resolve=resolver, reachable=lambda _url: True)
    first, second = resolver.requests
    hints = set(second.requirements) - set(first.requirements)
    assert any(h.startswith("setuptools") and "<81" in h for h in hints)
    assert first.python == "3.12" and "cp312" in first.abis
    packages = lock.packages()
    assert packages["setuptools"].version.split(".")[0] < "81"
    assert packages["torch"].version == "2.13.0" and packages["vllm"].version == "0.32.0"
    assert packages["triton"].version == "3.7.1"
    # torch requires triton==3.7.1 itself, so the compiler pin lands with the framework.
    assert _layer_of(lock, "triton") == "framework" and _layer_of(lock, "vllm") == "engine"
    assert lock.base.kind == "image" and lock.base.digest and lock.base.digest.startswith("sha256:")


def test_closure_evaluates_markers_for_the_target_not_the_host():
    def pkg(name, version, *deps):
        return Resolved(name=name, version=version, filename=f"{name}-{version}-py3-none-any.whl",
                        sha256="0" * 64, url=None, source="index", requires_dist=deps)

    resolved = {
        "app": pkg("app", "1.0", 'old-backport>=1; python_version < "3.11"', 'new-thing; python_version >= "3.12"',
                   'extra-dep; extra == "serve"'),
        "old-backport": pkg("old-backport", "1.0"),
        "extra-dep": pkg("extra-dep", "2.0"),
    }
    env312 = {**target_environment(load_manifest(H200))}
    found = closure(resolved, ["app==1.0"], env312)
    assert found.needed == {"app"} and found.missing == ("new-thing",)
    found = closure(resolved, ["app[serve]==1.0"], {**env312, "python_version": "3.10", "python_full_version": "3.10.0"})
    assert found.needed == {"app", "old-backport", "extra-dep"} and not found.missing


def test_an_omitted_requirement_is_not_followed_and_is_reported():
    def pkg(name, version, *deps):
        return Resolved(name=name, version=version, filename=f"{name}-{version}-py3-none-any.whl",
                        sha256="0" * 64, url=None, source="index", requires_dist=deps)

    resolved = {"engine": pkg("engine", "1.0", "torchvision", "numpy"), "torchvision": pkg("torchvision", "0.28", "pillow"),
                "pillow": pkg("pillow", "12.0"), "numpy": pkg("numpy", "2.4")}
    env = target_environment(load_manifest(H200))
    assert closure(resolved, ["engine==1.0"], env).needed == {"engine", "torchvision", "pillow", "numpy"}
    found = closure(resolved, ["engine==1.0"], env, frozenset({"torchvision"}))
    assert found.needed == {"engine", "numpy"} and found.omitted == {"torchvision"} and not found.missing


def test_the_vllm_cpu_lock_records_what_it_leaves_out_and_why():
    """The committed lock of the vLLM CPU SKU: torchvision, torchaudio, torchcodec left out, each with its reason."""
    manifest = load_manifest(CPU.with_name("cpu-x86_64-vllm.yaml"))
    lock = read_lock(CPU.with_name("cpu-x86_64-vllm.lock.json"))
    assert set(lock.omitted) == {"torchvision", "torchaudio", "torchcodec"} == {o.name for o in manifest.stack.omit}
    assert not set(lock.omitted) & set(lock.packages())
    assert lock.packages()["vllm-cpu"].version == "0.32.0" and lock.packages()["torch"].version == "2.13.0+cpu"


def test_platform_tags_follow_the_base():
    cpu = load_manifest(CPU)
    tags = target_platforms(cpu)
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags and tags[-1] == "linux_x86_64"
    arm = cpu.model_copy(update={"base": cpu.base.model_copy(update={"platform": "linux/arm64", "os": "ubuntu-24.04"})})
    assert target_platforms(arm)[0] == "manylinux_2_39_aarch64" and target_environment(arm)["platform_machine"] == "aarch64"


# ---------------------------------------------------------------- pip isolation


def test_pip_is_isolated_from_this_machines_configuration(tmp_path):
    env = pip_environment({"PIP_FIND_LINKS": "/opt/wheels", "PIP_CONSTRAINT": "/etc/x", "pip_index_url": "x",
                           "PATH": "/usr/bin", "SSL_CERT_FILE": "/ca"})
    assert env == {"PATH": "/usr/bin", "SSL_CERT_FILE": "/ca", "PIP_CONFIG_FILE": "/dev/null", "PYTHONNOUSERSITE": "1"}
    request = PipRequest(layer="framework", requirements=("torch==2.13.0+cpu",), index_url="https://pypi.org/simple",
                         python="3.12", abis=("cp312",), platforms=("manylinux_2_28_x86_64",))
    cmd = pip_command(request, python="py", report=tmp_path / "r.json", reqs=tmp_path / "q.txt", cons=None,
                      ca_bundle=Path("/ca.crt"))
    for flag in ("--isolated", "--dry-run", "--ignore-installed", "--only-binary=:all:"):
        assert flag in cmd
    assert cmd[cmd.index("--cert") + 1] == "/ca.crt"
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "-c" not in cmd and "--find-links" not in cmd


# ---------------------------------------------------------------- lock_status


def test_lock_status(tmp_path, wheelhouse):
    manifest_path = tmp_path / "cpu-x86_64.yaml"
    manifest_path.write_text(CPU.read_text())
    manifest = load_manifest(manifest_path)
    state, why, _ = lock_status(manifest=manifest, manifest_path=manifest_path)
    assert state == "unlocked" and "skupin lock cpu-x86_64" in why

    lock, _ = _lock_cpu(wheelhouse)
    write_lock(lock, lock_path(manifest_path))
    assert read_lock(lock_path(manifest_path)) == lock
    state, why, _ = lock_status(manifest=manifest, manifest_path=manifest_path)  # its PEP 751 form is missing: a note
    assert state == "ok" and "no pylock.cpu-x86_64.toml" in why and "skupin.builder.catalog.pylock" in why
    write_pylock(lock, lock_path(manifest_path))
    assert lock_status(manifest=manifest, manifest_path=manifest_path)[0] == "ok"

    legacy = lock.model_copy(update={"dockerfile_sha256": "e" * 64})  # a template edit since: still the same set
    write_lock(legacy, lock_path(manifest_path))
    state, why, _ = lock_status(manifest=manifest, manifest_path=manifest_path)  # the pylock names the lock's hash
    assert state == "stale" and "pylock.cpu-x86_64.toml differs from the lock" in why
    write_pylock(legacy, lock_path(manifest_path))
    assert lock_status(manifest=manifest, manifest_path=manifest_path)[0] == "ok"
    assert read_lock(lock_path(manifest_path)).content_hash() == legacy.content_hash()
    write_lock(lock, lock_path(manifest_path))
    write_pylock(lock, lock_path(manifest_path))
    assert "dockerfile_sha256" not in lock_path(manifest_path).read_text()

    bumped = manifest.stack.engine.model_copy(update={"version": "5.25.0"})
    newer = manifest.model_copy(update={"stack": manifest.stack.model_copy(update={"engine": bumped})})
    state, why, _ = lock_status(manifest=newer, manifest_path=manifest_path)
    assert state == "stale" and "manifest changed" in why and "transformers==5.25.0" in why

    lock_path(manifest_path).write_text("{not json")
    assert lock_status(manifest=manifest, manifest_path=manifest_path)[0] == "stale"
    # `skupin check` reports a damaged lock as stale instead of failing on a second read
    from skupin.builder.check import check_file

    report = check_file(manifest_path)
    assert report.stack is not None and report.stack.lock_state == "stale" and report.stack.lock is None
    assert "run `skupin lock" in report.stack.lock_note


def test_pip_failures_are_explained(tmp_path):
    from skupin.builder.lock import _explain_failure, run_pip

    request = PipRequest(layer="engine", requirements=("foo==1.0",), index_url="https://pypi.org/simple",
                         python="3.12", abis=("cp312",), platforms=("manylinux_2_39_x86_64",))
    text = _explain_failure(request, "ERROR: Could not find a version\nERROR: No matching distribution found for foo==1.0\n")
    assert "no wheel of foo==1.0 for CPython 3.12" in text and "sdists are not allowed" in text
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ERROR: ResolutionImpossible: conflicting dependencies' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(LockError, match="cannot be installed together"):
        run_pip(request, python=str(fake))
