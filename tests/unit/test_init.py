"""What an installed skupin does with no checkout around it (issue 34, "The installed wheel is second class"):
`skupin init` writes a starter catalog from the package's data, `reference verify` finds a shipped bundle from a folder
with no catalog, `fixture generate` writes into the catalog, never into the package."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from skupin.cli import main
from skupin.cli.init import FILES, STARTER
from skupin.common.paths import PACKAGE_ROOT

REPO = Path(__file__).resolve().parents[2]
WRITTEN = [dest for dest, _ in FILES] + [".gitignore"]


@pytest.fixture(autouse=True)
def _no_catalog_around(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKUPIN_ROOT", raising=False)
    monkeypatch.delenv("SKUPIN_STATE", raising=False)


def test_init_writes_the_starter_catalog_copied_from_the_package(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", str(tmp_path / "cat")]) == 0
    out = capsys.readouterr().out
    for name in WRITTEN:
        assert (tmp_path / "cat" / name).is_file(), name
        assert f"wrote {tmp_path / 'cat' / name}" in out
    for command in ("skupin check", "skupin lock cpu-x86_64", "skupin build cpu-x86_64", "skupin gate cpu-x86_64"):
        assert command in out
    # copies of the repository's own files (shipped as package data), not text of their own
    assert (tmp_path / "cat/skus/cpu-x86_64.yaml").read_bytes() == (REPO / "skus/cpu-x86_64.yaml").read_bytes()
    for flow in ("ci", "images", "watch"):
        assert ((tmp_path / f"cat/.github/workflows/{flow}.yml").read_bytes()
                == (REPO / f".github/workflows/{flow}.yml").read_bytes())
    ignore = (tmp_path / "cat/.gitignore").read_text().splitlines()
    assert "/.skupin/" in ignore and ".venv/" in ignore


def test_the_starter_data_is_what_the_wheel_ships() -> None:
    assert STARTER == PACKAGE_ROOT / "starter"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"starter/*/*"' in pyproject
    for _, src in FILES:
        assert (STARTER / src).is_file(), src


def test_the_written_manifest_passes_check_from_the_new_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", str(tmp_path)]) == 0
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True


def test_init_refuses_to_overwrite_and_names_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "skus").mkdir()
    (tmp_path / "skus/cpu-x86_64.yaml").write_text("mine\n")
    (tmp_path / ".gitignore").write_text("mine too\n")
    assert main(["init", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "skus/cpu-x86_64.yaml" in err and ".gitignore" in err and "--force" in err
    assert (tmp_path / "skus/cpu-x86_64.yaml").read_text() == "mine\n"
    assert not (tmp_path / ".github").exists()  # nothing written at all


def test_init_force_overwrites(tmp_path: Path) -> None:
    (tmp_path / "skus").mkdir()
    (tmp_path / "skus/cpu-x86_64.yaml").write_text("mine\n")
    assert main(["init", "--force", str(tmp_path)]) == 0
    assert (tmp_path / "skus/cpu-x86_64.yaml").read_bytes() == (REPO / "skus/cpu-x86_64.yaml").read_bytes()


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("link", [".gitignore", ".github", "skus/schema.json"])
def test_init_never_writes_through_a_link(tmp_path: Path, link: str, force: bool,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    cat = tmp_path / "cat"
    (cat / "skus").mkdir(parents=True)
    os.symlink(target if link == ".github" else target / "file", cat / link)
    assert main(["init", *(["--force"] if force else []), str(cat)]) == 2
    assert "link" in capsys.readouterr().err
    assert list(target.iterdir()) == []
    assert not (cat / ".gitignore").is_file() or link == ".gitignore"


def test_init_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", "--json", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and sorted(out["written"]) == sorted(str(tmp_path / n) for n in WRITTEN)


def test_init_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["init", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for words in ("--force", "link", "skus/cpu-x86_64.yaml", ".github/workflows", ".gitignore", "skupin lock", "catalog"):
        assert words in text


def test_reference_verify_finds_a_shipped_bundle_with_no_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["reference", "verify", "gates/references/tiny-llama/h200-bfloat16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True
    assert Path(out["bundle"]) == PACKAGE_ROOT / "gates/references/tiny-llama/h200-bfloat16"


def test_reference_verify_prefers_the_folder_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gates/references/tiny-llama/h200-bfloat16").mkdir(parents=True)  # here, but empty: not a bundle
    monkeypatch.chdir(tmp_path)
    assert main(["reference", "verify", "gates/references/tiny-llama/h200-bfloat16"]) == 7
    assert "SHA256SUMS" in capsys.readouterr().err


def test_fixture_generate_writes_into_the_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from skupin.gates.refdata import fixture

    written: list[Path] = []

    def fake_generate(*, name: str, out: Path) -> dict[str, str]:
        written.append(Path(out))
        return {"config.json": "0" * 64}

    monkeypatch.setattr(fixture, "generate_fixture", fake_generate)
    (tmp_path / "skus").mkdir()
    (tmp_path / "below").mkdir()
    monkeypatch.chdir(tmp_path / "below")
    assert main(["fixture", "generate", "--name", "tiny-moe"]) == 0
    assert written == [tmp_path / "gates/fixtures/tiny-moe"]
    assert main(["fixture", "generate", "--name", "tiny-moe", "--out", str(tmp_path / "x")]) == 0
    assert written[-1] == tmp_path / "x"
    assert not any(PACKAGE_ROOT in p.parents for p in written)


def test_fixture_generate_with_no_catalog_asks_for_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["fixture", "generate"]) == 2
    assert "--out" in capsys.readouterr().err
    assert not (tmp_path / "gates").exists()
