#!/usr/bin/env python3
"""Markdown for a CI job summary ($GITHUB_STEP_SUMMARY), from skupin's own outputs; the standard library only.

    ci_summary.py gate SKU --verdict verdict.json --out gate-out [--run-url URL]
    ci_summary.py publish SKU --published published.json --verified verified.txt
    ci_summary.py junit TITLE --junit junit.xml
    ci_summary.py step TITLE --json out.json

A command's `--json` output that is the failure object of skupin's contract (skupin/cli/output.py:
`{"ok": false, "error": {"code", "kind", "file", "field", "message", "fix", "problems"}, "warnings"}`) is shown as
the error itself: its exit code and kind, file, field, message and fix, and each problem as a row, not just "failed"
(`step` does that for any command's `--json` output, e.g. the build record).

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
from typing import Any

MAX = 200


def cell(value: object) -> str:
    text = "".join(ch if ch.isprintable() else " " for ch in str(value)).replace("|", "/").replace("`", "'")
    return text if len(text) <= MAX else text[: MAX - 1] + "…"


def _text(value: object) -> str:
    return "" if value is None else cell(value)


def failure(data: object) -> list[str]:
    """The lines showing a `--json` failure object's error (empty when `data` is no failure): code, kind, file,
    field, message and fix, then one table row per problem and the warnings."""
    if not isinstance(data, dict) or data.get("ok") is not False or not isinstance(data.get("error"), dict):
        return []
    error = data["error"]
    lines = [f"**failed** (exit {_text(error.get('code'))}, {_text(error.get('kind'))}): {_text(error.get('message'))}",
             ""]
    for key in ("file", "field"):
        if error.get(key):
            lines.append(f"- {key}: `{cell(error[key])}`")
    if error.get("fix"):
        lines.append(f"- fix: {cell(error['fix'])}")
    problems = [p for p in error.get("problems") or [] if isinstance(p, dict)]
    if problems:
        lines += ["", "| file | field | problem | fix |", "|---|---|---|---|"]
        lines += [f"| {_text(p.get('file'))} | {_text(p.get('field'))} | {_text(p.get('message'))} | {_text(p.get('fix'))} |"
                  for p in problems[:50]]
        if len(problems) > 50:
            lines.append(f"| … | | {len(problems) - 50} more | |")
    warnings = [w for w in data.get("warnings") or [] if isinstance(w, str)]
    if warnings:
        lines += ["", "Warnings:", ""] + [f"- {cell(w)}" for w in warnings[:20]]
    return lines


def _read_json(path: Path) -> object:
    """The JSON object a command wrote (the last line that is one, for commands that write a line per item first)."""
    text = path.read_text(encoding="utf-8", errors="replace")[:4_000_000]
    try:
        return json.loads(text)
    except ValueError:
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise


def step(title: str, path: Path) -> str:
    """A step's `--json` output: its error when it failed, else that it succeeded."""
    lines = [f"## {cell(title)}", ""]
    try:
        data = _read_json(path)
    except (OSError, ValueError) as exc:
        return "\n".join([*lines, f"No JSON output ({cell(exc)}): the command did not finish; see the job log.", ""])
    shown = failure(data)
    lines += shown or ["ok"]
    return "\n".join(lines) + "\n"


def gate(sku: str, verdict_path: Path, out: Path, run_url: str | None) -> str:
    lines = [f"## Gate: `{cell(sku)}`", ""]
    try:
        verdict = json.loads(verdict_path.read_text(encoding="utf-8")[:4_000_000])
    except (OSError, ValueError) as exc:
        return "\n".join([*lines, f"No verdict ({cell(exc)}): the gate did not finish; see the job log.", ""])
    if not isinstance(verdict, dict):
        return "\n".join([*lines, "No verdict (not a JSON object): see the job log.", ""])
    if "decision" not in verdict:  # the gate could not run: the failure object alone
        return "\n".join([*lines, *(failure(verdict) or ["No verdict: see the job log."])]) + "\n"
    lines.append(f"**{cell(verdict.get('decision', '?'))}**: {cell(verdict.get('reason', ''))}")
    if shown := failure(verdict):
        lines += ["", *shown]
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
    except (OSError, ValueError) as exc:
        lines.append(f"- no publish record ({cell(exc)})")
    else:
        if shown := failure(data):
            return "\n".join([f"## Publish failed: `{cell(sku)}`", "", *shown]) + "\n"
        lines.append(f"- reference: `{cell(data.get('reference'))}`")
        lines.append(f"- tags: {', '.join('`' + cell(t) + '`' for t in data.get('tags') or [])}")
    text = verified.read_text(encoding="utf-8", errors="replace").strip() if verified.is_file() else "(not verified)"
    lines.append(f"- verify: `{cell(text.splitlines()[-1] if text else '')}`")
    return "\n".join(lines) + "\n"


def _why(case: Any) -> str:
    """A failed test case's first line of why: its failure's (or error's) message, else the first line of its text."""
    found = case.find("failure")
    if found is None:
        found = case.find("error")
    text = (found.get("message") or found.text or "").strip()
    return text.splitlines()[0] if text else ""


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
        lines += ["", "| failed test | why |", "|---|---|"]
        lines += [f"| `{cell(c.get('classname'))}::{cell(c.get('name'))}` | {cell(_why(c))} |" for c in failed[:50]]
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
    s = sub.add_parser("step")
    s.add_argument("title")
    s.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.what == "step":
        sys.stdout.write(step(args.title, args.json))
    elif args.what == "junit":
        sys.stdout.write(junit(args.title, args.junit))
    elif args.what == "gate":
        sys.stdout.write(gate(args.sku, args.verdict, args.out, args.run_url))
    else:
        sys.stdout.write(publish(args.sku, args.published, args.verified))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
