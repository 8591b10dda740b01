"""The bytecode verifier: genuine bytecode passes, bytecode holding other code fails, hostile bytes never crash the host.

Runs the real tool (skupin/imagetools/pyc_verify.py) in this interpreter and in sandboxed worker processes of it.
"""

from __future__ import annotations

import ast
import importlib.util
import marshal
import subprocess
import sys
from pathlib import Path

import pytest

from skupin.gates.integrity import bytecode as pyc_check
from skupin.imagetools.pyc_verify import verify
from skupin.imageview.layers import Entry, FileView
from tests.data.threads import finishes

SOURCE = b"def f(x):\n    return x + 1\n\nclass C:\n    def g(self):\n        return [i * 2 for i in range(3)]\n"
DFILE = "/opt/skupin/venv/lib/python3.11/site-packages/m.py"


def pyc_of(source: bytes, dfile: str = DFILE, *, flags: int = 0, optimize: int = 0) -> bytes:
    code = compile(source, dfile, "exec", dont_inherit=True, optimize=optimize)
    return (importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little") + b"\0" * 8 + marshal.dumps(code))


def test_genuine_bytecode_passes_whatever_its_header_timestamp() -> None:
    assert verify(SOURCE, pyc_of(SOURCE), DFILE, 0) == ""
    assert verify(SOURCE, pyc_of(SOURCE, flags=3), DFILE, 0) == ""
    assert verify(SOURCE, pyc_of(SOURCE, optimize=1), DFILE, 1) == ""


@pytest.mark.parametrize("pyc, words", [
    (pyc_of(SOURCE.replace(b"x + 1", b"x + 2")), "differs"),
    (pyc_of(SOURCE + b"import os\n"), "differs"),
    (pyc_of(SOURCE.replace(b"i * 2", b"i * 3")), "differs"),  # nested code
    (pyc_of(SOURCE.replace(b"def g", b"def h")), "differs"),
    (b"\x00\x00\x0d\x0a" + pyc_of(SOURCE)[4:], "magic number"),
    (pyc_of(SOURCE, flags=8), "flags"),
    (pyc_of(SOURCE)[:16] + b"\xff\xff\xff", "marshal"),
    (pyc_of(SOURCE)[:16] + marshal.dumps((1, 2, 3)), "differs"),
    (b"short", "magic number"),
])
def test_bytecode_holding_other_code_fails(pyc: bytes, words: str) -> None:
    assert words in verify(SOURCE, pyc, DFILE, 0)


def test_the_optimization_level_is_part_of_the_code() -> None:
    source = b"assert False, 'x'\n"
    assert "differs" in verify(source, pyc_of(source, optimize=1), DFILE, 0)


def test_a_source_that_does_not_compile_has_no_genuine_bytecode() -> None:
    assert "does not compile" in verify(b"def (:\n", pyc_of(SOURCE), DFILE, 0)


SYSTEM_PYTHON = Path("/usr/bin/python{}.{}".format(*sys.version_info[:2]))
needs_system_python = pytest.mark.skipif(not SYSTEM_PYTHON.is_file(), reason=f"no {SYSTEM_PYTHON} (workers run as nobody)")


@needs_system_python
def test_sandboxed_workers_verify_many_files_and_survive_garbage() -> None:
    jobs = [(n, DFILE, 0, SOURCE, pyc_of(SOURCE) if n % 3 else pyc_of(SOURCE + b"x = 1\n")) for n in range(30)]
    jobs.append((30, DFILE, 0, SOURCE, pyc_of(SOURCE)[:16] + bytes(range(256)) * 40))
    results = pyc_check.run_workers(str(SYSTEM_PYTHON), jobs, workers=2)
    assert set(results) == set(range(31))
    assert sorted(n for n, why in results.items() if why) == [n for n in range(30) if n % 3 == 0] + [30]


def test_the_tool_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(pyc_check.TOOL).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names


def _view(python: bytes) -> FileView:
    import hashlib

    entry = Entry("f", 0o755, len(python), 0, hashlib.sha256(python).hexdigest(), hashlib.md5(python).hexdigest())
    return FileView(entries={"usr": Entry("d", 0, 0, 0), "usr/bin": Entry("d", 0, 0, 0), "usr/bin/python3.11": entry},
                    layers=())


def test_the_host_interpreter_must_be_identical_or_of_the_same_release(monkeypatch) -> None:
    host = Path(sys.executable).resolve()
    monkeypatch.setattr(pyc_check.shutil, "which", lambda name: str(host))
    same = _view(host.read_bytes())
    path, how = pyc_check.host_interpreter(same, "usr/bin/python3.11", None)
    assert (path, how) == (str(host), "byte-identical")
    other = _view(b"another build")
    release = "{}.{}.{}".format(*sys.version_info[:3])
    path, how = pyc_check.host_interpreter(other, "usr/bin/python3.11", release)
    assert path is not None and how == f"same release {release}"
    path, why = pyc_check.host_interpreter(other, "usr/bin/python3.11", "3.99.0")
    assert path is None and "apt-get install python3.11-minimal" in why


@needs_system_python
def test_workers_run_unprivileged_when_the_gate_runs_as_root() -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("only root drops privileges")
    out = subprocess.run([str(SYSTEM_PYTHON), "-I", "-S", "-c", "import os; print(os.getuid())"], capture_output=True,
                         text=True, preexec_fn=pyc_check._limit_worker, env={}, check=True)
    assert out.stdout.strip() == str(pyc_check.NOBODY)


def _tool_with(tmp_path: Path, main_prologue: str) -> Path:
    """The real tool with `main_prologue` run at the start of main() (a worker that misbehaves on purpose)."""
    text = Path(pyc_check.TOOL).read_text(encoding="utf-8")
    anchor = "    stdin, stdout = sys.stdin.buffer, sys.stdout\n"
    assert anchor in text
    tool = tmp_path / "tool.py"
    tool.write_text(text.replace(anchor, anchor + main_prologue), encoding="utf-8")
    return tool


@needs_system_python
def test_a_worker_that_floods_stderr_does_not_deadlock_the_gate(tmp_path, monkeypatch) -> None:
    # A worker writing more than a pipe holds to stderr (warnings, say) used to block while the gate
    # waited on its stdout.
    monkeypatch.setattr(pyc_check, "TOOL", _tool_with(tmp_path, "    sys.stderr.write('w' * (1 << 20)); sys.stderr.flush()\n"))
    jobs = [(n, DFILE, 0, SOURCE, pyc_of(SOURCE)) for n in range(4)]
    results = finishes(lambda: pyc_check.run_workers(str(SYSTEM_PYTHON), jobs, workers=2), within=60)
    assert results == {n: "" for n in range(4)}


@needs_system_python
def test_a_worker_past_the_deadline_is_killed_and_the_bytecode_is_unverifiable(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pyc_check, "TOOL", _tool_with(tmp_path, "    import time; time.sleep(600)\n"))
    jobs = [(n, DFILE, 0, SOURCE, pyc_of(SOURCE)) for n in range(2)]
    with pytest.raises(pyc_check.VerifierTimedOut, match="1 s"):
        finishes(lambda: pyc_check.run_workers(str(SYSTEM_PYTHON), jobs, workers=2, deadline_s=1), within=60)

    class Item:
        pyc, real_source, source, opt = "m.pyc", "m.py", "m.py", 0

    view = FileView(entries={"m.py": Entry("f", 0o644, len(SOURCE), 0, "a" * 64, "b" * 32),
                             "m.pyc": Entry("f", 0o644, 3, 0, "c" * 64, "d" * 32)}, layers=())
    monkeypatch.setattr(pyc_check, "host_interpreter", lambda *_: (str(SYSTEM_PYTHON), "byte-identical"))
    monkeypatch.setattr(FileView, "read_file", lambda self, path: SOURCE if path.endswith(".py") else pyc_of(SOURCE))
    monkeypatch.setattr(pyc_check, "DEADLINE_S", 1)
    failures, unverifiable, host = finishes(
        lambda: pyc_check.bytecode_verifier(cache=None, workers=1)([Item()], view, "usr/bin/python3.11", None), within=60)
    assert failures == [] and host is None
    assert len(unverifiable) == 1 and "did not finish within 1 s" in unverifiable[0]


@needs_system_python
@pytest.mark.parametrize("garbage", [repr(line) for line in ("not json", "[1, 2]", '{"id": 0}', '{"id": "x", "ok": true}',
                                                              '{"id": 0, "ok": "yes"}', '{"id": 99, "ok": true, "why": ""}')]
                         + ["'x' * 200_000"])
def test_a_worker_that_prints_garbage_fails_its_files_without_crashing_the_gate(tmp_path, monkeypatch, garbage) -> None:
    # The worker unmarshals hostile bytes, so its output is hostile too: a line that is not a result for a file of its
    # own shard (id 99 is nobody's) fails what it had left; it never passes a file and never raises.
    monkeypatch.setattr(pyc_check, "TOOL", _tool_with(tmp_path, f"    stdout.write({garbage} + '\\n'); stdout.flush()\n"))
    jobs = [(n, DFILE, 0, SOURCE, pyc_of(SOURCE)) for n in range(3)]
    results = finishes(lambda: pyc_check.run_workers(str(SYSTEM_PYTHON), jobs, workers=1), within=60)
    assert set(results) == {0, 1, 2} and all("verifier" in why for why in results.values()), results


PY312 = Path("/root/.pyenv/versions/3.12.1/bin/python3.12")


@pytest.mark.skipif(not PY312.is_file(), reason=f"no {PY312}")
def test_workers_print_no_warnings_under_python_3_12() -> None:
    # Python 3.12's compile() prints a SyntaxWarning per invalid escape: 3,000 of them overflow a pipe.
    source = b"x = '" + b"\\d" * 3000 + b"'\n" + b"".join(b"y%d = '\\d'\n" % n for n in range(3000))
    frames = b"".join(pyc_check._frames([(0, DFILE, 0, source, b"short")]))
    done = subprocess.run(pyc_check.worker_command(str(PY312)), input=frames, capture_output=True, timeout=120, check=False,
                          env={}, cwd="/")
    assert done.returncode == 0 and done.stderr == b"", done.stderr[-300:]
    assert b'"id": 0' in done.stdout
