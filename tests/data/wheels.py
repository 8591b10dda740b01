"""Test wheels: valid, reproducible pure-Python wheels made on the fly (no network, no build backend)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

EPOCH = (2020, 1, 1, 0, 0, 0)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def make_wheel(folder: Path, *, name: str, version: str, files: dict[str, bytes], requires: tuple[str, ...] = ()) -> Path:
    """A valid, reproducible pure-Python wheel of `files` (paths relative to site-packages) requiring `requires`."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                    + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode()
    contents[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: skupin-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in contents.items())
    contents[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = Path(folder) / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as whl:
        for rel, data in contents.items():
            whl.writestr(zipfile.ZipInfo(rel, date_time=EPOCH), data)
    return path
