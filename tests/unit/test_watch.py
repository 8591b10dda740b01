"""Update-policy rules and the watch report formats (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from skupin.releases.watch import Bump, Proposal, WatchReport, allowed, apply_proposal, markdown, text_report

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("level", "current", "candidate", "ok"),
    [
        ("patch", "0.27.0", "0.27.1", True),
        ("patch", "0.27.0", "0.28.0", False),
        ("patch", "2.13.0", "2.13.0", False),
        ("minor", "0.32.0", "0.33.0", True),
        ("minor", "2.13.0", "3.0.0", False),
        ("major", "2.13.0", "3.0.0", True),
        ("none", "0.27.0", "0.27.1", False),
        ("major", "2.13.0", "2.14.0rc1", False),
        ("patch", "0.10.1", "0.10.1.1", True),
    ],
)
def test_policy_levels(level, current, candidate, ok):
    assert allowed(level, Version(current), Version(candidate)) is ok


def _report(tmp_path: Path) -> tuple[WatchReport, Path]:
    src = REPO / "skus" / "nvidia-h200-vllm.yaml"
    path = tmp_path / src.name
    path.write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    bumps = (Bump(field="stack.engine.version", component="vllm", old="0.32.0", new="0.32.1"),)
    return WatchReport(proposals=(Proposal(sku="nvidia-h200-vllm", manifest=str(path), state="bump", bumps=bumps),
                                  Proposal(sku="x", manifest="x.yaml", state="blocked", why="needs torch 2.14.0"))), path


def test_markdown_and_text(tmp_path):
    report, _ = _report(tmp_path)
    body = markdown(report)
    assert "| vllm | `0.32.0` | `0.32.1` | `stack.engine.version` |" in body
    assert "- `x` (blocked): needs torch 2.14.0" in body
    lines = text_report(report)
    assert lines[0].startswith("bump") and "vllm 0.32.0 -> 0.32.1" in lines[0]


def test_apply_keeps_comments_and_moves_description(tmp_path):
    report, path = _report(tmp_path)
    before = path.read_text(encoding="utf-8")
    apply_proposal(report.proposals[0])
    after = path.read_text(encoding="utf-8")
    diff = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=False) if a != b]
    assert [b for _, b in diff] == ["description: NVIDIA H200 141GB, CUDA 13.0, torch 2.13.0 cu130, triton 3.7.1, vLLM 0.32.1",
                                    "    version: 0.32.1"]


def test_apply_refuses_an_invalid_result(tmp_path):
    report, path = _report(tmp_path)
    bad = Proposal(sku="nvidia-h200-vllm", manifest=str(path), state="bump",
                   bumps=(Bump(field="stack.engine.version", component="vllm", old="0.32.0", new="none"),))
    before = path.read_text(encoding="utf-8")
    with pytest.raises(Exception, match="invalid"):
        apply_proposal(bad)
    assert path.read_text(encoding="utf-8") == before


# ------------------------------------------------------------------ a release compat.yaml does not know yet


def _without_rows(tmp_path: Path, *drop: str) -> Path:
    """builder/data/compat.yaml without the rows whose line contains any of `drop`, in tmp_path."""
    lines = (REPO / "builder" / "data" / "compat.yaml").read_text(encoding="utf-8").splitlines(keepends=True)
    out = tmp_path / "compat.yaml"
    out.write_text("".join(line for line in lines if not any(d in line for d in drop)), encoding="utf-8")
    return out


def test_a_release_compat_does_not_know_brings_its_rows_into_the_proposal(tmp_path):
    """vLLM 0.33.0 (torch 2.14.0) with neither row in compat.yaml: the proposal carries both rows, derived from the
    recorded wheels' Requires-Dist by compat refresh's code; --apply writes them and the bumped manifest then checks.
    The index is tests/data/index/ served on loopback (no network)."""
    from skupin.builder.catalog.compat import check_compat, load_compat
    from skupin.releases.watch import watch
    from skupin.releases.yamledit import set_scalars
    from tests.data.index.server import serve_index

    compat = _without_rows(tmp_path, "{engine: vllm, version: 0.33.0,", "{torch: 2.14.0, family: cuda,")
    before = compat.read_text(encoding="utf-8")
    src = REPO / "skus" / "nvidia-h200-vllm.yaml"
    path = tmp_path / "skus" / src.name
    path.parent.mkdir()
    minor = {f"update_policy.{k}": "minor" for k in ("framework", "compiler", "engine")}
    path.write_text(set_scalars(src.read_text(encoding="utf-8"), minor), encoding="utf-8")
    with serve_index(REPO / "tests" / "data" / "index") as url:
        planned = watch(paths=[path], index_url=url, compat_path=compat)
        assert compat.read_text(encoding="utf-8") == before  # without --apply nothing is written
        (p,) = planned.proposals
        assert p.state == "bump" and p.compat_missing == ()
        rows = {r.section: r.row for r in p.compat}
        assert rows["engine_torch"]["torch"] == "==2.14.0" and rows["engine_torch"]["version"] == "0.33.0"
        assert rows["torch_compiler"]["requires"] == "~=3.8.0" and rows["torch_compiler"]["cuda_runtime"] == "13.0.3"
        assert "vllm 0.33.0 Requires-Dist (vllm-0.33.0-" in rows["engine_torch"]["source"]
        assert "vllm 0.33.0 -> torch==2.14.0" in markdown(planned)
        report = watch(paths=[path], index_url=url, compat_path=compat, apply=True)
    assert report.applied == ("nvidia-h200-vllm",) and report.compat_file
    after = compat.read_text(encoding="utf-8")
    added = [line for line in after.splitlines() if line not in before.splitlines()]
    assert len(added) == 2 and len(after.splitlines()) == len(before.splitlines()) + 2
    # each row in its place: after the older release of the same engine / family
    lines = after.splitlines()
    vllm = [line for line in lines if line.startswith("  - {engine: vllm, ")]
    assert "version: 0.32.0" in vllm[-2] and "version: 0.33.0" in vllm[-1]
    torch_at = next(i for i, line in enumerate(lines) if line.startswith("  - {torch: 2.14.0, family: cuda,"))
    assert lines[torch_at - 1].startswith("  - {torch: 2.13.0, family: cuda,")
    data = load_compat(compat)
    from skupin.builder.catalog.manifest import load_manifest

    assert check_compat(manifest=load_manifest(path), file=str(path), compat=data) == []
    # a second run that finds the rows already there proposes none
    with serve_index(REPO / "tests" / "data" / "index") as url:
        again = watch(paths=[path], index_url=url, compat_path=compat)
    assert all(not q.compat for q in again.proposals)


def test_a_row_that_cannot_be_derived_is_named_missing(tmp_path):
    """A bump whose wheel does not require torch (or has no Linux wheel) is proposed with the row listed as missing."""
    from skupin.releases.watch import CompatRow

    report = WatchReport(proposals=(Proposal(
        sku="s", manifest="s.yaml", state="bump",
        bumps=(Bump(field="stack.engine.version", component="vllm", old="0.32.0", new="0.32.1"),),
        compat=(CompatRow(section="engine_torch", row={"engine": "vllm", "version": "0.32.1", "torch": "==2.13.0",
                                                        "source": "PyPI vllm 0.32.1 Requires-Dist (w.whl)",
                                                        "date": "2026-12-02"}),),
        compat_missing=("torch 2.14.0: torch-2.14.0-x.whl does not require triton",)),))
    body = markdown(report)
    assert "- `engine_torch`: vllm 0.32.1 -> torch==2.13.0 (PyPI vllm 0.32.1 Requires-Dist (w.whl))" in body
    assert "- torch 2.14.0: torch-2.14.0-x.whl does not require triton" in body
    assert any("missing: torch 2.14.0" in line for line in text_report(report))
