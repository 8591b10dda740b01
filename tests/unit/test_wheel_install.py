"""skupin/imagetools/wheel_install.py: the in-build installer of a locked step's wheels (hash-checked, no pip)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from skupin.imagetools import wheel_install

LAZY = r"/site-packages/transformers/models/(?!auto/)[^/]+/"


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str], *, scripts: dict[str, str] | None = None,
               data_scripts: dict[str, str] | None = None) -> tuple[Path, str]:
    """A real wheel (PEP 427: WHEEL, METADATA, RECORD with hashes); its path and sha256."""
    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    contents[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if scripts:
        contents[f"{info}/entry_points.txt"] = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items())
    for script, text in (data_scripts or {}).items():
        contents[f"{dist}.data/scripts/{script}"] = text
    rows = []
    for path, text in contents.items():
        raw = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(raw).digest()).rstrip(b"=").decode()
        rows.append([path, f"sha256={digest}", str(len(raw))])
    rows.append([f"{info}/RECORD", "", ""])
    record = io.StringIO()
    csv.writer(record, lineterminator="\n").writerows(rows)
    contents[f"{info}/RECORD"] = record.getvalue()
    wheel = folder / f"{dist}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in contents.items():
            zf.writestr(path, text)
    return wheel, hashlib.sha256(wheel.read_bytes()).hexdigest()


def _prefix(tmp: Path) -> tuple[Path, Path]:
    prefix = tmp / "venv"
    site = Path(sysconfig.get_paths(vars={"base": str(prefix), "platbase": str(prefix)})["purelib"])
    site.mkdir(parents=True)
    return prefix, site


def _requirements(tmp: Path, lines: list[str]) -> Path:
    path = tmp / "req.txt"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def _run(tmp: Path, req: Path, wheels: Path, prefix: Path, *extra: str) -> int:
    return wheel_install.main([str(req), "--wheels", str(wheels), "--prefix", str(prefix), "--lazy", LAZY,
                               "--cache", str(tmp / "cache"), "--jobs", "1", *extra])


def test_installs_exactly_the_locked_wheels_with_scripts_records_and_bytecode(tmp_path, capsys):
    prefix, site = _prefix(tmp_path)
    wheels = tmp_path / "wheels"
    _, tf_sha = make_wheel(wheels, "transformers", "5.24.0", {
        "transformers/__init__.py": "from .cli import main\n",
        "transformers/cli.py": "def main():\n    return 0\n",
        "transformers/models/llama/modeling_llama.py": "X = 1\n",
        "transformers/models/auto/modeling_auto.py": "Y = 2\n",
    }, scripts={"transformers": "transformers.cli:main"}, data_scripts={"helper.sh": "#!/bin/sh\necho hi\n"})
    _, dep_sha = make_wheel(wheels, "tiny-dep", "1.0", {"tiny_dep.py": "A = 1\n"})
    req = _requirements(
        tmp_path, ["# locked", f"tiny-dep==1.0 --hash=sha256:{dep_sha}", f"transformers==5.24.0 --hash=sha256:{tf_sha}"]
    )

    assert _run(tmp_path, req, wheels, prefix, "--keep", str(prefix / "requirements/engine.txt")) == 0

    assert (prefix / "requirements/engine.txt").read_text() == req.read_text()
    out = capsys.readouterr().out
    assert "installed 2 wheel(s)" in out and "tiny-dep==1.0, transformers==5.24.0" in out
    assert (site / "transformers/cli.py").read_text() == "def main():\n    return 0\n"
    info = site / "transformers-5.24.0.dist-info"
    assert (info / "INSTALLER").read_text() == "skupin\n"
    record = (info / "RECORD").read_text()
    assert "transformers/cli.py,sha256=" in record and "../../../bin/transformers" in record
    script = prefix / "bin/transformers"
    assert script.read_text().startswith(f"#!{prefix / 'bin/python'}\n") and script.stat().st_mode & 0o111
    assert (prefix / "bin/helper.sh").read_text() == "#!/bin/sh\necho hi\n"
    # Bytecode for what the step installed, except the lazy per-architecture model modules.
    pycache = f"__pycache__/{{}}.{sys.implementation.cache_tag}.pyc"
    assert (site / "transformers" / pycache.format("cli")).is_file()
    assert (site / "transformers/models/auto" / pycache.format("modeling_auto")).is_file()
    assert not (site / "transformers/models/llama/__pycache__").exists()
    assert (site / pycache.format("tiny_dep")).is_file()
    assert "bytecode: 4 new files: 0 from the cache, 4 compiled" in out


def test_files_compile_in_worker_processes_while_the_rest_unpacks(tmp_path, capsys):
    prefix, site = _prefix(tmp_path)
    wheels = tmp_path / "wheels"
    files = {f"many/m{i}.py": f"V = {i}\n" for i in range(100)} | {"many/bad.py": "print 'py2'\n"}
    _, sha = make_wheel(wheels, "many", "1.0", files)
    req = _requirements(tmp_path, [f"many==1.0 --hash=sha256:{sha}"])
    assert _run(tmp_path, req, wheels, prefix, "--jobs", "3") == 0
    assert "bytecode: 101 new files: 0 from the cache, 100 compiled, 1 left without bytecode" in capsys.readouterr().out
    assert len(list((site / "many/__pycache__").iterdir())) == 100
    # A second install of the same files (a rebuild) takes every code object from the cache.
    assert _run(tmp_path, req, wheels, prefix, "--jobs", "2") == 0
    assert "101 new files: 100 from the cache, 0 compiled, 1 left without bytecode" in capsys.readouterr().out


def test_an_installed_older_version_is_replaced_by_its_record(tmp_path, capsys):
    prefix, site = _prefix(tmp_path)
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old_files = {"setuptools/__init__.py": "V = 65\n", "pkg_resources/__init__.py": "P = 1\n"}
    _, old_sha = make_wheel(old_dir, "setuptools", "65.5.0", old_files)
    assert _run(tmp_path, _requirements(tmp_path, [f"setuptools==65.5.0 --hash=sha256:{old_sha}"]), old_dir, prefix) == 0
    assert (site / "pkg_resources/__pycache__").is_dir()
    _, new_sha = make_wheel(new_dir, "setuptools", "84.2.1", {"setuptools/__init__.py": "V = 84\n"})

    assert _run(tmp_path, _requirements(tmp_path, [f"setuptools==84.2.1 --hash=sha256:{new_sha}"]), new_dir, prefix) == 0

    assert "replaced setuptools 65.5.0" in capsys.readouterr().out
    assert sorted(p.name for p in site.iterdir()) == ["setuptools", "setuptools-84.2.1.dist-info"]
    assert (site / "setuptools/__init__.py").read_text() == "V = 84\n"


@pytest.mark.parametrize("problem", ["wrong-hash", "extra-file", "missing", "other-dist"])
def test_wheels_that_do_not_match_the_lock_stop_the_step_before_anything_is_installed(tmp_path, capsys, problem):
    prefix, site = _prefix(tmp_path)
    wheels = tmp_path / "wheels"
    _, sha = make_wheel(wheels, "good", "1.0", {"good.py": "G = 1\n"})
    lines = [f"good==1.0 --hash=sha256:{sha}"]
    if problem == "wrong-hash":
        lines = [f"good==1.0 --hash=sha256:{'0' * 64}"]
    elif problem == "extra-file":
        make_wheel(wheels, "stowaway", "1.0", {"stowaway.py": "S = 1\n"})
    elif problem == "missing":
        lines.append(f"absent==2.0 --hash=sha256:{'1' * 64}")
    else:
        lines = [f"notgood==1.0 --hash=sha256:{sha}"]

    assert _run(tmp_path, _requirements(tmp_path, lines), wheels, prefix, "--keep", str(tmp_path / "kept.txt")) == 3
    assert not (tmp_path / "kept.txt").exists()

    err = capsys.readouterr().err
    assert "wheels do not match the locked requirements" in err
    expected = {"wrong-hash": f"good==1.0: no wheel in {wheels} has sha256 {'0' * 64}",
                "extra-file": "stowaway-1.0-py3-none-any.whl: in", "missing": "absent==2.0: no wheel",
                "other-dist": "which is not a wheel of notgood 1.0"}[problem]
    assert expected in err
    assert list(site.iterdir()) == []


@pytest.mark.parametrize("line", ["good>=1.0 --hash=sha256:" + "a" * 64, "good==1.0",
                                  "good @ https://x/good.whl --hash=sha256:" + "a" * 64])
def test_a_requirement_line_that_is_not_pinned_and_hashed_is_refused(tmp_path, capsys, line):
    prefix, _ = _prefix(tmp_path)
    req = _requirements(tmp_path, [line])
    assert _run(tmp_path, req, tmp_path, prefix) == 2
    assert f"{req}:1: not `name==version --hash=sha256:HEX`" in capsys.readouterr().err


def test_the_tool_needs_only_the_standard_library_bytecode_and_installer():
    """It runs with the image's own Python, next to bytecode.py and pypa installer's package."""
    import ast

    tree = ast.parse(Path(wheel_install.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__", "bytecode", "installer"}, imported


def test_the_rendered_tools_folder_works_alone_in_a_fresh_venv(tmp_path):
    """What a build step runs: the context's tools/ (both tools and installer's package) with a
    venv's own Python, which has neither skupin nor installer installed."""
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.builder.render import render_manifest
    from tests.paths import SKUS

    rendered = render_manifest(manifest=load_manifest(SKUS / "cpu-x86_64.yaml"))
    for rel, text in rendered.files.items():
        if rel.startswith("tools/"):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv/bin/python"
    wheels = tmp_path / "wheels"
    _, sha = make_wheel(wheels, "hello", "0.1", {"hello.py": "WORD = 'hi'\n"}, scripts={"hello": "hello:main"})
    req = _requirements(tmp_path, [f"hello==0.1 --hash=sha256:{sha}"])

    run = subprocess.run([str(python), str(tmp_path / "tools/wheel_install.py"), "--wheels", str(wheels), str(req)],
                         capture_output=True, text=True, check=False)

    assert run.returncode == 0, run.stderr
    check = subprocess.run([str(python), "-c", "import hello, importlib.metadata as m; print(hello.WORD, m.version('hello'))"],
                           capture_output=True, text=True, check=True)
    assert check.stdout.strip() == "hi 0.1"
    assert (tmp_path / "venv/bin/hello").is_file()


