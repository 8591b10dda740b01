"""Pinning: the bootstrap recipe (signatures, hash), the bootstrapped base's identity, apt versions in the lock."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from skupin.builder.aptlock import (
    HostFacts,
    apt_script,
    check_closure,
    layer_closures,
    parse_policy,
    parse_simulation,
    pinned_system,
    resolve_candidates,
    simulation_steps,
    stale_version_hint,
)
from skupin.builder.base import check_locked_base, debootstrap_command, normalise_tree
from skupin.builder.build import _failure
from skupin.builder.catalog.lockfile import LockedBase, read_lock
from skupin.builder.catalog.manifest import Bootstrap, GitSource, load_manifest
from skupin.builder.lock import apt_note, lock_status, locked_base, relock_host, stale_reasons
from skupin.builder.render import apt_roots, render_manifest
from skupin.builder.reproducible import IMAGE_EPOCH
from skupin.common.errors import BuildError, LockError
from skupin.dockerd import RunResult

SKUS = Path(__file__).resolve().parents[2] / "skus"
LAYER = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


@pytest.mark.parametrize("change", [
    {"mirror": "http://snapshot.debian.org/archive/debian/20261201T000000Z"}, {"suite": "trixie"},
    {"variant": "buildd"}, {"keyring": "/etc/apt/trusted.gpg.d/other.gpg"}, {"include": ("ca-certificates",)},
])
def test_every_part_of_the_recipe_changes_its_hash_and_tag(change: dict) -> None:
    recipe = Bootstrap(suite="bookworm")
    other = recipe.model_copy(update=change)
    assert other.recipe_sha256() != recipe.recipe_sha256()
    assert other.local_tag() != recipe.local_tag()


def test_debootstrap_verifies_the_release_signature_with_the_recipes_keyring() -> None:
    recipe = Bootstrap(suite="bookworm", keyring="/srv/keys/debian.gpg", include=("ca-certificates", "gpgv"))
    cmd = debootstrap_command(recipe, tool="/usr/sbin/debootstrap", root=Path("/tmp/root"))
    assert "--force-check-gpg" in cmd and "--keyring=/srv/keys/debian.gpg" in cmd
    assert "--no-check-gpg" not in cmd
    assert cmd[-3:] == ["bookworm", "/tmp/root", "http://deb.debian.org/debian"]
    assert "--include=ca-certificates,gpgv" in cmd


def test_a_keyring_that_is_not_an_absolute_key_file_is_refused() -> None:
    with pytest.raises(ValueError):
        Bootstrap(suite="bookworm", keyring="keys/debian.gpg")


def test_normalising_a_tree_drops_what_records_the_time_or_host(tmp_path: Path) -> None:
    files = {"var/log/dpkg.log": "x", "var/log/apt/history.log": "x", "var/cache/debconf/config.dat-old": "x",
             "var/cache/debconf/config.dat": "keep", "var/lib/apt/lists/deb_Release": "x", "var/lib/apt/lists/lock": "",
             "var/lib/dpkg/status-old": "x", "var/lib/dpkg/status": "keep", "etc/hostname": "builder-7",
             "etc/resolv.conf": "nameserver 10.0.0.1", "var/cache/ldconfig/aux-cache": "x", "etc/passwd-": "x",
             "usr/bin/true": "keep"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    normalise_tree(tmp_path)
    left = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    assert left == {"var/cache/debconf/config.dat": "keep", "var/lib/apt/lists/lock": "", "var/lib/dpkg/status": "keep",
                    "etc/hostname": "", "etc/resolv.conf": "", "usr/bin/true": "keep"}
    assert (tmp_path / "var/log/apt").is_dir()  # folders stay: packages expect them


def test_a_build_refuses_a_bootstrapped_base_that_is_not_the_locked_one() -> None:
    locked = LockedBase(kind="bootstrap", reference="skupin-base/x:1", recipe_sha256="c" * 64, diff_id=LAYER)
    check_locked_base(locked=locked, layers=(LAYER,), sku="cpu")
    with pytest.raises(BuildError, match=f"lock names layer {LAYER}, this host's base has {OTHER}.*skupin lock cpu"):
        check_locked_base(locked=locked, layers=(OTHER,), sku="cpu")
    with pytest.raises(BuildError, match="records no identity of its bootstrapped base"):
        check_locked_base(locked=locked.model_copy(update={"diff_id": None}), layers=(LAYER,), sku="cpu")
    registry = LockedBase(kind="image", reference="x@sha256:" + "d" * 64, digest="sha256:" + "d" * 64)
    check_locked_base(locked=registry, layers=(OTHER, LAYER), sku="gpu")  # a registry base is named by its digest


def test_the_base_layer_and_apt_sources_do_not_change_an_older_locks_form_or_hash() -> None:
    lock = read_lock(SKUS / "nvidia-h200-vllm.lock.json")
    data = lock.json_data()
    assert "apt_sources" not in data and "diff_id" not in data["base"]
    newer = lock.model_copy(update={"apt_sources": ("deb http://deb.debian.org/debian bookworm main",),
                                    "base": lock.base.model_copy(update={"diff_id": LAYER})})
    assert newer.content_hash() != lock.content_hash()
    assert newer.json_data()["base"]["diff_id"] == LAYER


def test_the_locked_diff_id_is_not_part_of_what_makes_a_lock_stale() -> None:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")
    lock = read_lock(SKUS / "cpu-x86_64.lock.json")
    assert lock.base.identity() == locked_base(manifest)
    assert not stale_reasons(manifest=manifest, lock=lock.model_copy(update={
        "base": lock.base.model_copy(update={"diff_id": OTHER})}))


def test_the_pins_only_render_names_each_layers_apt_packages() -> None:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")
    roots = apt_roots(render_manifest(manifest=manifest).text)
    assert roots["python"] == ("ca-certificates", "python3.11", "python3.11-venv")
    compiler = manifest.stack.compiler.source
    assert roots["compiler"] == (f"g++-12={compiler.version}", "libc6-dev")  # type: ignore[union-attr]


def test_the_build_stage_has_its_own_apt_packages() -> None:
    roots = apt_roots(render_manifest(manifest=load_manifest(SKUS / "cpu-x86_64-llamacpp.yaml")).text)
    assert "cmake=3.25.1-1" in roots["build"] and "libc6-dev" in roots["build"]
    assert "cmake=3.25.1-1" not in roots.get("python", ())


POLICY = """python3.11:
  Installed: (none)
  Candidate: 3.11.2-6+deb12u6
  Version table:
     3.11.2-6+deb12u6 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
