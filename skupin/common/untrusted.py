"""Read what an image under test produced: bounded, never following a link, never blocking on a FIFO.

Everything a container under test writes or prints is hostile input (docs/GATE.md, threat model).
These helpers are the only way the gate turns such bytes into Python values:

- ``read_regular_file(path, max_bytes=...)`` opens with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink is
  refused, a FIFO never blocks), accepts regular files only and reads at most ``max_bytes``;
- ``load_json(data, source=..., max_bytes=..., max_depth=...)`` refuses oversized or too deeply
  nested documents *before* parsing (json's recursive decoder would otherwise raise
  RecursionError or burn memory), and rejects NaN/Infinity and duplicate keys.

The host's own copies of such bytes go into host-only folders with ``write_new_file`` (created
exclusively, never through a link).

Every refusal is an ``UntrustedInputError`` (a BundleError: exit 11, "could not run") naming the
source and why, so a malformed output always ends in a verdict instead of a traceback.
"""

from __future__ import annotations

import array
import itertools
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from skupin.common.errors import BundleError

MAX_JSON_BYTES = 64 * 1024**2
MAX_JSON_DEPTH = 64
MAX_YAML_DEPTH = 64
# A string: its quote, then escapes and other bytes taken possessively (never given back, so a match is one linear
# scan) up to its closing quote or the end of the text. It always matches where it starts: an unterminated string
# is never retried from each escaped quote inside it (which made the scan quadratic).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
# Outside strings only brackets count: each opener becomes +1, each closer -1 (as a signed byte), the rest goes.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class UntrustedInputError(BundleError):
    """Bytes from an image under test were refused: too large, too deep, not JSON, a link, not a file."""


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays/objects in a JSON text, strings skipped: linear time, all of it in C (strings
    cut out in one pass, the brackets left summed), no recursion. A text that is not JSON gets some number; the
    parser refuses it afterwards anyway."""
    steps = _STRING.sub(b"", data).translate(_STEPS, _NOT_BRACKETS)
    return max(0, max(itertools.accumulate(array.array("b", steps)), default=0))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:60]!r}")
        out[key] = value
    return out


def load_json(data: bytes | bytearray | memoryview | str, *, source: str, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON with size and depth limits; UntrustedInputError naming `source` otherwise."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise UntrustedInputError(f"{source}: {len(raw)} bytes of JSON exceed the limit of {max_bytes}")
    depth = json_depth(raw)
    if depth > max_depth:
        raise UntrustedInputError(f"{source}: JSON nested {depth} levels deep, more than the limit of {max_depth}")
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UntrustedInputError(f"{source}: not valid JSON: {exc}") from exc


def load_yaml(data: bytes | str, *, source: str, max_bytes: int, max_depth: int = MAX_YAML_DEPTH) -> Any:
    """Parse a trust input's YAML (a tolerance file, a trust policy) with limits: at most `max_bytes`, nested at most
    `max_depth`, and no anchors or aliases (a few hundred bytes of aliases expand to gigabytes: the "billion laughs"),
    checked on the event stream before anything is built. Safe types only. UntrustedInputError naming `source`."""
    import yaml

    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise UntrustedInputError(f"{source}: {len(raw)} bytes of YAML exceed the limit of {max_bytes}")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML has it: ~7x faster
    try:
        text = raw.decode("utf-8")
        depth = 0
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise UntrustedInputError(f"{source}: YAML anchors and aliases are refused here (line "
                                          f"{event.start_mark.line + 1})")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > max_depth:
                    raise UntrustedInputError(f"{source}: YAML nested more than {max_depth} levels deep")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return yaml.load(text, Loader=loader)
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError, OverflowError, TypeError) as exc:
        # a value the YAML library cannot build (a date 2001-13-45, an integer of 5,000 digits) is malformed input too
        raise UntrustedInputError(f"{source}: not valid YAML: {exc}") from exc


def read_regular_file(path: Path | str, *, max_bytes: int, dir_fd: int | None = None) -> bytes:
    """The bytes of a regular file, opened without following a link and without blocking on a FIFO.

    `path` is relative to `dir_fd` when one is given (a folder opened with ``open_folder``).
    UntrustedInputError for a link, a FIFO, a device, a folder, a missing file or more than `max_bytes`.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise UntrustedInputError(f"{path}: cannot be opened as a regular file: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedInputError(f"{path}: not a regular file")
        if info.st_size > max_bytes:
            raise UntrustedInputError(f"{path}: {info.st_size} bytes exceed the limit of {max_bytes}")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew while being read
        raise UntrustedInputError(f"{path}: more than {max_bytes} bytes")
    return data


def open_folder(path: Path | str) -> int:
    """A descriptor of a real folder (not a link to one), for ``read_regular_file(name, dir_fd=...)``."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UntrustedInputError(f"{path}: not a folder: {exc.strerror or exc}") from exc


def write_new_file(name: str, data: bytes | memoryview, *, dir_fd: int, mode: int = 0o644) -> None:
    """Create `name` in the folder `dir_fd` and write `data`: exclusively (an existing file, link or FIFO of
    that name is an error, never followed or truncated). OSError when it cannot."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def printable(text: str, limit: int = 300) -> str:
    """`text` cut to `limit` characters with control characters escaped (safe for one log line)."""
    cut = text[:limit]
    escaped = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in cut)
    return escaped + ("..." if len(text) > limit else "")
