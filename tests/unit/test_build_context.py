"""Build plumbing without an engine: BuildKit progress -> layers, and the kept build context."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from skupin.builder.build import layer_timings, parse_progress
from skupin.builder.render import RenderedDockerfile, write_context

DATA = Path(__file__).parent / "data"


def test_every_step_of_a_real_build_log_maps_to_its_layer():
    """A real BuildKit log of the CPU SKU (dockerd 20.10): steps whose names BuildKit printed with
    `$VIRTUAL_ENV` substituted still find their `# layer:` comment."""
    dockerfile = (DATA / "buildkit-cpu-x86_64.Dockerfile").read_text()
    lines = (DATA / "buildkit-cpu-x86_64.progress.txt").read_text().splitlines()
    assert '"$VIRTUAL_ENV"' in dockerfile and any('--cache /var/cache/skupin-bytecode "/opt/skupin/venv"' in ln for ln in lines)
    steps = parse_progress(lines, dockerfile=dockerfile)
    assert [s.layer for s in steps if s.layer == "unknown"] == []
    by_layer = {t.name: t for t in layer_timings(steps)}
    assert {"base", "python", "framework", "compiler", "engine", "export"} <= set(by_layer)
    runs = [s for s in steps if s.name.startswith("RUN ")]
    assert sorted(s.layer for s in runs) == ["compiler", "engine", "engine", "framework", "framework", "python"]
    assert all(s.cached for s in runs)


def test_a_step_with_a_different_substituted_value_is_not_matched_to_the_wrong_layer():
    dockerfile = "# layer: engine\nRUN find \"$VIRTUAL_ENV\" -name x\n# layer: extras\nRUN echo done\n"
    lines = ['#5 [2/3] RUN find "/opt/venv" -name x', "#5 DONE 1.5s", "#6 [3/3] RUN echo other", "#6 DONE 0.1s"]
    steps = parse_progress(lines, dockerfile=dockerfile)
    assert [(s.layer, s.seconds) for s in steps] == [("engine", 1.5), ("unknown", 0.1)]


def _rendered(files: dict[str, str], wheels: dict[str, dict[str, str]] | None = None) -> RenderedDockerfile:
    return RenderedDockerfile(sku="x", text="FROM scratch\n", sha256="0" * 64, files=files, wheels=wheels or {}, locked=True)


def test_kept_context_rewrites_only_what_changed_and_prunes_the_rest(tmp_path):
    stored = tmp_path / "store" / "a-1-py3-none-any.whl"
    stored.parent.mkdir()
    stored.write_bytes(b"wheel a")
    out = tmp_path / "ctx"
    write_context(
        rendered=_rendered({"requirements/engine.txt": "a==1\n"}, {"wheels/framework": {"a-1-py3-none-any.whl": "a" * 64}}),
        out=out,
        wheels={"a" * 64: stored},
        prune=True,
    )
    wheel = out / "wheels/framework/a-1-py3-none-any.whl"
    assert wheel.stat().st_ino == stored.stat().st_ino  # hard link, not a copy
    req = out / "requirements/engine.txt"
    os.utime(req, ns=(1, 1))
    (out / "stale.txt").write_text("left from an older render")
    (out / "requirements/old-deps.txt").write_text("b==2\n")

    write_context(rendered=_rendered({"requirements/engine.txt": "a==1\n", "requirements/engine-deps.txt": "c==3\n"}),
                  out=out, wheels={"a" * 64: stored}, prune=True)
    assert req.stat().st_mtime_ns == 1  # same content: not rewritten, so BuildKit does not re-send it
    assert (out / "requirements/engine-deps.txt").read_text() == "c==3\n"
    assert not (out / "stale.txt").exists() and not (out / "requirements/old-deps.txt").exists()
    assert not (out / "wheels").exists()

    write_context(rendered=_rendered({"requirements/engine.txt": "a==2\n"}), out=out, prune=True)
    assert req.read_text() == "a==2\n"


def test_kept_context_is_untouched_when_a_wheel_is_missing(tmp_path):
    out = tmp_path / "ctx"
    write_context(rendered=_rendered({"requirements/engine.txt": "a==1\n"}), out=out, prune=True)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(Exception, match="not gathered for the context: wheels/framework/gone.whl"):
        write_context(rendered=_rendered({"requirements/other.txt": "b\n"}, {"wheels/framework": {"gone.whl": "f" * 64}}),
                      out=out, wheels={}, prune=True)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_render_out_without_prune_keeps_the_users_files(tmp_path):
    (tmp_path / "notes.md").write_text("mine")
    write_context(rendered=_rendered({"requirements/engine.txt": "a==1\n"}), out=tmp_path)
    assert (tmp_path / "notes.md").read_text() == "mine"
