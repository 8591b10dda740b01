"""Run the gate's binaries check (gates/integrity/binaries.py) over unpacked wheels, as if they were an image's venv.

    .venv/bin/python bench/binaries_real.py FOLDER [--family cuda] [--arch sm_90] [--system]

FOLDER holds unpacked wheels (a site-packages: torch/, nvidia/, vllm/ ...); it is placed at the venv's
site-packages of a skupin image, above a "base" layer that is, with --system, this host's own /usr/lib,
/lib and /etc/ld.so.conf* (what libc.so.6 and libstdc++.so.6 resolve to). Prints each file with device code
and the archs it carries, every finding, the declared exceptions applied, how many NEEDED were resolved as
libraries a Python process loaded first, and the time the check took (files read by ranges, as the gate does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.common.paths import PACKAGE_ROOT
from skupin.gates.integrity.binaries import check_binaries, load_rules
from skupin.imageview.layers import Entry, FileView, ReadAt

SITE = "opt/skupin/venv/lib/python3.11/site-packages"
SYSTEM = ("usr/lib", "usr/lib64", "lib", "lib64", "etc/ld.so.conf", "etc/ld.so.conf.d")


def _walk(root: Path, prefix: str, layer: int, entries: dict[str, Entry], real: dict[str, Path]) -> None:
    parts = prefix.split("/")
    for depth in range(1, len(parts) + 1):  # the folders above `prefix` (FileView.resolve walks every component)
        entries.setdefault("/".join(parts[:depth]), Entry("d", 0o755, 0, 0, layer=layer))
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            rel = f"{prefix}/{path.relative_to(root)}".strip("/")
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                entries[rel] = Entry("l", 0o777, 0, 0, target=os.readlink(path), layer=layer)
            elif stat.S_ISDIR(info.st_mode):
                entries[rel] = Entry("d", 0o755, 0, 0, layer=layer)
            elif stat.S_ISREG(info.st_mode):
                with open(path, "rb") as handle:
                    elf = handle.read(4) == b"\x7fELF"
                entries[rel] = Entry("f", stat.S_IMODE(info.st_mode), info.st_size, 0, elf=elf, layer=layer)
                real[rel] = path


def folder_view(folder: Path, *, system: bool) -> FileView:
    """A FileView of `folder` at SITE (layer 1) over, with `system`, this host's library folders (layer 0)."""
    entries: dict[str, Entry] = {}
    real: dict[str, Path] = {}
    if system:
        for top in SYSTEM:
            path = Path("/") / top
            if path.is_symlink():  # merged /usr: /lib -> usr/lib, /lib64 -> usr/lib64 (the image's own links alike)
                entries[top] = Entry("l", 0o777, 0, 0, target=os.readlink(path), layer=0)
            elif path.is_dir():
                _walk(path, top, 0, entries, real)
            elif path.is_file():
                entries[top] = Entry("f", 0o644, path.stat().st_size, 0, layer=0)
                real[top] = path
    _walk(folder, SITE, 1, entries, real)

    @contextlib.contextmanager
    def ranges(rel: str, _entry: Entry) -> Iterator[ReadAt]:
        fd = os.open(real[rel], os.O_RDONLY | os.O_NOFOLLOW)
        try:
            yield lambda offset, size: os.pread(fd, size, offset)
        finally:
            os.close(fd)

    return FileView(entries=entries, layers=("host", "wheels"), read=lambda rel, _e, limit: real[rel].read_bytes(),
                    ranges=ranges)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--family", default="cuda")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--system", action="store_true", help="this host's /usr/lib, /lib as the base layer")
    args = parser.parse_args()
    t0 = time.monotonic()
    view = folder_view(args.folder, system=args.system)
    indexed = time.monotonic() - t0
    report = check_binaries(view=view, base_layers=1, env={}, family=ALL_FAMILIES[args.family], arch=args.arch,
                            platform="linux/amd64", rules=load_rules(PACKAGE_ROOT / "gates/data/binaries.yaml"))
    for path, archs in sorted(report.archs.items()):
        print(f"archs  /{path}: {' '.join(archs)}")
    for finding in report.findings:
        print(f"FAIL   {finding.kind}: {finding.line()}")
    for line in (*report.unverifiable, *report.declared):
        print(f"note   {line}")
    print(f"preloaded NEEDED ({len(report.preloaded)}):", *report.preloaded[:10], sep="\n  ")
    print(f"host libraries: {', '.join(report.host) or 'none'}; skipped: {report.skipped}")
    print(f"{report.checked} ELF files checked, {report.needed} NEEDED resolved, {len(report.archs)} with device code, "
          f"{len(report.findings)} findings; view of {len(view.entries)} paths built in {indexed:.2f} s, "
          f"check {report.seconds:.2f} s")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
