"""Integration fixtures: a real Docker engine (skip with the reason when none answers) and cleanup."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skupin.common.errors import DockerError
from skupin.dockerd import DEFAULT_SOCKET, SESSION_LABEL, Docker, connect

REPO = Path(__file__).resolve().parents[2]
CPU_SKU = REPO / "skus" / "cpu-x86_64.yaml"
VLLM_SKU = REPO / "skus" / "cpu-x86_64-vllm.yaml"
BF16_SKU = REPO / "skus" / "cpu-x86_64-bf16.yaml"
VLLM_BF16_SKU = REPO / "skus" / "cpu-x86_64-vllm-bf16.yaml"
LLAMACPP_SKU = REPO / "skus" / "cpu-x86_64-llamacpp.yaml"
LLAMACPP_BF16_SKU = REPO / "skus" / "cpu-x86_64-llamacpp-bf16.yaml"
LLAMACPP_Q8_SKU = REPO / "docs" / "examples" / "skus" / "cpu-x86_64-llamacpp-q8_0.yaml"
HEAVY_ENV = "SKUPIN_HEAVY"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `heavy` (an accelerator SKU's image of many GB built here, or a long opt-in fault case) run only
    with SKUPIN_HEAVY=1: never in `.ci/run` or a plain `scripts/test`."""
    if os.environ.get(HEAVY_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"heavy (a many-GB image or a long fault case); set {HEAVY_ENV}=1 to run it")
    for item in items:
        if item.get_closest_marker("heavy") is not None:
            item.add_marker(skip)


def _locked(sku: Path):
    """The SKU manifest at `sku` checked and resolved against its committed lock (a stale lock fails the test)."""
    from skupin.builder.check import resolve

    return resolve(sku, require_lock=True)


@pytest.fixture(scope="session")
def docker() -> Iterator[Docker]:
    """The engine on /var/run/docker.sock; the session is skipped when none answers."""
    socket = Path(os.environ.get("SKUPIN_DOCKER_SOCKET", str(DEFAULT_SOCKET)))
    try:
        eng = connect(socket=socket)
    except DockerError as exc:
        why = f"no Docker daemon answers on {socket} (start one with `skupin docker up`): {exc}"
        if os.environ.get("SKUPIN_REQUIRE_ENGINE") == "1":  # CI: a missing engine is a failure, not a skip
            pytest.fail(why)
        pytest.skip(why)
    before = _image_tags(eng)
    yield eng
    # Only containers this session's Docker made: other people may use the same engine right now.
    leftover = eng.containers(label=f"{SESSION_LABEL}={eng.session}")
    for cid in leftover:  # should be none: every run removes its container
        subprocess.run([eng.cli(), "rm", "-f", cid], capture_output=True, check=False)
    # Image tags this session made that nothing after it can use: pushes and pulls through the loopback registries the
    # tests start (gone with them), and skupin/* images the tests built (the honest images, point-release replays).
    for tag in sorted(_image_tags(eng) - before):
        if tag.startswith(("127.0.0.1:", "skupin/")):
            subprocess.run([eng.cli(), "rmi", tag], capture_output=True, check=False)
    eng.close()
    assert not leftover, f"containers left behind by the tests: {sorted(leftover)}"


def _image_tags(eng: Docker) -> set[str]:
    """Every reference the engine holds an image under: repository:tag, or repository@digest for an image pulled by
    digest (none for a dangling image)."""
    listed = subprocess.run([eng.cli(), "image", "ls", "--digests", "--format",
                             "{{.Repository}} {{.Tag}} {{.Digest}}"], capture_output=True, text=True, check=False)
    refs = set()
    for line in listed.stdout.splitlines():
        repo, tag, digest = (line.split() + ["<none>"] * 3)[:3]
        if repo != "<none>" and tag != "<none>":
            refs.add(f"{repo}:{tag}")
        elif repo != "<none>" and digest != "<none>":
            refs.add(f"{repo}@{digest}")
    return refs


@pytest.fixture
def tags_to_remove(docker: Docker) -> Iterator[list[str]]:
    """Image tags a test creates; removed afterwards whatever happens."""
    tags: list[str] = []
    yield tags
    for tag in tags:
        docker.remove_image(tag, force=True)


