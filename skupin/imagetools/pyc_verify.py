#!/usr/bin/env python3
"""Check that bytecode files hold exactly the code their sources compile to (run with the image's own interpreter build).

Standalone on purpose (standard library only, nothing from skupin): gates/integrity/static.py runs it on
the host with an interpreter byte-identical to the image's, as an unprivileged process with
resource limits, because it unmarshals bytecode taken from an image under test.

    python3 -I -S pyc_verify.py < JOBS > RESULTS

Each job on stdin is a 4-byte little-endian header length, a JSON header {"id", "dfile", "opt"},
then the source and the bytecode file, each as an 8-byte little-endian length and the bytes.
Each result on stdout is one JSON line {"id", "ok", "why"}. A bytecode file passes when its magic
number is this interpreter's, its flags are valid, and its code object (unmarshalled) equals the
code that compiling the source at `dfile` with optimization `opt` gives: the same instructions,
constants, names, line table and nested code, recursively. The header's timestamp or source hash
is not compared: a stale header only makes Python ignore the file and compile the source itself.
Bytes are compared structurally, not byte for byte, because marshal's output depends on object
reference counts in the process that wrote it.
"""

from __future__ import annotations

import importlib.util
import json
import marshal
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import BinaryIO

MAX_FILE = 64 * 1024 * 1024


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EOFError("truncated job")
    return data


def _blob(stream: BinaryIO) -> bytes:
    size = int.from_bytes(_read(stream, 8), "little")
    if size > MAX_FILE:
        raise ValueError(f"{size} bytes is more than a source or bytecode file may have")
    return _read(stream, size)


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def same_code(got: object, want: types.CodeType) -> bool:
    """Structural equality of two code objects and all the code nested in them."""
    if not isinstance(got, types.CodeType) or got != want:
        return False
    pairs = list(zip(_codes(got), _codes(want), strict=False))
    if len(pairs) != sum(1 for _ in _codes(want)) or len(pairs) != sum(1 for _ in _codes(got)):
        return False
    return all(a.co_name == b.co_name and a.co_qualname == b.co_qualname and a.co_firstlineno == b.co_firstlineno
               and a.co_code == b.co_code and a.co_flags == b.co_flags for a, b in pairs)


def verify(source: bytes, pyc: bytes, dfile: str, opt: int) -> str:
    """'' when `pyc` is the compiled `source`, else why not."""
    if len(pyc) < 16 or pyc[:4] != importlib.util.MAGIC_NUMBER:
        return "not bytecode of this interpreter (magic number differs)"
    if int.from_bytes(pyc[4:8], "little") not in (0, 1, 3):
        return "invalid header flags"
    try:
        want = compile(source, dfile, "exec", dont_inherit=True, optimize=opt)
    except (SyntaxError, ValueError) as exc:
        return f"its source does not compile ({type(exc).__name__}), so no bytecode can be genuine"
    try:
        got = marshal.loads(pyc[16:])
    except (EOFError, ValueError, TypeError) as exc:
        return f"not valid marshal data ({exc})"
    return "" if same_code(got, want) else "its code differs from what its source compiles to"


def main() -> int:
    stdin, stdout = sys.stdin.buffer, sys.stdout
    while True:
        head = stdin.read(4)
        if not head:
            return 0
        if len(head) != 4:
            raise EOFError("truncated job")
        job = json.loads(_read(stdin, int.from_bytes(head, "little")))
        source, pyc = _blob(stdin), _blob(stdin)
        try:
            why = verify(source, pyc, str(job["dfile"]), int(job["opt"]))
        except (MemoryError, RecursionError) as exc:
            why = f"could not be checked: {type(exc).__name__}"
        stdout.write(json.dumps({"id": job["id"], "ok": not why, "why": why}) + "\n")
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
