"""Real image builds of the CPU SKU: labels, image == lock, build CA not kept, failures, Ctrl-C."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from skupin.builder.build import BuiltImage, build
from skupin.builder.catalog.lockfile import Lock, image_tag, lock_path, read_lock, write_lock
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.check import resolve
from skupin.builder.render import render, render_manifest
from skupin.builder.reproducible import IMAGE_EPOCH, normalise_image
from skupin.builder.wheels import store_path, wheel_store
from skupin.common.errors import BuildError
from skupin.dockerd import ContainerSpec, Docker

from .conftest import CPU_SKU

pytestmark = pytest.mark.integration

CA_ENV_KEYS = ("PIP_CERT", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO",
               "NODE_EXTRA_CA_CERTS", "PIP_CLIENT_CERT")


@pytest.fixture(scope="module")
def sku_dir(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path | None, host_ca_bundle: Path | None) -> Path:
    """A folder with the CPU manifest and its lock (the committed one, else one made now)."""
    folder = tmp_path_factory.mktemp("sku")
    shutil.copy(CPU_SKU, folder / CPU_SKU.name)
    committed = lock_path(CPU_SKU)
    if committed.is_file():
        shutil.copy(committed, lock_path(folder / CPU_SKU.name))
    else:
        from skupin.builder.lock import lock_sku

        manifest = load_manifest(folder / CPU_SKU.name)
        lock = lock_sku(manifest=manifest, manifest_path=folder / CPU_SKU.name, wheelhouse=wheelhouse,
                        ca_bundle=host_ca_bundle)
        write_lock(lock, lock_path(folder / CPU_SKU.name))
    return folder


@pytest.fixture(scope="module")
def marker_ca(tmp_path_factory: pytest.TempPathFactory, host_ca_bundle: Path | None) -> tuple[Path, str]:
    """The host's CA bundle plus a fresh throw-away CA; returns (bundle, one base64 line of that CA)."""
    if host_ca_bundle is None:
        pytest.skip("no host CA bundle to build with")
    folder = tmp_path_factory.mktemp("ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(folder / "k.pem"), "-out", str(folder / "c.pem"),
                    "-subj", f"/CN=skupin-build-ca-{uuid.uuid4().hex[:8]}"], check=True, capture_output=True)
    cert = (folder / "c.pem").read_text()
    bundle = folder / "bundle.pem"
    bundle.write_text(host_ca_bundle.read_text() + "\n" + cert)
    body = [line for line in cert.splitlines() if line and not line.startswith("-----")]
    return bundle, body[len(body) // 2]


@pytest.fixture(scope="module")
def built(docker: Docker, sku_dir: Path, wheelhouse: Path | None, marker_ca: tuple[Path, str],
          tmp_path_factory: pytest.TempPathFactory) -> BuiltImage:
    """The CPU SKU built cold (no cache) from an empty wheel store, so every wheel really was
    downloaded trusting the marker CA."""
    path = sku_dir / CPU_SKU.name
    lines: list[str] = []
    result = build(render(resolve(path)), docker, wheelhouse=wheelhouse, ca_bundle=marker_ca[0], progress="plain",
                   on_line=lines.append, no_cache=True, records=tmp_path_factory.mktemp("records"),
                   wheel_store=tmp_path_factory.mktemp("wheels"))
    assert any("DONE" in line for line in lines)
    assert any(line.startswith("fetched transformers-") for line in lines)
    return result


def _python(docker: Docker, image: str, code: str) -> str:
    res = docker.run(ContainerSpec(image=image, entrypoint=("python", "-c", code), mem_limit="1g"), deadline_s=120)
    assert res.exit_code == 0, res.stderr
    return res.stdout


def test_labels_name_sku_pins_lock_and_dockerfile(docker: Docker, built: BuiltImage, sku_dir: Path) -> None:
    manifest = load_manifest(sku_dir / CPU_SKU.name)
    lock = read_lock(lock_path(sku_dir / CPU_SKU.name))
    labels = docker.inspect_image(built.image).labels
    assert labels["io.skupin.sku"] == manifest.name
    for role, pin in manifest.stack.pins().items():
        assert labels[f"io.skupin.{role}"] == f"{pin.name}=={pin.version}"
    assert labels["io.skupin.lock-sha256"] == lock.content_hash()
    assert labels["io.skupin.dockerfile-sha256"] == built.dockerfile_sha256
    assert labels["org.opencontainers.image.version"] == manifest.stack.engine.version
    assert built.image == image_tag(sku=manifest.name, engine_version=manifest.stack.engine.version, lock=lock,
                                    dockerfile_sha256=built.dockerfile_sha256)


def test_image_distributions_equal_the_lock(docker: Docker, built: BuiltImage, sku_dir: Path) -> None:
    lock = read_lock(lock_path(sku_dir / CPU_SKU.name))
    out = _python(docker, built.image, "import importlib.metadata as m, json, sys; json.dump("
                  "[[d.metadata['Name'], d.version] for d in m.distributions()], sys.stdout)")
    norm = lambda n: n.lower().replace("_", "-").replace(".", "-")  # noqa: E731
    listed = {norm(name): version for name, version in json.loads(out)}
    locked = {norm(n): p.version for n, p in lock.packages().items()}
    # exactly the lock: a locked image's venv is made without pip, so nothing else is installed
    assert listed == locked
    assert listed["torch"] == lock.packages()["torch"].version
    pip = _python(docker, built.image, "import importlib.util; print(importlib.util.find_spec('pip') is None)")
    assert pip.strip() == "True"


def test_final_image_does_not_trust_the_build_ca(docker: Docker, built: BuiltImage, marker_ca: tuple[Path, str]) -> None:
    env = dict(
        e.split("=", 1)
        for e in _python(
            docker, built.image, "import os; print('\\n'.join(f'{k}={v}' for k, v in os.environ.items()))"
        ).splitlines()
        if "=" in e
    )
    assert not set(CA_ENV_KEYS) & set(env), env
    code = (
        "import os, sys\n"
        f"needle = {marker_ca[1]!r}\n"
        "hits, seen = [], 0\n"
        "for top in ('/etc/ssl', '/usr/share/ca-certificates', '/usr/local/share/ca-certificates', '/opt/skupin',\n"
        "            '/run/secrets', '/root'):\n"
        "    for d, _, files in os.walk(top):\n"
        "        for f in files:\n"
        "            p = os.path.join(d, f)\n"
        "            if top.startswith('/opt') and not f.endswith(('.pem', '.crt', '.cer')):\n"
        "                continue\n"
        "            try:\n"
        "                text = open(p, errors='replace').read()\n"
        "            except OSError:\n"
        "                continue\n"
        "            seen += 1\n"
        "            if needle in text: hits.append(p)\n"
        "print(seen, hits, os.path.exists('/run/secrets/skupin_ca'))\n"
    )
    out = _python(docker, built.image, code).strip()
    assert out.endswith("[] False"), out
    assert int(out.split()[0]) > 100  # it really looked at the trust store (Debian's bundle is ~140 certs)


def test_build_record_and_layers(docker: Docker, built: BuiltImage) -> None:
    names = [layer.name for layer in built.layers]
    for layer in ("python", "framework", "compiler", "engine"):
        assert layer in names, names
    assert not any(layer.cached for layer in built.layers if layer.name in ("python", "framework", "engine"))
    assert built.total_s > 0 and built.installed["torch"] == "2.13.0+cpu"
    out = _python(docker, built.image, "import torch, transformers; print(torch.__version__, transformers.__version__)")
    assert out.split() == ["2.13.0+cpu", built.labels["org.opencontainers.image.version"]]


def test_rebuild_is_all_cache_and_same_image(docker: Docker, built: BuiltImage, sku_dir: Path, wheelhouse: Path | None,
                                             host_ca_bundle: Path | None, tmp_path: Path) -> None:
    path = sku_dir / CPU_SKU.name
    again = build(render(resolve(path)), docker, wheelhouse=wheelhouse, ca_bundle=host_ca_bundle, records=tmp_path)
    assert again.image_id == built.image_id
    assert all(layer.cached for layer in again.layers if layer.name in ("python", "framework", "compiler", "engine"))
    record = json.loads((tmp_path / f"{again.sku}.json").read_text())
    assert record["image"] == built.image and record["image_id"] == built.image_id


def _broken_engine_wheel(lock: Lock, house: Path) -> Lock:
    """A lock whose engine wheel is a file the host can hash and gather but that is no wheel: only
    the build step that installs it can find out."""
    tf = next(p for p in lock.layers["engine"] if p.name == "transformers")
    (house / tf.filename).write_bytes(b"this is not a zip archive")
    sha = hashlib.sha256(b"this is not a zip archive").hexdigest()
    broken = tf.model_copy(update={"sha256": sha, "source": "wheelhouse", "url": None})
    engine_layer = tuple(broken if p is tf else p for p in lock.layers["engine"])
    return lock.model_copy(update={"layers": {**lock.layers, "engine": engine_layer}})


def test_failing_step_names_layer_exit_code_5_and_no_tag(docker: Docker, built: BuiltImage, sku_dir: Path,
                                                          wheelhouse: Path | None, host_ca_bundle: Path | None,
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          tags_to_remove: list[str]) -> None:
    from skupin.cli import main

    house = tmp_path / "house"
    house.mkdir()
    for wheel in (wheelhouse.glob("*.whl") if wheelhouse else ()):
        (house / wheel.name).hardlink_to(wheel)
    shutil.copy(sku_dir / CPU_SKU.name, tmp_path / CPU_SKU.name)
    bad = _broken_engine_wheel(read_lock(lock_path(sku_dir / CPU_SKU.name)), house)
    write_lock(bad, lock_path(tmp_path / CPU_SKU.name))
    manifest = load_manifest(tmp_path / CPU_SKU.name)
    tag = image_tag(sku=manifest.name, engine_version=manifest.stack.engine.version, lock=bad,
                    dockerfile_sha256=render_manifest(manifest=manifest, lock=bad).sha256)
    tags_to_remove.append(tag)
    with pytest.raises(BuildError) as err:
        build(render(resolve(tmp_path / CPU_SKU.name)), docker, wheelhouse=house, ca_bundle=host_ca_bundle,
              wheel_store=tmp_path / "store")
    assert "layer 'engine' failed" in str(err.value)
    # the tail of the step's log says why
    assert "transformers-5.24.0-py3-none-any.whl: cannot install: BadZipFile" in str(err.value)
    assert not docker.image_exists(tag)
    argv = ["build", str(tmp_path / CPU_SKU.name), "--progress", "plain", "--wheelhouse", str(house)]
    argv += ["--ca-bundle", str(host_ca_bundle)] if host_ca_bundle else []
    broken = next(p for p in bad.layers["engine"] if p.name == "transformers")
    try:
        assert main(argv) == 5
    finally:  # the CLI gathered the broken file into the shared wheel store: take it out again
        shutil.rmtree(store_path(wheel_store(), broken).parent, ignore_errors=True)
    assert "layer 'engine' failed" in capsys.readouterr().err
    assert not docker.image_exists(tag)


def test_a_wheel_that_does_not_match_the_lock_stops_the_build_before_buildkit(docker: Docker, built: BuiltImage, sku_dir: Path,
                                                                              wheelhouse: Path | None, tmp_path: Path) -> None:
    house = tmp_path / "house"
    house.mkdir()
    for wheel in (wheelhouse.glob("*.whl") if wheelhouse else ()):
        (house / wheel.name).hardlink_to(wheel)
    lock = read_lock(lock_path(sku_dir / CPU_SKU.name))
    tf = next(p for p in lock.layers["engine"] if p.name == "transformers")
    (house / tf.filename).write_bytes(b"a tampered wheel")
    shutil.copy(sku_dir / CPU_SKU.name, tmp_path / CPU_SKU.name)
    write_lock(lock, lock_path(tmp_path / CPU_SKU.name))
    lines: list[str] = []
    with pytest.raises(BuildError, match=f"{house / tf.filename}: sha256 [0-9a-f]{{64}}, but the lock says {tf.sha256}"):
        build(render(resolve(tmp_path / CPU_SKU.name)), docker, wheelhouse=house, wheel_store=tmp_path / "store",
              on_line=lines.append, progress="plain")
    assert not any(line.startswith("#") for line in lines)  # BuildKit never started


def test_interrupted_build_leaves_no_build_containers(docker: Docker, tmp_path: Path) -> None:
    marker = f"skupin-int-{uuid.uuid4().hex[:8]}"
    base = load_manifest(CPU_SKU).base.bootstrap.local_tag()
    (tmp_path / "Dockerfile").write_text(f"FROM {base}\nRUN echo {marker} && sleep 300\n")
    started = threading.Event()
    main_thread = threading.main_thread().ident

    def on_line(line: str) -> None:
        if marker in line and "sleep" not in line and not started.is_set():  # the RUN printed the marker
            started.set()
            threading.Timer(1.0, signal.pthread_kill, (main_thread, signal.SIGINT)).start()

    # pytest may run with SIGINT ignored (a background job of a non-interactive shell, as in CI):
    # Ctrl-C's handler is what this test is about, so install it for the test's duration.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            docker.build(context=tmp_path, dockerfile=tmp_path / "Dockerfile", no_cache=True, on_line=on_line)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert started.is_set()
    assert not _processes_with(marker)


def _processes_with(text: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def test_render_out_writes_a_context_that_builds_without_skupin_or_a_network(
        docker: Docker, built: BuiltImage, sku_dir: Path, wheelhouse: Path | None, host_ca_bundle: Path | None,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`skupin render --out DIR` gathers each step's wheels next to the Dockerfile, so a plain
    `docker build DIR` reproduces the image (here from the build cache of `built`)."""
    from skupin.cli import main

    out = tmp_path / "ctx"
    argv = ["render", str(sku_dir / CPU_SKU.name), "--out", str(out)]
    argv += ["--wheelhouse", str(wheelhouse)] if wheelhouse else []
    argv += ["--ca-bundle", str(host_ca_bundle)] if host_ca_bundle else []
    assert main(argv) == 0
    lock = read_lock(lock_path(sku_dir / CPU_SKU.name))
    assert f"and {len(lock.packages())} wheel(s)" in capsys.readouterr().out
    for req in (out / "requirements").glob("*.txt"):
        step = out / "wheels" / req.stem
        hashes = sorted(line.split("sha256:")[1] for line in req.read_text().splitlines() if line)
        assert sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in step.iterdir()) == hashes, req.name
    assert sum(len(list(p.iterdir())) for p in (out / "wheels").iterdir()) == len(lock.packages())
    raw = docker.build(context=out, dockerfile=out / "Dockerfile",
                       build_args={"SKUPIN_LOCK_HASH": lock.content_hash(),
                                   "SKUPIN_DOCKERFILE_SHA256": built.dockerfile_sha256})
    base = docker.inspect_image(built.base_id)
    assert base is not None
    made = normalise_image(docker, raw, epoch=IMAGE_EPOCH, base_layers=base.layers)
    if raw != built.image_id:
        docker.remove_image(raw)
    assert made.image_id == built.image_id  # BuildKit's image, normalised as every skupin build is
