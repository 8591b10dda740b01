"""Decode what the probe produced (its stdout frame or its output folder) into report and tensors, refusing anything malformed.

In the gate's containers the probe runs with ``--out -`` and writes exactly one frame to stdout
(skupin/imagetools/probe/skupin_probe.py: ``FRAME_MAGIC``, 8-byte little-endian length + probe.json, 8-byte little-endian
length + safetensors bytes). Everything in it is hostile input: ``split_frame`` checks the magic,
both lengths against their limits and the total (nothing before, nothing after);
``decode_outputs`` parses probe.json with ``untrusted.load_json`` (size and depth limits), checks
its format and the types of the fields the host reads, and decodes the tensors with
``tensorio.decode_safetensors`` (every header field validated). Every refusal is an
``UntrustedInputError`` naming what was wrong; the gate turns it into "could not run".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from skupin.common.untrusted import UntrustedInputError, load_json, open_folder, printable, read_regular_file
from skupin.gates.refdata.tensorio import MAX_FILE_BYTES, decode_safetensors
from skupin.imagetools.probe import FORMAT, FRAME_MAGIC

MAX_REPORT_BYTES = 64 * 1024**2
MAX_TENSOR_BYTES = MAX_FILE_BYTES
# A probe container's stdout cap: the frame of the tiny-llama fixture is ~8 MB; larger models need more.
MAX_FRAME_BYTES = 256 * 1024**2
REPORT_MAX_DEPTH = 16
REPORT_NAME, TENSORS_NAME = "probe.json", "tensors.safetensors"
# The fields of probe.json (and of its `env`) the host reads, with the type each must have when present.
REPORT_FIELDS: dict[str, type] = {"checks": dict, "env": dict, "args": dict, "tensors": dict, "argv": list,
                                  "device": str, "status": str}
ENV_FIELDS: dict[str, type] = {"distributions": dict, "system_packages": dict, "driver": dict, "device": dict,
                               "engines": dict, "env": dict, "settings": dict}


def split_frame(data: bytes | bytearray | memoryview, *, source: str = "the probe's stdout",
                max_report_bytes: int = MAX_REPORT_BYTES,
                max_tensor_bytes: int = MAX_TENSOR_BYTES) -> tuple[memoryview, memoryview]:
    """(probe.json bytes, safetensors bytes) of one output frame; UntrustedInputError unless `data` is exactly one frame."""
    view = memoryview(data)
    if not len(view):
        raise UntrustedInputError(f"{source}: empty (the probe wrote no output frame)")
    if bytes(view[: len(FRAME_MAGIC)]) != FRAME_MAGIC:
        at = bytes(view[: 1 << 20]).find(FRAME_MAGIC)
        where = f"{at} bytes before the output frame" if at > 0 else "no output frame at its start"
        raise UntrustedInputError(f"{source}: {where}: {printable(bytes(view[:200]).decode('utf-8', 'replace'), 200)!r}")
    report, pos = _part(view, len(FRAME_MAGIC), REPORT_NAME, max_report_bytes, source)
    tensors, pos = _part(view, pos, TENSORS_NAME, max_tensor_bytes, source)
    if pos != len(view):
        raise UntrustedInputError(f"{source}: {len(view) - pos} bytes after the end of the output frame")
    return report, tensors


def _part(view: memoryview, pos: int, name: str, limit: int, source: str) -> tuple[memoryview, int]:
    if len(view) - pos < 8:
        raise UntrustedInputError(f"{source}: the output frame is truncated before the length of {name} (byte {pos})")
    size = int.from_bytes(view[pos : pos + 8], "little")
    pos += 8
    if size > limit:
        raise UntrustedInputError(f"{source}: {name} claims {size} bytes, more than the limit of {limit}")
    if size > len(view) - pos:
        raise UntrustedInputError(f"{source}: the output frame is truncated: {name} claims {size} bytes, "
                                  f"{len(view) - pos} follow")
    return view[pos : pos + size], pos + size


def decode_report(raw: bytes | memoryview, *, source: str) -> dict[str, Any]:
    """probe.json as a dict: bounded JSON, format skupin-probe/1, the fields the host reads of the right types."""
    report = load_json(raw, source=source, max_bytes=MAX_REPORT_BYTES, max_depth=REPORT_MAX_DEPTH)
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise UntrustedInputError(f"{source}: not a {FORMAT} report")
    _check_fields(report, REPORT_FIELDS, source)
    _check_fields(report.get("env") or {}, ENV_FIELDS, f"{source}: env")
    for name, check in (report.get("checks") or {}).items():
        if not isinstance(check, dict):
            raise UntrustedInputError(f"{source}: checks.{printable(str(name), 60)} is not an object")
    for field in ("distributions", "system_packages"):
        table = (report.get("env") or {}).get(field) or {}
        if not all(isinstance(v, str) for v in table.values()):
            raise UntrustedInputError(f"{source}: env.{field} must map names to version strings")
    return report


def _check_fields(doc: dict[str, Any], fields: dict[str, type], source: str) -> None:
    for name, kind in fields.items():
        if doc.get(name) is not None and not isinstance(doc[name], kind):
            raise UntrustedInputError(f"{source}: {name} is a {type(doc[name]).__name__}, not a {kind.__name__}")


def decode_outputs(report_raw: bytes | memoryview, tensors_raw: bytes | memoryview, *,
                   source: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(probe.json, tensors) from their bytes; no tensor bytes at all means no tensors."""
    report = decode_report(report_raw, source=f"{source}: {REPORT_NAME}")
    if not len(tensors_raw):
        return report, {}
    tensors, _ = decode_safetensors(tensors_raw, source=f"{source}: {TENSORS_NAME}")
    return report, tensors


def read_output_folder(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """probe.json and tensors.safetensors of a probe's output folder (`--out DIR`), read bounded and without
    following links; a missing tensors file means no tensors."""
    fd = open_folder(folder)
    try:
        report_raw = read_regular_file(REPORT_NAME, max_bytes=MAX_REPORT_BYTES, dir_fd=fd)
        try:
            tensors_raw = read_regular_file(TENSORS_NAME, max_bytes=MAX_TENSOR_BYTES, dir_fd=fd)
        except UntrustedInputError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise
            tensors_raw = b""
    finally:
        os.close(fd)
    return decode_outputs(report_raw, tensors_raw, source=str(folder))
