"""In-place YAML scalar edits keep comments, quoting and layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from skupin.common.errors import ManifestError
from skupin.releases.yamledit import get_scalar, set_scalars

TEXT = """\
# top comment
name: demo   # trailing comment
stack:
  engine:
    # why this version
    version: 0.27.0
    source: {kind: git, repo: https://github.com/vllm-project/vllm, ref: v0.27.0}
  python: "3.12"
items:
  - {name: numpy, version: 2.4.6}
"""


def test_only_the_scalars_change():
    out = set_scalars(TEXT, {"stack.engine.version": "0.27.1", "stack.engine.source.ref": "v0.27.1",
                             "items[0].version": "2.4.7"})
    changed = [(a, b) for a, b in zip(TEXT.splitlines(), out.splitlines(), strict=False) if a != b]
    assert len(changed) == 3 and len(out.splitlines()) == len(TEXT.splitlines())
    assert "    # why this version" in out and "name: demo   # trailing comment" in out
    data = yaml.safe_load(out)
    assert data["stack"]["engine"]["source"]["ref"] == "v0.27.1" and data["items"][0]["version"] == "2.4.7"


def test_quoting_is_kept_and_types_survive():
    out = set_scalars(TEXT, {"stack.python": "3.13"})
    assert '  python: "3.13"' in out
    # a value that plain YAML would read as a number gets quoted
    out = set_scalars(TEXT, {"stack.engine.version": "1.10"})
    assert yaml.safe_load(out)["stack"]["engine"]["version"] == "1.10"


def test_unknown_paths_are_errors():
    with pytest.raises(ManifestError, match="no key 'nope'"):
        set_scalars(TEXT, {"stack.nope": "1"})
    with pytest.raises(ManifestError, match="not a scalar"):
        set_scalars(TEXT, {"stack.engine": "1"})
    assert get_scalar(TEXT, "stack.engine.version") == "0.27.0"


def test_every_committed_manifest_round_trips_unchanged():
    for path in sorted(Path(__file__).resolve().parents[2].joinpath("skus").glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        version = get_scalar(text, "stack.engine.version")
        assert set_scalars(text, {"stack.engine.version": version}) == text, path.name
