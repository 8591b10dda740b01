#!/usr/bin/env python3
"""Markdown for a CI job summary ($GITHUB_STEP_SUMMARY), from skupin's own outputs; the standard library only.

    ci_summary.py gate SKU --verdict verdict.json --out gate-out [--run-url URL]
    ci_summary.py publish SKU --published published.json --verified verified.txt
    ci_summary.py junit TITLE --junit junit.xml

The gate table is one row per check (status and reason); the plots are in the `verdict-SKU` artifact
(gate-out/plot.png, report.md), linked through the run's page. Text from the verdict is the gate's own
output about an image under test: it is cut to 200 characters per cell and stripped of `|`, newlines and
control characters so it cannot break the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MAX = 200


def cell(value: object) -> str:
    text = "".join(ch if ch.isprintable() else " " for ch in str(value)).replace("|", "/").replace("`", "'")
    return text if len(text) <= MAX else text[: MAX - 1] + "…"


def gate(sku: str, verdict_path: Path, out: Path, run_url: str | None) -> str:
    lines = [f"## Gate: `{cell(sku)}`", ""]
    try:
        verdict = json.loads(verdict_path.read_text(encoding="utf-8")[:4_000_000])
    except (OSError, ValueError) as exc:
        return "\n".join([*lines, f"No verdict ({cell(exc)}): the gate did not finish; see the job log.", ""])
    lines.append(f"**{cell(verdict.get('decision', '?'))}**: {cell(verdict.get('reason', ''))}")
    lines += ["", "| check | status | reason |", "|---|---|---|"]
    for check in verdict.get("checks") or []:
        if isinstance(check, dict):
            lines.append(f"| {cell(check.get('name'))} | {cell(check.get('status'))} | {cell(check.get('reason'))} |")
    plots = sorted(p.name for p in out.glob("*.png")) if out.is_dir() else []
    where = f"[the run's artifacts]({run_url}#artifacts)" if run_url else "the run's artifacts"
    if plots:
        lines += ["", f"Plots ({', '.join(plots)}) and report.md: artifact `verdict-{cell(sku)}` in {where}."]
    return "\n".join(lines) + "\n"


def publish(sku: str, published: Path, verified: Path) -> str:
    lines = [f"## Published: `{cell(sku)}`", ""]
    try:
        data = json.loads(published.read_text(encoding="utf-8"))
        lines.append(f"- reference: `{cell(data.get('reference'))}`")
        lines.append(f"- tags: {', '.join('`' + cell(t) + '`' for t in data.get('tags') or [])}")
    except (OSError, ValueError) as exc:
        lines.append(f"- no publish record ({cell(exc)})")
    text = verified.read_text(encoding="utf-8", errors="replace").strip() if verified.is_file() else "(not verified)"
    lines.append(f"- verify: `{cell(text.splitlines()[-1] if text else '')}`")
    return "\n".join(lines) + "\n"


def junit(title: str, path: Path) -> str:
    import xml.etree.ElementTree as ET  # pytest's own file, on the runner that wrote it

    lines = [f"## {cell(title)}", ""]
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return "\n".join([*lines, f"No JUnit XML ({cell(exc)}).", ""])
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0) or 0) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    lines.append(f"{total['tests']} tests: {total['failures']} failed, {total['errors']} errors, {total['skipped']} skipped")
    failed = [c for s in suites for c in s.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    if failed:
        lines += ["", "| failed test |", "|---|"] + [f"| `{cell(c.get('classname'))}::{cell(c.get('name'))}` |"
                                                     for c in failed[:50]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("gate")
    g.add_argument("sku")
    g.add_argument("--verdict", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--run-url")
    p = sub.add_parser("publish")
    p.add_argument("sku")
    p.add_argument("--published", type=Path, required=True)
    p.add_argument("--verified", type=Path, required=True)
    j = sub.add_parser("junit")
    j.add_argument("title")
    j.add_argument("--junit", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.what == "junit":
        sys.stdout.write(junit(args.title, args.junit))
    elif args.what == "gate":
        sys.stdout.write(gate(args.sku, args.verdict, args.out, args.run_url))
    else:
        sys.stdout.write(publish(args.sku, args.published, args.verified))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
