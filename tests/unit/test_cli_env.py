"""Every command that takes an option reads the same environment variable for it (issue 34: `build` ignored
$SKUPIN_WHEELHOUSE while `gate` honoured it, so a build tried to download the CPU torch)."""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import pytest

from skupin.cli import build_parser

# an option whose name is shared, but not its meaning: the matrix's --wheelhouse is a folder the CI runners have
DIFFERENT_MEANING = {("matrix", "--wheelhouse")}


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                path = f"{prefix} {name}".strip()
                out[path] = sub
                out.update(_commands(sub, path))
    return out


def _options() -> dict[str, dict[str, argparse.Action]]:
    """option string -> {command: its action}, for every command of the parser."""
    found: dict[str, dict[str, argparse.Action]] = defaultdict(dict)
    for command, sub in _commands(build_parser()).items():
        for action in sub._actions:
            for option in action.option_strings:
                found[option][command] = action
    return found


def test_an_option_with_an_environment_variable_in_one_command_has_it_in_every_command() -> None:
    missing = []
    for option, actions in _options().items():
        named = {var for action in actions.values() for var in re.findall(r"\$(SKUPIN_[A-Z_]+)", action.help or "")}
        for command, action in actions.items():
            if (command, option) in DIFFERENT_MEANING:
                continue
            missing += [f"{command} {option}: ${var}" for var in named if f"${var}" not in (action.help or "")]
    assert missing == []


def test_the_wheelhouse_option_has_its_own_meaning_only_in_the_matrix() -> None:
    takers = set(_options()["--wheelhouse"])
    assert {"build", "gate", "lock", "render", "run", "ab", "watch"} <= takers
    assert {c for c, _ in DIFFERENT_MEANING} <= takers


ARGS = {"build": ["cpu-x86_64"], "gate": ["cpu-x86_64"], "lock": ["cpu-x86_64"], "render": ["cpu-x86_64"], "run": [],
        "ab": ["a", "b"], "watch": []}


@pytest.mark.parametrize("command", sorted(ARGS))
def test_build_gate_and_the_others_read_skupin_wheelhouse(command: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKUPIN_WHEELHOUSE", raising=False)
    assert build_parser().parse_args([command, *ARGS[command]]).wheelhouse is None
    monkeypatch.setenv("SKUPIN_WHEELHOUSE", str(tmp_path))
    assert build_parser().parse_args([command, *ARGS[command]]).wheelhouse == tmp_path
    given = tmp_path / "given"
    assert build_parser().parse_args([command, *ARGS[command], "--wheelhouse", str(given)]).wheelhouse == given
    monkeypatch.setenv("SKUPIN_WHEELHOUSE", "")  # set but empty: none, as unset
    assert build_parser().parse_args([command, *ARGS[command]]).wheelhouse is None


def test_the_matrix_never_takes_this_hosts_wheelhouse_for_the_runners(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKUPIN_WHEELHOUSE", str(tmp_path))
    assert build_parser().parse_args(["matrix"]).wheelhouse is None