libc6-dev:amd64:
  Installed: (none)
  Candidate: 2.36-9+deb12u13
gone:
  Installed: (none)
  Candidate: (none)
"""


def test_apt_policy_gives_each_packages_candidate() -> None:
    assert parse_policy(POLICY) == {"python3.11": "3.11.2-6+deb12u6", "libc6-dev": "2.36-9+deb12u13", "gone": "(none)"}


def test_the_manifests_apt_version_wins_and_a_package_without_a_candidate_is_refused() -> None:
    candidates = parse_policy(POLICY) | {"g++-12": "12.2.0-14+deb12u9"}
    got = pinned_system({"compiler": ("g++-12=12.2.0-14+deb12u1", "libc6-dev")}, candidates, sku="cpu")
    assert got == {"compiler": ("g++-12=12.2.0-14+deb12u1", "libc6-dev=2.36-9+deb12u13")}
    with pytest.raises(LockError, match=r"no candidate for gone \(extras layer\), nothing \(extras layer\)"):
        pinned_system({"extras": ("gone", "nothing")}, candidates, sku="cpu")


def test_a_locked_render_installs_every_apt_package_at_the_locked_version() -> None:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")
    lock = read_lock(SKUS / "cpu-x86_64.lock.json")
    system = {"python": ("ca-certificates=1", "python3.11=2", "python3.11-venv=3"),
              "compiler": ("g++-12=12.2.0-14+deb12u1", "libc6-dev=4")}
    text = render_manifest(manifest=manifest, lock=lock.model_copy(update={"system": system, "apt_sources": ()})).text
    assert "--no-install-recommends ca-certificates=1 python3.11=2 python3.11-venv=3 \\\n" in text
    assert "--no-install-recommends g++-12=12.2.0-14+deb12u1 libc6-dev=4 \\\n" in text
    del system["python"]
    with pytest.raises(BuildError, match=r"no version of the apt package\(s\) ca-certificates \(python layer\), "
                                         r"python3.11 \(python layer\), python3.11-venv \(python layer\)"):
        render_manifest(manifest=manifest, lock=lock.model_copy(update={"system": system, "apt_sources": ()}))


def test_a_changed_apt_pin_makes_a_resolved_lock_stale() -> None:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")
    lock = read_lock(SKUS / "cpu-x86_64.lock.json")
    resolved = lock.model_copy(update={"apt_sources": (), "system": {
        "python": ("python3.11=2",), "compiler": ("g++-12=12.2.0-14+deb12u0", "libc6-dev=4")}})
    reasons = stale_reasons(manifest=manifest, lock=resolved)
    assert any("apt pins differ from the lock: g++-12=12.2.0-14+deb12u1 (compiler)" in r for r in reasons)


def _amd(commit: str | None):
    manifest = load_manifest(SKUS / "amd-mi300x-vllm.yaml")
    engine = manifest.stack.engine
    source = engine.source.model_copy(update={"commit": commit})
    return manifest.model_copy(update={"stack": manifest.stack.model_copy(update={
        "engine": engine.model_copy(update={"source": source})})})


def test_a_git_source_is_cloned_and_checked_against_its_commit_or_marked_unpinned() -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    text = render_manifest(manifest=_amd(commit)).text
    assert (" && git clone --depth 1 --branch v0.25.1 https://github.com/vllm-project/vllm /tmp/skupin-src \\\n"
            f' && {{ test "$(git -C /tmp/skupin-src rev-parse HEAD)" = {commit} || {{ echo '
            f'"https://github.com/vllm-project/vllm v0.25.1 is not commit {commit}" >&2; exit 1; }}; }} \\\n') in text
    assert "UNPINNED" not in text
    bare = render_manifest(manifest=_amd(None)).text
    assert "# UNPINNED: https://github.com/vllm-project/vllm at v0.25.1 names no commit" in bare
    assert "rev-parse" not in bare


def test_a_git_commit_must_be_forty_hex() -> None:
    with pytest.raises(ValueError):
        GitSource(kind="git", repo="https://github.com/vllm-project/vllm", ref="v0.25.1", commit="abc123")


def test_an_unlocked_layer_over_two_indexes_is_marked_unhashed() -> None:
    text = render_manifest(manifest=load_manifest(SKUS / "amd-mi300x-vllm.yaml")).text
    marks = [line for line in text.splitlines() if line.startswith("# UNHASHED:")]
    assert marks == [f"# UNHASHED: pip picks {layer} over 2 indexes without hashes (a name on either may win); only "
                     "a lock pins it" for layer in ("framework", "compiler")]
    cpu = render_manifest(manifest=load_manifest(SKUS / "cpu-x86_64.yaml"),
                          lock=read_lock(SKUS / "cpu-x86_64.lock.json")).text
    assert "UNHASHED" not in cpu and "UNPINNED" not in cpu


def test_the_oci_labels_come_from_the_lock_not_the_clock() -> None:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")
    lock = read_lock(SKUS / "cpu-x86_64.lock.json")
    text = render_manifest(manifest=manifest, lock=lock).text
    assert f'      org.opencontainers.image.created="{lock.created}" \\\n' in text
    assert f'      io.skupin.base-diff-id="{lock.base.diff_id}" \\\n' in text
    assert "org.opencontainers.image.base.digest" not in text  # a local import has no manifest digest
    later = render_manifest(manifest=manifest, lock=lock.model_copy(update={"created": "2027-01-01T00:00:00Z"})).text
    assert later != text and '"2027-01-01T00:00:00Z"' in later
    # the files' mtimes are one constant, not the lock's time: a step's output is a function of its own inputs, so a
    # RUN step that a newer lock leaves unchanged is the same step (BuildKit's cache) and the same layer
    steps = [line for line in text.splitlines() if "--mtime" in line]
    assert steps and steps == [line for line in later.splitlines() if "--mtime" in line]
    assert all(f"--mtime {IMAGE_EPOCH} " in line for line in steps)
    gpu = load_manifest(SKUS / "nvidia-h200-vllm.yaml")
    gpu_text = render_manifest(manifest=gpu, lock=read_lock(SKUS / "nvidia-h200-vllm.lock.json")).text
    assert f'org.opencontainers.image.base.digest="{gpu.base.image.rsplit("@", 1)[1]}"' in gpu_text  # type: ignore[union-attr]
    assert "revision" not in text and "org.opencontainers.image.source" not in text
    assert text.rstrip().splitlines()[-1].startswith('      io.skupin.dockerfile-sha256=')  # the labels come last


class _PolicyDocker:
    """The one adapter call resolve_candidates makes: run a container; its spec is kept."""

    def __init__(self, stdout: str, exit_code: int = 0) -> None:
        self.stdout, self.exit_code, self.specs = stdout, exit_code, []

    def run(self, spec, *, deadline_s=None) -> RunResult:
        self.specs.append(spec)
        return RunResult(exit_code=self.exit_code, stdout_bytes=self.stdout.encode(), stderr="E: no network",
                         timed_out=False, seconds=1.0)


def test_candidates_are_read_in_a_container_of_the_base_with_the_names_as_arguments() -> None:
    docker = _PolicyDocker("--- sources\ndeb http://deb.debian.org/debian bookworm main\n--- policy\n" + POLICY)
    sources, found, simulated = resolve_candidates(docker=docker, base="skupin-base/x:1",
                                                   names=("python3.11", "libc6-dev"))
    assert simulated == {}
    assert sources == ("deb http://deb.debian.org/debian bookworm main",)
    assert found["libc6-dev"] == "2.36-9+deb12u13"
    spec = docker.specs[0]
    assert spec.image == "skupin-base/x:1" and spec.command[-2:] == ("python3.11", "libc6-dev")
    assert spec.network == "bridge" and spec.deadline_s
    with pytest.raises(LockError, match="failed \\(exit 100\\): E: no network"):
        resolve_candidates(docker=_PolicyDocker("", exit_code=100), base="b", names=("x",))


# ---------------------------------------------------------------- the apt closure (issue 32)

SIMULATION = """NOTE: This is only a simulation!
Reading package lists...
The following NEW packages will be installed:
  libexpat1 python3.11
