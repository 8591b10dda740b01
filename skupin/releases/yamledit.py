"""Comment-preserving YAML edits: replace scalar values in place by their source positions, never re-dump the file.

`set_scalars(text, {"stack.engine.version": "0.27.1", "stack.engine.source.ref": "v0.27.1"})`
finds each scalar's exact span with yaml.compose (block or flow style alike), replaces only those
characters (keeping the original quoting style), and leaves every comment, blank line, key order
and indentation untouched. Paths are dotted keys; list items are `[n]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import yaml

from skupin.common.errors import ManifestError

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _parts(path: str) -> list[str | int]:
    return [int(i) if i else key for key, i in _PART.findall(path)]


def _find(node: yaml.Node, path: str) -> yaml.ScalarNode:
    current = node
    for part in _parts(path):
        if isinstance(part, int) and isinstance(current, yaml.SequenceNode) and part < len(current.value):
            current = current.value[part]
        elif isinstance(part, str) and isinstance(current, yaml.MappingNode):
            found = next((v for k, v in current.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
            if found is None:
                raise ManifestError(f"{path}: no key {part!r} in the YAML text")
            current = found
        else:
            raise ManifestError(f"{path}: {part!r} does not lead to a value")
    if not isinstance(current, yaml.ScalarNode):
        raise ManifestError(f"{path}: is not a scalar")
    return current


def _render(value: str, style: str | None, *, flow: bool) -> str:
    """The new value in the old quoting style; a plain scalar stays plain only if it reads back the same."""
    if style == "'":
        return "'" + value.replace("'", "''") + "'"
    if style == '"':
        return json.dumps(value)
    plain_ok = re.fullmatch(r"[A-Za-z0-9][^\n#]*", value) is not None and ": " not in value
    if flow and any(c in value for c in ",[]{}"):
        plain_ok = False
    if plain_ok and value == value.strip() and yaml.safe_load(f"k: {value}") == {"k": value}:
        return value
    return json.dumps(value)


def get_scalar(text: str, path: str) -> str:
    """The scalar's value at `path` (as text)."""
    return _find(yaml.compose(text), path).value


def set_scalars(text: str, values: Mapping[str, str]) -> str:
    """`text` with the scalar at each dotted path replaced by its new value; all else byte-identical."""
    root = yaml.compose(text)
    if root is None:
        raise ManifestError("empty YAML document")
    spans = []
    for path, value in values.items():
        node = _find(root, path)
        if node.style in ("|", ">"):
            raise ManifestError(f"{path}: block scalars are not edited in place")
        line_start = text.rfind("\n", 0, node.start_mark.index) + 1
        flow = any(c in text[line_start:node.start_mark.index] for c in "{[")
        spans.append((node.start_mark.index, node.end_mark.index, _render(str(value), node.style, flow=flow)))
    out = text
    for start, end, new in sorted(spans, reverse=True):
        out = out[:start] + new + out[end:]
    check = yaml.safe_load(out)
    for path, value in values.items():
        got = check
        for part in _parts(path):
            got = got[part]
        if str(got) != str(value):
            raise ManifestError(f"{path}: in-place edit read back as {got!r}, not {value!r}")
    return out