def test_with_mtime_two_installs_give_the_same_files_mtimes_and_bytecode(tmp_path, capsys):
    """--mtime EPOCH: every installed file, its pyc (whose header records the source's mtime) and every folder under
    the prefix is EPOCH, whenever the step runs; without it they carry the wall clock."""
    wheels = tmp_path / "wheels"
    _, sha = make_wheel(wheels, "tiny-dep", "1.0", {"tiny_dep.py": "A = 1\n", "tiny/sub/mod.py": "B = 2\n"})
    req = _requirements(tmp_path, [f"tiny-dep==1.0 --hash=sha256:{sha}"])
    epoch = 1764547200
    seen = []
    for _ in range(2):  # the same prefix (a pyc's code records its path), installed afresh
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        prefix, _ = _prefix(tmp_path / "run")
        assert _run(tmp_path, req, wheels, prefix, "--mtime", str(epoch), "--keep", str(prefix / "req/x.txt")) == 0
        entries = sorted(prefix.rglob("*"))
        assert entries and all(p.lstat().st_mtime == epoch for p in entries)
        seen.append({str(p.relative_to(prefix)): p.read_bytes() for p in entries if p.is_file()})
    assert seen[0] == seen[1] and any(name.endswith(".pyc") for name in seen[0])
    prefix, _ = _prefix(tmp_path / "c")
    assert _run(tmp_path, req, wheels, prefix) == 0
    assert all(p.stat().st_mtime > epoch for p in prefix.rglob("*.py"))
