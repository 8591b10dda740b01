"""Integration fixtures: a real Docker engine (skip with the reason when none answers) and cleanup."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.engine import DEFAULT_SOCKET, SESSION_LABEL, Engine, EngineError, connect

REPO = Path(__file__).resolve().parents[2]
CPU_SKU = REPO / "skus" / "cpu-x86_64.yaml"


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """The engine on /var/run/docker.sock; the session is skipped when none answers."""
    socket = Path(os.environ.get("SKUPIN_DOCKER_SOCKET", str(DEFAULT_SOCKET)))
    try:
        eng = connect(socket=socket)
    except EngineError as exc:
        why = f"no Docker engine answers on {socket} (start one with `skupin engine up`): {exc}"
        if os.environ.get("SKUPIN_REQUIRE_ENGINE") == "1":  # CI: a missing engine is a failure, not a skip
            pytest.fail(why)
        pytest.skip(why)
    yield eng
    # Only containers this session's Engine made: other people may use the same engine right now.
    leftover = eng.containers(label=f"{SESSION_LABEL}={eng.session}")
    for cid in leftover:  # should be none: every run removes its container
        subprocess.run([eng.cli(), "rm", "-f", cid], capture_output=True, check=False)
    eng.close()
    assert not leftover, f"containers left behind by the tests: {sorted(leftover)}"


@pytest.fixture
def tags_to_remove(engine: Engine) -> Iterator[list[str]]:
    """Image tags a test creates; removed afterwards whatever happens."""
    tags: list[str] = []
    yield tags
    for tag in tags:
        engine.remove_image(tag, force=True)


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
    from builder.check import resolve

    return resolve(CPU_SKU, require_lock=True)


@pytest.fixture(scope="session")
def honest_image(engine: Engine, stack, wheelhouse, host_ca_bundle) -> str:
    """The CPU SKU's image: the one `skupin build cpu-x86_64` recorded when it still exists, else built now (once)."""
    import json

    from builder.paths import STATE

    record = Path(STATE) / "builds" / "cpu-x86_64.json"
    if record.is_file():
        data = json.loads(record.read_text())
        if data.get("lock_sha256") == stack.lock.content_hash() and engine.image_exists(data["image_id"]):
            return data["image_id"]
    from builder.build import build_image

    built = build_image(manifest=stack.manifest, manifest_path=CPU_SKU, lock=stack.lock, engine=engine,
                        wheelhouse=wheelhouse, ca_bundle=host_ca_bundle)
    return built.image_id


@contextlib.contextmanager
def derived_images(engine: Engine, *, honest_image: str, context: Path, base_tag: str) -> Iterator:
    """build(mode) -> id of the honest image with one thing changed by context/Dockerfile's MODE (once per mode).

    The honest image gets `base_tag` for the derived builds (BuildKit resolves FROM by name, not by
    image id); every derived image and that tag are removed afterwards.
    """
    made: dict[str, str] = {}
    engine.tag(honest_image, base_tag)

    def build(mode: str) -> str:
        if mode not in made:
            made[mode] = engine.build(context=context, dockerfile=context / "Dockerfile",
                                      build_args={"BASE": base_tag, "MODE": mode})
        return made[mode]

    try:
        yield build
    finally:
        for image_id in made.values():
            engine.remove_image(image_id, force=True)
        engine.remove_image(base_tag)