Inst libexpat1 (2.5.0-1+deb12u2 Debian:12.15/oldstable [amd64])
Inst libc6 [2.36-9+deb12u7] (2.36-9+deb12u14 Debian:12.15/oldstable [amd64])
Inst python3.11 (3.11.2-6+deb12u8 Debian:12.15/oldstable [amd64])
Conf libexpat1 (2.5.0-1+deb12u2 Debian:12.15/oldstable [amd64])
Conf python3.11 (3.11.2-6+deb12u8 Debian:12.15/oldstable [amd64])
"""


def test_a_simulated_install_gives_every_package_it_unpacks_at_its_new_version() -> None:
    assert parse_simulation(SIMULATION) == {"libexpat1": "2.5.0-1+deb12u2", "libc6": "2.36-9+deb12u14",
                                            "python3.11": "3.11.2-6+deb12u8"}


def test_the_image_layers_are_simulated_cumulatively_and_a_build_stage_alone() -> None:
    roots = {"build": ("g++-12=1", "cmake"), "python": ("python3.11", "ca-certificates"), "compiler": ("g++-12=1",),
             "extras": ("python3.11", "libnuma1")}
    assert simulation_steps(roots) == {
        "build": ("g++-12=1", "cmake"),
        "python": ("python3.11", "ca-certificates"),
        "compiler": ("python3.11", "ca-certificates", "g++-12=1"),
        "extras": ("python3.11", "ca-certificates", "g++-12=1", "libnuma1"),
    }
    script = apt_script(simulation_steps({"python": ("python3.11", "g++-12=1:12.2")}))
    assert script.endswith("; echo '--- simulate python'; apt-get install -s --no-install-recommends python3.11 "
                           "g++-12=1:12.2 2>&1 || echo '--- failed'")


def test_a_layers_closure_is_what_it_adds_over_the_layers_before_it() -> None:
    roots = {"build": ("gcc",), "python": ("python3.11",), "compiler": ("gcc",)}
    simulated = {
        "build": {"gcc": "12", "libc6": "2"},
        "python": {"python3.11": "3.11", "libc6": "1", "libssl3": "3"},
        "compiler": {"python3.11": "3.11", "libc6": "2", "libssl3": "3", "gcc": "12"},  # an upgrade of libc6
    }
    assert layer_closures(roots, simulated) == {
        "build": ("gcc=12", "libc6=2"),  # from the base, whatever the image's layers hold
        "python": ("libc6=1", "libssl3=3", "python3.11=3.11"),
        "compiler": ("gcc=12", "libc6=2"),
    }


def test_a_closure_that_takes_a_root_at_another_version_is_refused() -> None:
    system = {"python": ("python3.11=3.11.2-6+deb12u8",), "build": ("cmake=3.25.1-1",)}
    check_closure(system, {"python": ("python3.11=3.11.2-6+deb12u8", "libc6=2"), "build": ("cmake=3.25.1-1",)},
                  sku="cpu")
    with pytest.raises(LockError, match=r"python3.11 \(python layer: lock 3.11.2-6\+deb12u8, apt takes 3.11.2-6\+deb12u9\)"):
        check_closure(system, {"python": ("python3.11=3.11.2-6+deb12u9",)}, sku="cpu")


def test_candidates_and_closures_come_from_one_container() -> None:
    out = ("--- sources\ndeb http://deb.debian.org/debian bookworm main\n--- policy\n" + POLICY
           + "--- simulate python\n" + SIMULATION + "--- simulate compiler\n" + SIMULATION
           + "Inst g++-12 (12.2.0-14+deb12u1 Debian:12.15/oldstable [amd64])\n")
    steps = {"python": ("python3.11",), "compiler": ("python3.11", "g++-12")}
    _, found, simulated = resolve_candidates(docker=_PolicyDocker(out), base="b", names=("python3.11", "g++-12"),
                                             steps=steps)
    assert found["python3.11"] == "3.11.2-6+deb12u6"
    assert simulated["python"] == parse_simulation(SIMULATION)
    assert simulated["compiler"]["g++-12"] == "12.2.0-14+deb12u1"
    failed = ("--- policy\n" + POLICY + "--- simulate python\nReading package lists...\n"
              "E: Version '9' for 'python3.11' was not found\n--- failed\n")
    with pytest.raises(LockError, match="python layer's packages in b failed: E: Version '9' for 'python3.11' was not"):
        resolve_candidates(docker=_PolicyDocker(failed), base="b", names=("python3.11",), steps={"python": ("x",)})


def _closed(lock, closure):
    return lock.model_copy(update={"apt_closure": closure})


def test_a_locked_render_installs_the_whole_closure_at_its_versions() -> None:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")
    lock = read_lock(SKUS / "cpu-x86_64.lock.json")
    system = {"python": ("ca-certificates=1", "python3.11=2", "python3.11-venv=3"),
              "compiler": ("g++-12=12.2.0-14+deb12u1", "libc6-dev=4")}
    closure = {"python": ("ca-certificates=1", "libssl3=3.0", "openssl=3.0", "python3.11=2", "python3.11-venv=3"),
               "compiler": ("g++-12=12.2.0-14+deb12u1", "gcc-12=12.2.0-14+deb12u1", "libc6-dev=4")}
    base = lock.model_copy(update={"system": system, "apt_sources": ()})
    text = render_manifest(manifest=manifest, lock=_closed(base, closure)).text
    assert ("--no-install-recommends ca-certificates=1 python3.11=2 python3.11-venv=3 \\\n"
            "    libssl3=3.0 openssl=3.0 \\\n && rm -rf ") in text
    assert ("--no-install-recommends g++-12=12.2.0-14+deb12u1 libc6-dev=4 \\\n    gcc-12=12.2.0-14+deb12u1 \\\n"
            " && rm -rf ") in text
    # a lock without a closure (older, or --apt manifest) installs the named packages only, as before
    assert "libssl3" not in render_manifest(manifest=manifest, lock=_closed(base, None)).text
    # a long closure wraps on continuation lines, each package once
    many = {"python": tuple(f"lib{i:03d}-very-long-package-name=1.{i}" for i in range(40)), "compiler": ()}
    wrapped = render_manifest(manifest=manifest, lock=_closed(base, many)).text
    rows = [ln for ln in wrapped.splitlines() if ln.startswith("    lib")]
    assert len(rows) > 5 and all(len(row) <= 4 + 116 + 2 for row in rows)
    assert sum(row.count("-very-long-package-name=") for row in rows) == 40


def test_every_committed_closure_is_installed_by_its_locked_render() -> None:
    """Each committed lock of a base this machine runs carries a closure, and its render names every package of it."""
    for path in sorted(SKUS.glob("*.lock.json")):
        lock = read_lock(path)
        manifest = load_manifest(SKUS / path.name.replace(".lock.json", ".yaml"))
        if manifest.base.bootstrap is None:  # registry bases not reachable where the locks were made: no closure
            assert lock.apt_closure is None, path.name
            continue
        assert lock.apt_closure, path.name
        check_closure(lock.system, lock.apt_closure, sku=lock.sku)
        text = render_manifest(manifest=manifest, lock=lock).text
        for items in lock.apt_closure.values():
            for item in items:
                assert re.search(rf"[ ]{re.escape(item)}( |$)", text, re.M), (path.name, item)


def test_a_lock_without_a_closure_keeps_its_form_and_hash_and_says_what_floats(tmp_path: Path) -> None:
    lock = read_lock(SKUS / "nvidia-h200-vllm.lock.json")
    assert "apt_closure" not in lock.json_data()
    closed = _closed(lock, {"python": ("libssl3=3",)})
    assert closed.json_data()["apt_closure"] == {"python": ["libssl3=3"]}
    assert closed.content_hash() != lock.content_hash()
    state, note, _ = lock_status(manifest=load_manifest(SKUS / "nvidia-h200-vllm.yaml"),
                                 manifest_path=SKUS / "nvidia-h200-vllm.yaml")
    assert state == "ok" and "their dependencies not at all (an --apt manifest lock): no apt closure" in note
    assert "`skupin lock nvidia-h200-vllm --keep-python`" in note
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")
    cpu = read_lock(SKUS / "cpu-x86_64.lock.json")
    assert apt_note(manifest, cpu) == ""
    assert apt_note(manifest, _closed(cpu, None)).startswith("its apt packages' dependencies are not locked")


def _catalog(tmp_path: Path, sku: str) -> Path:
    for name in (f"{sku}.yaml", f"{sku}.lock.json", f"pylock.{sku}.toml"):
        (tmp_path / name).write_bytes((SKUS / name).read_bytes())
    return tmp_path / f"{sku}.yaml"


def test_keep_python_remakes_the_apt_part_and_keeps_every_python_package(tmp_path: Path) -> None:
    path = _catalog(tmp_path, "cpu-x86_64")
    manifest = load_manifest(path)
    old = read_lock(path.with_name("cpu-x86_64.lock.json"))
    system = {"python": ("ca-certificates=2", "python3.11=3.11.2-6+deb12u9", "python3.11-venv=3.11.2-6+deb12u9"),
              "compiler": ("g++-12=12.2.0-14+deb12u1", "libc6-dev=2.36-9+deb12u15")}
    host = HostFacts(diff_id=OTHER, apt_sources=("deb http://deb.debian.org/debian bookworm main",), system=system,
                     apt_closure={"python": ("libssl3=9",), "compiler": ()})
    new = relock_host(manifest=manifest, manifest_path=path, host=host)
    assert new.layers == old.layers and new.resolver == old.resolver
    assert new.system == system and new.apt_closure == host.apt_closure and new.base.diff_id == OTHER
    assert read_lock(path.with_name("cpu-x86_64.lock.json")) == new
    assert lock_status(manifest=manifest, manifest_path=path)[0] == "ok"  # its pylock was rewritten beside it
    moved = manifest.model_copy(update={"base": manifest.base.model_copy(update={"python": "3.12"})})
    with pytest.raises(LockError, match="stale for more than its apt part: the manifest changed since the lock; "
                                        "lock targets Python 3.11 .*; fix: skupin lock cpu-x86_64$"):
        relock_host(manifest=moved, manifest_path=path, host=host)


def test_a_version_the_archive_no_longer_serves_names_the_package_and_the_fix() -> None:
    log = ["Reading package lists...", "Package python3.11 is not available, but is referred to by another package.",
           "E: Version '3.11.2-6+deb12u8' for 'python3.11' was not found",
           "E: Version '3.0.20-1~deb12u2' for 'libssl3' was not found"]
    hint = stale_version_hint(log, sku="cpu-x86_64")
    assert "no longer serves python3.11=3.11.2-6+deb12u8, libssl3=3.0.20-1~deb12u2" in hint
    assert "`skupin lock cpu-x86_64 --keep-python`" in hint and "snapshot.debian.org/archive/debian/" in hint
    assert stale_version_hint(["E: Unable to locate package libfoo9"], sku="x").count("libfoo9") == 1
    assert stale_version_hint(["Setting up python3.11 ..."], sku="x") == ""


def test_a_build_that_apt_refuses_for_a_stale_version_says_so() -> None:
    manifest = load_manifest(SKUS / "cpu-x86_64.yaml")
    dockerfile = render_manifest(manifest=manifest, lock=read_lock(SKUS / "cpu-x86_64.lock.json")).text
    run = next(line for line in dockerfile.splitlines() if line.startswith("RUN apt-get update"))
    lines = [f"#5 [2/11] {run}", "#5 0.512 Reading package lists...",
             "#5 1.204 E: Version '3.11.2-6+deb12u8' for 'python3.11' was not found",
             "#5 ERROR: executor failed running [/bin/bash -o pipefail -c apt-get update]: exit code: 100"]
    err = _failure(BuildError("x"), lines=lines, dockerfile=dockerfile)
    assert "failed: step RUN apt-get update" in str(err)
    assert "no longer serves python3.11=3.11.2-6+deb12u8, which the lock of cpu-x86_64 pins" in str(err)
    unlocked = render_manifest(manifest=manifest).text
    assert "no longer serves" not in str(_failure(BuildError("x"), lines=lines, dockerfile=unlocked))
