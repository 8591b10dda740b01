"""skupin/imagetools/bytecode.py: the in-build bytecode compiler (new files only, lazy paths, a code cache)."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import time
from pathlib import Path

import pytest

from skupin.imagetools import bytecode

LAZY = r"/site-packages/transformers/models/(?!auto/)[^/]+/"


def _pyc(path: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(path)))


def _reference_pyc(path: Path, tmp: Path) -> bytes:
    """What pip/py_compile would write for `path` (timestamp-checked), without touching its __pycache__."""
    out = tmp / "ref.pyc"
    py_compile.compile(str(path), cfile=str(out), dfile=str(path), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    return out.read_bytes()


def _tree(root: Path) -> dict[str, Path]:
    files = {
        "top": root / "site-packages/transformers/__init__.py",
        "auto": root / "site-packages/transformers/models/auto/modeling_auto.py",
        "llama": root / "site-packages/transformers/models/llama/modeling_llama.py",
        "util": root / "site-packages/transformers/utils/hub.py",
        "broken": root / "site-packages/pkg/py2_only.py",
    }
    for name, path in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("print 'old'\n" if name == "broken" else f"VALUE = {name!r}\ndef f(x):\n    return [x] * 3\n")
    return files


def _stamp(tmp: Path) -> Path:
    stamp = tmp / "stamp"
    stamp.write_text("")
    past = time.time() - 60
    os.utime(stamp, (past, past))
    return stamp


def test_compiles_new_files_like_pip_and_leaves_lazy_ones_and_broken_ones(tmp_path, capsys):
    files = _tree(tmp_path / "venv")
    old = tmp_path / "venv/site-packages/already/there.py"
    old.parent.mkdir(parents=True)
    old.write_text("X = 1\n")
    stamp = _stamp(tmp_path)
    os.utime(old, (time.time() - 120, time.time() - 120))  # installed by an earlier step
    assert bytecode.main([str(tmp_path / "venv"), "--since", str(stamp), "--lazy", LAZY, "--jobs", "1"]) == 0
    assert "4 new files: 0 from the cache, 3 compiled, 1 left without bytecode" in capsys.readouterr().out
    for name in ("top", "auto", "util"):
        assert _pyc(files[name]).read_bytes() == _reference_pyc(files[name], tmp_path), name
    assert not _pyc(files["llama"]).exists()  # per-architecture module: compiled in memory on import
    assert not _pyc(files["broken"]).exists()
    assert not _pyc(old).exists()  # not written by this step


def test_cache_reuses_unchanged_files_and_recompiles_changed_ones(tmp_path):
    cache = tmp_path / "cache"
    files = _tree(tmp_path / "venv")
    stamp = _stamp(tmp_path)
    first = bytecode.compile_sources(bytecode.new_sources([tmp_path / "venv"], since_ns=stamp.stat().st_mtime_ns, lazy=None),
                                     cache=cache, jobs=1)
    assert first == {"hit": 0, "compiled": 4, "failed": 1}

    # The next build (a point release) reinstalls the package: new mtimes, one file changed.
    for path in tmp_path.joinpath("venv").rglob("__pycache__"):
        for pyc in path.iterdir():
            pyc.unlink()
    time.sleep(0.01)
    for path in files.values():
        path.write_bytes(path.read_bytes())
    files["util"].write_text("VALUE = 'changed in the point release'\n")
    second = bytecode.compile_sources(bytecode.new_sources([tmp_path / "venv"], since_ns=stamp.stat().st_mtime_ns, lazy=None),
                                      cache=cache, jobs=1)
    assert second == {"hit": 3, "compiled": 1, "failed": 1}
    for name in ("top", "auto", "llama", "util"):
        # byte-identical to a fresh compile: the header carries the new mtime, the body the same code
        assert _pyc(files[name]).read_bytes() == _reference_pyc(files[name], tmp_path), name


def test_the_same_source_at_another_path_is_not_a_cache_hit(tmp_path):
    a, b = tmp_path / "a/mod.py", tmp_path / "b/mod.py"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("def where():\n    raise RuntimeError\n")
    assert bytecode.cache_key(a, a.read_bytes()) != bytecode.cache_key(b, b.read_bytes())
    cache = tmp_path / "cache"
    assert bytecode.compile_one(a, cache) == "compiled"
    assert bytecode.compile_one(b, cache) == "compiled"
    assert _pyc(b).read_bytes() == _reference_pyc(b, tmp_path)  # tracebacks name b/mod.py, not a/mod.py


def test_a_corrupt_cache_entry_is_recompiled_not_copied(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("X = 42\n")
    cache = tmp_path / "cache"
    key = bytecode.cache_key(src, src.read_bytes())
    entry = cache / key[:2] / key
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"\xe3garbage")
    assert bytecode.compile_one(src, cache) == "compiled"
    assert _pyc(src).read_bytes() == _reference_pyc(src, tmp_path)


def test_many_files_compile_over_several_processes(tmp_path):
    root = tmp_path / "venv"
    for i in range(150):
        p = root / f"pkg{i % 7}" / f"m{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"N = {i}\n")
    stamp = _stamp(tmp_path)
    paths = bytecode.new_sources([root], since_ns=stamp.stat().st_mtime_ns, lazy=None)
    assert len(paths) == 150
    assert bytecode.compile_sources(paths, cache=tmp_path / "cache", jobs=2) == {"hit": 0, "compiled": 150, "failed": 0}
    assert all(_pyc(p).is_file() for p in paths)
    assert bytecode.compile_sources(paths, cache=tmp_path / "cache", jobs=2)["hit"] == 150


@pytest.mark.parametrize("args", [["--since", "/nonexistent/stamp"], ["--lazy", "(unclosed"]])
def test_bad_arguments_exit_2(tmp_path, args, capsys):
    stamp = _stamp(tmp_path)
    argv = [str(tmp_path), "--since", str(stamp), *args] if args[0] == "--lazy" else [str(tmp_path), *args]
    assert bytecode.main(argv) == 2
    assert "bytecode.py:" in capsys.readouterr().err


def test_the_tool_needs_only_the_standard_library():
    """It runs with the image's own Python before anything of skupin exists there."""
    import ast

    tree = ast.parse(Path(bytecode.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    import sys

    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_files_come_from_the_records_of_the_distributions_just_installed(tmp_path):
    """In a real venv the step's files are read from RECORD; a torch-sized tree is not walked."""
    venv = tmp_path / "venv"
    site = venv / "lib/python3.11/site-packages"
    old_dist = site / "torch"
    old_dist.mkdir(parents=True)
    (old_dist / "__init__.py").write_text("T = 1\n")
    (site / "torch-2.0.dist-info").mkdir()
    (site / "torch-2.0.dist-info/RECORD").write_text("torch/__init__.py,sha256=x,6\n")
    past = time.time() - 120
    for p in (old_dist / "__init__.py", site / "torch-2.0.dist-info", site / "torch-2.0.dist-info/RECORD"):
        os.utime(p, (past, past))
    stamp = _stamp(tmp_path)
    (old_dist / "__init__.py").write_text("T = 2\n")  # touched, but no distribution installed it now
    new = site / "transformers"
    (new / "models/llama").mkdir(parents=True)
    for rel in ("__init__.py", "models/llama/modeling_llama.py"):
        (new / rel).write_text("X = 1\n")
    (venv / "bin").mkdir()
    (venv / "bin/helper.py").write_text("H = 1\n")
    (site / "transformers-5.0.dist-info").mkdir()
    (site / "transformers-5.0.dist-info/RECORD").write_text(
        "transformers/__init__.py,sha256=a,6\n"
        "transformers/models/llama/modeling_llama.py,sha256=b,6\n"
        "../../../bin/helper.py,sha256=c,6\n"
        "transformers-5.0.dist-info/RECORD,,\n"
        "transformers/gone.py,sha256=d,6\n"
    )
    found = bytecode.new_sources([venv], since_ns=stamp.stat().st_mtime_ns, lazy=__import__("re").compile(LAZY))
    assert found == sorted([venv / "bin/helper.py", new / "__init__.py"])


def test_a_venv_lib64_link_does_not_list_files_twice(tmp_path):
    venv = tmp_path / "venv"
    site = venv / "lib/python3.11/site-packages"
    (site / "pkg").mkdir(parents=True)
    (venv / "lib64").symlink_to("lib")
    stamp = _stamp(tmp_path)
    (site / "pkg/__init__.py").write_text("A = 1\n")
    (site / "pkg-1.dist-info").mkdir()
    (site / "pkg-1.dist-info/RECORD").write_text("pkg/__init__.py,sha256=a,6\n")
    assert bytecode.new_sources([venv], since_ns=stamp.stat().st_mtime_ns, lazy=None) == [site / "pkg/__init__.py"]


def test_record_files_count_even_when_the_installer_kept_old_mtimes(tmp_path):
    venv = tmp_path / "venv"
    site = venv / "lib/python3.11/site-packages"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg/__init__.py").write_text("A = 1\n")
    os.utime(site / "pkg/__init__.py", (1_000_000, 1_000_000))  # the wheel's 1970s timestamp, kept
    stamp = _stamp(tmp_path)
    (site / "pkg-1.dist-info").mkdir()
    (site / "pkg-1.dist-info/RECORD").write_text("pkg/__init__.py,sha256=a,6\n")
    assert bytecode.new_sources([venv], since_ns=stamp.stat().st_mtime_ns, lazy=None) == [site / "pkg/__init__.py"]
