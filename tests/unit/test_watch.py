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
