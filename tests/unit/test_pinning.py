"""Pinning: the bootstrap recipe (signatures, hash), the bootstrapped base's identity, apt versions in the lock."""

from __future__ import annotations

from pathlib import Path

import pytest

from skupin.builder.aptlock import parse_policy, pinned_system, resolve_candidates
from skupin.builder.base import check_locked_base, debootstrap_command, normalise_tree
from skupin.builder.catalog.lockfile import LockedBase, read_lock
from skupin.builder.catalog.manifest import Bootstrap, GitSource, load_manifest
from skupin.builder.lock import locked_base, stale_reasons
from skupin.builder.render import apt_roots, render_manifest
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
    assert later != text and "--mtime 1798761600 " in later
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
    sources, found = resolve_candidates(docker=docker, base="skupin-base/x:1", names=("python3.11", "libc6-dev"))
    assert sources == ("deb http://deb.debian.org/debian bookworm main",)
    assert found["libc6-dev"] == "2.36-9+deb12u13"
    spec = docker.specs[0]
    assert spec.image == "skupin-base/x:1" and spec.command[-2:] == ("python3.11", "libc6-dev")
    assert spec.network == "bridge" and spec.deadline_s
    with pytest.raises(LockError, match="failed \\(exit 100\\): E: no network"):
        resolve_candidates(docker=_PolicyDocker("", exit_code=100), base="b", names=("x",))
