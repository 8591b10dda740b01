"""Read and write safetensors files with numpy, validating every header field of untrusted files.

The probe writes its outputs inside a container under test; the host reads them here. Nothing is
ever unpickled: the format is an 8-byte little-endian header length, a JSON header mapping tensor
names to ``{"dtype", "shape", "data_offsets"}`` (plus an optional ``__metadata__`` of strings),
then the raw little-endian bytes of every tensor, contiguous and without holes. ``BF16`` is
widened to float32 on reading (numpy has no bfloat16); ``write_safetensors`` can narrow float32
arrays to ``BF16`` with round-to-nearest-even.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from skupin.common.errors import BundleError
from skupin.common.untrusted import load_json, read_regular_file

# safetensors dtype name -> (numpy dtype to read the raw bytes as, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8),
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),
    "I64": ("<i8", 8),
    "I32": ("<i4", 4),
    "I16": ("<i2", 2),
    "I8": ("i1", 1),
    "U8": ("u1", 1),
    "BOOL": ("?", 1),
}
_NUMPY_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,199}$")
MAX_FILE_BYTES = 2 * 1024**3
MAX_HEADER_BYTES = 16 * 1024**2
MAX_TENSORS = 100_000
MAX_RANK = 8
HEADER_MAX_DEPTH = 4  # {name: {"shape": [...]}} is 3 deep


def bf16_round(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32."""
    return bf16_widen(bf16_bits(values))


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """The uint16 bfloat16 bit patterns of float32 values, rounded to nearest, ties to even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if np.isnan(values).any():
        raise BundleError("refusing to round NaN to bfloat16")
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype(np.uint16)


def bf16_widen(bits: np.ndarray) -> np.ndarray:
    """float32 values of uint16 bfloat16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_safetensors(
    tensors: dict[str, np.ndarray], *, metadata: dict[str, str] | None = None, bf16: Iterable[str] = ()
) -> bytes:
    """The bytes of a safetensors file holding `tensors` (names sorted; `bf16` names narrowed)."""
    as_bf16 = set(bf16)
    unknown = as_bf16 - set(tensors)
    if unknown:
        raise BundleError(f"bf16 names not among the tensors: {sorted(unknown)}")
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        if not NAME_RE.fullmatch(name):
            raise BundleError(f"tensor name {name!r} is outside the allowed grammar")
        array = np.asarray(tensors[name])
        if name in as_bf16:
            raw, dtype = bf16_bits(array.astype(np.float32)).astype("<u2").tobytes(), "BF16"
        else:
            known = _NUMPY_TO_ST.get(array.dtype.name)
            if known is None:
                raise BundleError(f"tensor {name!r}: numpy dtype {array.dtype} cannot be written")
            raw, dtype = np.ascontiguousarray(array, dtype=np.dtype(DTYPES[known][0])).tobytes(), known
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # align the data to 8 bytes, as the reference writer does
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def write_safetensors(
    path: Path, tensors: dict[str, np.ndarray], *, metadata: dict[str, str] | None = None, bf16: Iterable[str] = ()
) -> None:
    """Write `tensors` to `path` as safetensors (see encode_safetensors)."""
    Path(path).write_bytes(encode_safetensors(tensors, metadata=metadata, bf16=bf16))


def read_header(data: bytes | memoryview, *, source: str = "<bytes>") -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """Validate a safetensors header: (entries by name, metadata, start of the data section)."""
    if len(data) < 8:
        raise BundleError(f"{source}: shorter than the 8-byte header length")
    size = int.from_bytes(data[:8], "little")
    if size > MAX_HEADER_BYTES or size > len(data) - 8:
        raise BundleError(f"{source}: header length {size} is out of bounds (file has {len(data)} bytes)")
    header = load_json(data[8 : 8 + size], source=f"{source}: header", max_bytes=MAX_HEADER_BYTES,
                       max_depth=HEADER_MAX_DEPTH)  # UntrustedInputError (a BundleError) when malformed
    if not isinstance(header, dict):
        raise BundleError(f"{source}: header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise BundleError(f"{source}: __metadata__ must map strings to strings")
    if len(header) > MAX_TENSORS:
        raise BundleError(f"{source}: {len(header)} tensors exceed the limit of {MAX_TENSORS}")
    start = 8 + size
    data_len = len(data) - start
    spans = []
    for name, entry in header.items():
        _check_entry(name, entry, data_len, source)
        spans.append((*entry["data_offsets"], name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise BundleError(f"{source}: tensor {name!r} starts at {begin}, expected {position} (overlap or hole)")
        position = end
    if position != data_len:
        raise BundleError(f"{source}: data section has {data_len} bytes but tensors cover {position}")
    return header, metadata, start


def _check_entry(name: Any, entry: Any, data_len: int, source: str) -> None:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise BundleError(f"{source}: tensor name {name!r} is outside the allowed grammar")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise BundleError(f"{source}: tensor {name!r} needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise BundleError(f"{source}: tensor {name!r} has dtype {dtype!r}, not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_count(d) for d in shape):
        raise BundleError(f"{source}: tensor {name!r} has an invalid shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise BundleError(f"{source}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise BundleError(f"{source}: tensor {name!r} offsets {offsets} fall outside the {data_len}-byte data section")
    if math.prod(shape) * DTYPES[dtype][1] != end - begin:
        raise BundleError(f"{source}: tensor {name!r} shape {shape} x {dtype} does not fill {end - begin} bytes")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**40


def decode_safetensors(data: bytes | memoryview, *, source: str = "<bytes>") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors (BF16 widened to float32) and metadata of a validated safetensors byte string."""
    header, metadata, start = read_header(data, source=source)
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        raw = np.frombuffer(data, dtype=np.dtype(DTYPES[entry["dtype"]][0]), count=math.prod(entry["shape"]),
                            offset=start + begin)
        array = bf16_widen(raw) if entry["dtype"] == "BF16" else raw.astype(raw.dtype.newbyteorder("="))
        tensors[name] = array.reshape(entry["shape"]).copy()
    return tensors, metadata


def read_safetensors(path: Path, *, max_bytes: int = MAX_FILE_BYTES) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and metadata of the safetensors file at `path`, refusing anything malformed."""
    path = Path(path)
    return decode_safetensors(read_regular_file(path, max_bytes=max_bytes), source=str(path))


def read_dtypes(path: Path) -> dict[str, str]:
    """The stored safetensors dtype of each tensor in `path` (BF16 stays visible here)."""
    header, _, _ = read_header(read_regular_file(path, max_bytes=MAX_FILE_BYTES), source=str(path))
    return {name: entry["dtype"] for name, entry in header.items()}