@pytest.fixture(scope="session")
def wheelhouse() -> Path | None:
    path = Path(os.environ.get("SKUPIN_WHEELHOUSE", "/opt/wheels"))
    return path if path.is_dir() else None


@pytest.fixture(scope="session")
def host_ca_bundle() -> Path | None:
    """The CA bundle this host's pip trusts (TLS to PyPI may be intercepted here)."""
    for key in ("SKUPIN_CA_BUNDLE", "PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if os.environ.get(key) and Path(os.environ[key]).is_file():
            return Path(os.environ[key])
    default = Path("/etc/ssl/certs/ca-certificates.crt")
    return default if default.is_file() else None


@pytest.fixture(scope="session")
def stack():
    """The CPU SKU checked and locked (its committed lock)."""
    return _locked(CPU_SKU)


def built_image(docker: Docker, stack, wheelhouse, ca_bundle) -> str:
    """A SKU's image: the one `skupin build` recorded when it still exists for the same lock, else built now (also
    bench/bf16_faults.py's)."""
    import json

    from skupin.common.paths import state_dir

    record = state_dir() / "builds" / f"{stack.manifest.name}.json"
    if record.is_file():
        data = json.loads(record.read_text())
        from skupin.builder.sourcebuild import read_built

        # an engine built from its sdist also needs this host's record of the wheel it built (for `pins`)
        built = not stack.lock.sources() or read_built(stack.lock) is not None
        if data.get("lock_sha256") == stack.lock.content_hash() and docker.image_exists(data["image_id"]) and built:
            return data["image_id"]
    from skupin.builder.build import build
    from skupin.builder.render import render

    built = build(render(stack), docker, wheelhouse=wheelhouse, ca_bundle=ca_bundle)
    return built.image_id


@pytest.fixture(scope="session")
def honest_image(docker: Docker, stack, wheelhouse, host_ca_bundle) -> str:
    """The CPU SKU's image: the one `skupin build cpu-x86_64` recorded when it still exists, else built now (once)."""
    return built_image(docker, stack, wheelhouse, host_ca_bundle)


@pytest.fixture(scope="session")
def bf16_stack():
    """The CPU SKU served in bfloat16 (cpu-x86_64's stack) checked and locked (its committed lock)."""
    return _locked(BF16_SKU)


@pytest.fixture(scope="session")
def bf16_image(docker: Docker, bf16_stack, wheelhouse, host_ca_bundle) -> str:
    """The bf16 CPU SKU's image (recorded by `skupin build cpu-x86_64-bf16`, else built now, once; its layers are
    cpu-x86_64's but for the lock's timestamps and the serving dtype)."""
    return built_image(docker, bf16_stack, wheelhouse, host_ca_bundle)


@pytest.fixture(scope="session")
def vllm_stack():
    """The vLLM CPU SKU checked and locked (its committed lock)."""
    return _locked(VLLM_SKU)


@pytest.fixture(scope="session")
def vllm_image(docker: Docker, vllm_stack, wheelhouse, host_ca_bundle) -> str:
    """The vLLM CPU SKU's image (recorded by `skupin build cpu-x86_64-vllm`, else built now, once)."""
    return built_image(docker, vllm_stack, wheelhouse, host_ca_bundle)


@pytest.fixture(scope="session")
def vllm_bf16_stack():
    """The vLLM CPU SKU served in bfloat16 (cpu-x86_64-vllm's stack) checked and locked (its committed lock)."""
    return _locked(VLLM_BF16_SKU)


@pytest.fixture(scope="session")
def vllm_bf16_image(docker: Docker, vllm_bf16_stack, wheelhouse, host_ca_bundle) -> str:
    """Its image (recorded by `skupin build cpu-x86_64-vllm-bf16`, else built now, once: its RUN steps are
    cpu-x86_64-vllm's, so BuildKit's cache of that image serves them)."""
    return built_image(docker, vllm_bf16_stack, wheelhouse, host_ca_bundle)


@pytest.fixture(scope="session")
def llamacpp_stack():
    """The llama.cpp CPU SKU (its engine built from the sdist) checked and locked (its committed lock)."""
    return _locked(LLAMACPP_SKU)


@pytest.fixture(scope="session")
def llamacpp_image(docker: Docker, llamacpp_stack, wheelhouse, host_ca_bundle) -> str:
    """The llama.cpp CPU SKU's image (recorded by `skupin build cpu-x86_64-llamacpp`, else built now, once: on a cold
    2-core machine that compiles llama.cpp, several minutes)."""
    return built_image(docker, llamacpp_stack, wheelhouse, host_ca_bundle)


@pytest.fixture(scope="session")
def llamacpp_bf16_stack():
    """The llama.cpp SKU serving a BF16 GGUF of the MoE fixture, checked and locked (its committed lock)."""
    return _locked(LLAMACPP_BF16_SKU)


@pytest.fixture(scope="session")
def llamacpp_bf16_image(docker: Docker, llamacpp_bf16_stack, llamacpp_image, wheelhouse, host_ca_bundle) -> str:
    """Its image: the llama.cpp image's layers and build stage (cached) with another CMD."""
    return built_image(docker, llamacpp_bf16_stack, wheelhouse, host_ca_bundle)


@pytest.fixture(scope="session")
def llamacpp_q8_stack():
    """The example SKU that serves a Q8_0 GGUF of the fixture with the same llama.cpp image otherwise."""
    return _locked(LLAMACPP_Q8_SKU)


@pytest.fixture(scope="session")
def llamacpp_q8_image(docker: Docker, llamacpp_q8_stack, llamacpp_image, wheelhouse, host_ca_bundle) -> str:
    """Its image: the llama.cpp image's layers and build stage (cached) with another CMD."""
    return built_image(docker, llamacpp_q8_stack, wheelhouse, host_ca_bundle)


@contextlib.contextmanager
def derived_images(docker: Docker, *, honest_image: str, context: Path, base_tag: str) -> Iterator:
    """build(mode) -> id of the honest image with one thing changed by context/Dockerfile's MODE (once per mode).

    The honest image gets `base_tag` for the derived builds (BuildKit resolves FROM by name, not by
    image id); every derived image and that tag are removed afterwards.
    """
    made: dict[str, str] = {}
    docker.tag(honest_image, base_tag)

    def build(mode: str, **args: str) -> str:
        key = mode + repr(sorted(args.items()))
        if key not in made:
            made[key] = docker.build(context=context, dockerfile=context / "Dockerfile",
                                     build_args={"BASE": base_tag, "MODE": mode, **args})
        return made[key]

    try:
        yield build
    finally:
        for image_id in made.values():
            docker.remove_image(image_id, force=True)
        docker.remove_image(base_tag)


@dataclass(frozen=True)
class Swapped:
    """A locked swap: the image, the test lock that names its swap wheel, and the folder holding that wheel."""

    image: str
    lock: object
    wheelhouse: Path

    def stack(self, stack):
        return stack.model_copy(update={"lock": self.lock})


class Derived:
    """Tampered images FROM the honest one (tests/integration/tampered.py): `tamper(mode)` for changes outside
    the lock, `swap(mode)` for a locked test wheel that changes the numbers. Each is built once per session."""

    def __init__(self, build, *, lock, workdir: Path) -> None:
        self._build, self.lock, self.workdir = build, lock, workdir
        self._made: dict[str, str] = {}
        self._swaps: dict[str, Swapped] = {}
        self.records: list[Path] = []  # built-wheel records written for test locks (removed with the images)

    def tamper(self, mode: str) -> str:
        from tests.integration import tampered

        if mode not in self._made:
            wheels, reqs = [], ""
            if mode == "extra":
                wheel = tampered.make_wheel(self.workdir, name="skupin-test-extra", version="1.0",
                                            files={"skupin_test_extra.py": b"VALUE = 1\n"})
                pkg = tampered.wheel_package(wheel, name="skupin-test-extra", version="1.0")
                wheels, reqs = [wheel], tampered.requirement(pkg)
            context = tampered.write_context(self.workdir / f"tamper-{mode}", wheels=wheels, requirements=reqs)
            label = "0" * 64 if mode == "label" else self.lock.content_hash()
            self._made[mode] = self._build(context, mode, label, config="path" if mode == "path" else "unchanged")
        return self._made[mode]

    def swap(self, mode: str) -> Swapped:
        from tests.integration import tampered

        if mode not in self._swaps:
            house = self.workdir / f"swap-{mode}"
            house.mkdir(parents=True, exist_ok=True)
            wheel = tampered.swap_wheel(house, mode)
            pkg = tampered.wheel_package(wheel, name=tampered.SWAP_DIST, version=wheel.name.split("-")[1])
            lock = tampered.lock_with(self.lock, pkg)
            context = tampered.write_context(self.workdir / f"swap-context-{mode}", wheels=[wheel],
                                             requirements=tampered.requirement(pkg))
            self._record_built(lock)
            self._swaps[mode] = Swapped(image=self._build(context, "locked", lock.content_hash()), lock=lock,
                                        wheelhouse=house)
        return self._swaps[mode]

    def _record_built(self, lock) -> None:
        """An engine built from its sdist (llama.cpp): `pins` verifies its files against this host's record of the
        wheel built for the lock; the derived image carries the honest image's build, so the test lock gets the
        honest lock's record."""
        from skupin.builder.sourcebuild import read_built, write_built

        if not self.lock.sources():
            return
        record = read_built(self.lock)
        if record is not None:
            self.records.append(write_built(record.model_copy(update={"lock_sha256": lock.content_hash()})))


@contextlib.contextmanager
def tampered_images(docker: Docker, *, image: str, lock, workdir: Path, base_tag: str) -> Iterator[Derived]:
    """Tampered images of `image` (removed at the end; also bench/bf16_faults.py's)."""
    made: list[str] = []
    docker.tag(image, base_tag)

    def build(context: Path, mode: str, label: str, config: str = "unchanged") -> str:
        image_id = docker.build(context=context, dockerfile=context / "Dockerfile",
                                build_args={"BASE": base_tag, "MODE": mode, "LOCK_LABEL": label, "CONFIG": config})
        made.append(image_id)
        return image_id

    derived = Derived(build, lock=lock, workdir=workdir)
    try:
        yield derived
    finally:
        for image_id in made:
            docker.remove_image(image_id, force=True)
        docker.remove_image(base_tag)
        for record in derived.records:
            record.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def derived(docker: Docker, honest_image: str, stack, tmp_path_factory) -> Iterator[Derived]:
    """Tampered images of the honest CPU image for the whole session (removed at the end)."""
    with tampered_images(docker, image=honest_image, lock=stack.lock, workdir=tmp_path_factory.mktemp("derived"),
                  base_tag="skupin-test/derived-honest-base:latest") as made:
        yield made


@pytest.fixture(scope="session")
def vllm_bf16_derived(docker: Docker, vllm_bf16_image: str, vllm_bf16_stack, tmp_path_factory) -> Iterator[Derived]:
    """Tampered images of the honest vLLM bf16 CPU image for the whole session (removed at the end)."""
    with tampered_images(docker, image=vllm_bf16_image, lock=vllm_bf16_stack.lock,
                         workdir=tmp_path_factory.mktemp("vllm-bf16-derived"),
                         base_tag="skupin-test/derived-vllm-bf16-base:latest") as made:
        yield made


@pytest.fixture(scope="session")
def llamacpp_bf16_derived(docker: Docker, llamacpp_bf16_image: str, llamacpp_bf16_stack,
                          tmp_path_factory) -> Iterator[Derived]:
    """Tampered images of the honest llama.cpp bf16 image for the whole session (removed at the end)."""
    with tampered_images(docker, image=llamacpp_bf16_image, lock=llamacpp_bf16_stack.lock,
                         workdir=tmp_path_factory.mktemp("llamacpp-bf16-derived"),
                         base_tag="skupin-test/derived-llamacpp-bf16-base:latest") as made:
        yield made


@pytest.fixture(scope="session")
def bf16_derived(docker: Docker, bf16_image: str, bf16_stack, tmp_path_factory) -> Iterator[Derived]:
    """Tampered images of the honest bf16 CPU image for the whole session (removed at the end)."""
    with tampered_images(docker, image=bf16_image, lock=bf16_stack.lock, workdir=tmp_path_factory.mktemp("bf16-derived"),
                  base_tag="skupin-test/derived-bf16-base:latest") as made:
        yield made


@pytest.fixture(scope="session")
def vllm_derived(docker: Docker, vllm_image: str, vllm_stack, tmp_path_factory) -> Iterator[Derived]:
    """Tampered images of the honest vLLM CPU image for the whole session (removed at the end)."""
    with tampered_images(docker, image=vllm_image, lock=vllm_stack.lock, workdir=tmp_path_factory.mktemp("vllm-derived"),
                  base_tag="skupin-test/derived-vllm-base:latest") as made:
        yield made
