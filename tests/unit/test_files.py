"""The host's own writes (issue 30): atomic, with a temporary name no other writer shares; bad FILE targets refused
before any work; any OSError of a command one line with its exit code."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from skupin.cli import main
from skupin.common.errors import UsageError
from skupin.common.files import writable_file, write_atomic
from skupin.common.model import Frozen


class Doc(Frozen):
    text: str


def test_two_writers_and_a_reader_never_see_a_torn_file(tmp_path: Path) -> None:
    path = tmp_path / "lock.json"
    bodies = [Doc(text=c * 200_000) for c in "ab"]
    bodies[0].write_json(path)
    whole = {path.read_text(), (bodies[1].write_json(path), path.read_text())[1]}
    torn: list[int] = []
    stop = threading.Event()

    def write(doc: Doc) -> None:
        for _ in range(60):
            doc.write_json(path)

    def read() -> None:
        while not stop.is_set():
            if path.read_text() not in whole:
                torn.append(1)

    writers = [threading.Thread(target=write, args=(doc,)) for doc in bodies]
    reader = threading.Thread(target=read)
    reader.start()
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert not torn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock.json"]  # no temporary left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tolerances.yaml"
    path.write_text("old\n")
    path.chmod(0o640)

    def fail(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "new\n")
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["tolerances.yaml"]
    monkeypatch.undo()
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and (path.stat().st_mode & 0o777) == 0o640  # an existing file keeps its mode


@pytest.mark.parametrize("target", ["folder", "missing/x.json", "/proc/self/x", "/dev/null"])
def test_a_bad_file_target_is_refused_naming_the_flag(tmp_path: Path, target: str) -> None:
    (tmp_path / "folder").mkdir()
    path = Path(target) if target.startswith("/") else tmp_path / target
    with pytest.raises(UsageError, match="^--sbom-out "):
        writable_file(path, flag="--sbom-out")


def test_verify_refuses_a_bad_sbom_out_before_asking_any_registry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "127.0.0.1:9/x:verified", "--sbom-out", str(tmp_path)])
    assert code == 2 and "error: --sbom-out" in capsys.readouterr().err


def test_an_os_error_of_a_command_is_one_line_with_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import skupin.cli.build as build

    def boom(_args: object) -> int:
        raise PermissionError(13, "Permission denied", str(tmp_path / "skus"))

    monkeypatch.setattr(build, "cmd_check", boom)
    code = main(["check"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Permission denied" in err and "Traceback" not in err


def test_a_new_file_gets_the_mode_the_umask_gives(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        path = write_atomic(tmp_path / "new.json", "{}\n")
    finally:
        os.umask(old)
    assert (path.stat().st_mode & 0o777) == 0o640
