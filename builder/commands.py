"""Registers the CLI commands of the later stages (lock, engine, base, build, reference, gate, ...)."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add every stage's subcommands; each stage module owns its own arguments and handler."""
