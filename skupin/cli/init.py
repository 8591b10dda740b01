"""`skupin init [DIR]`: a starter catalog, copied from the package's own data (skupin/starter/).

What it writes (every file is a copy of one this repository ships and tests, never text written here):

    skus/cpu-x86_64.yaml            the CPU SKU's manifest (the repository's skus/cpu-x86_64.yaml)
    skus/schema.json                the manifest's JSON Schema (editors read it through the manifest's first line)
    .github/workflows/ci.yml        the repository's workflows: tests, images (build, gate, publish), watch
    .github/workflows/images.yml
    .github/workflows/watch.yml
    .gitignore                      skupin's state (.skupin/), virtual environments, Python caches

It refuses to overwrite: every existing file is named and nothing is written, unless `--force`. It never writes
through a link: a link anywhere below DIR on the way to a file it would write is refused, with or without `--force`
(each folder is opened without following links and each file created exclusively in it).
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from skupin.common.errors import SkupinError, UsageError
from skupin.common.paths import PACKAGE_ROOT

STARTER = PACKAGE_ROOT / "starter"
SKU = "cpu-x86_64"
# (where it goes in the new catalog, where it is in the package's starter folder)
FILES = (
    (f"skus/{SKU}.yaml", f"skus/{SKU}.yaml"),
    ("skus/schema.json", "skus/schema.json"),
    (".github/workflows/ci.yml", "workflows/ci.yml"),
    (".github/workflows/images.yml", "workflows/images.yml"),
    (".github/workflows/watch.yml", "workflows/watch.yml"),
)
GITIGNORE = """\
# made by `skupin init`
# skupin's state: builds, wheel store, local keys (a private signing key among them), gate reports
/.skupin/
# virtual environments and Python's caches
.venv/
venv/
__pycache__/
*.pyc
.pytest_cache/
/build/
/dist/
*.egg-info/
"""
_STEPS = (
    ("skupin check", "the manifest: grammar, arch, pins, what its gate needs"),
    (f"skupin lock {SKU}", "every Python package pinned by sha256 (--wheelhouse DIR: wheels already here)"),
    (f"skupin build {SKU}", "the image, layer by layer (a Docker engine: skupin docker up)"),
    (f"skupin gate {SKU}", "its files against the lock, then its outputs against the H200 reference"),
    (f"skupin run {SKU}", "all of it (lock, build, gate, publish, verify) in one go"),
)
NEXT = "next:\n" + "".join(f"  {command:<24} {what}\n" for command, what in _STEPS)
DESCRIPTION = f"""\
Write a starter catalog into DIR (default: the current folder): the CPU SKU's manifest skus/{SKU}.yaml and the
manifest schema, the GitHub workflows (.github/workflows/ci.yml, images.yml, watch.yml) and a .gitignore. Every file
is a copy of the one shipped inside skupin, the same the skupin repository builds and gates on every change.

A catalog is any folder holding skus/: skupin finds it from the current folder upwards (or --root DIR, $SKUPIN_ROOT).
Templates, compatibility data, the probe, the fixtures and the NVIDIA reference bundles the manifest names ship inside
skupin; a catalog holding the same relative path (templates/, gates/references/...) overrides them (docs/CATALOG.md).

Existing files are never overwritten unless --force, and a link on the way to a file is never written through."""
EXAMPLES = f"""\
examples:
  skupin init my-catalog && cd my-catalog && skupin check
  skupin init --force                  rewrite the starter files in the current folder
  cp skus/{SKU}.yaml skus/<vendor>-<device>-<engine>.yaml   then edit it (docs/guide-new-accelerator.md)
"""


def _plan(root: Path, *, force: bool) -> list[tuple[str, bytes]]:
    """The files to write (name, bytes); refuses links below `root` and, without `force`, existing files."""
    files = [(dest, (STARTER / src).read_bytes()) for dest, src in FILES] + [(".gitignore", GITIGNORE.encode())]
    links, existing, blocked = [], [], []
    for dest, _ in files:
        path = root
        parts = Path(dest).parts
        for i, part in enumerate(parts):
            path = path / part
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                break
            if stat.S_ISLNK(info.st_mode):
                links.append(str(path))
                break
            last = i == len(parts) - 1
            if not last and not stat.S_ISDIR(info.st_mode):
                blocked.append(f"{path} (not a folder)")
                break
            if last:
                if stat.S_ISREG(info.st_mode):
                    existing.append(str(path))
                else:
                    blocked.append(f"{path} (not a regular file)")
    if links:
        raise UsageError(f"{root}: refusing to write through a link: {', '.join(sorted(set(links)))}",
                         fix="remove the link(s) or choose another folder; --force never follows a link")
    if blocked:
        raise UsageError(f"{root}: in the way: {', '.join(blocked)}", fix="move them away or choose another folder")
    if existing and not force:
        raise UsageError(f"{root}: would overwrite {', '.join(existing)}",
                         fix="choose an empty folder, move those files away, or pass --force to overwrite them")
    return files


def _write(root: Path, name: str, data: bytes) -> None:
    """Write `root/name`, opening each folder below `root` without following links and creating the file afresh."""
    from skupin.common.untrusted import write_new_file

    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        *folders, filename = Path(name).parts
        for folder in folders:
            try:
                os.mkdir(folder, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            child = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
        try:
            info = os.stat(filename, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISREG(info.st_mode):
                raise SkupinError(f"{root / name}: not a regular file (it appeared while writing); nothing followed")
            os.unlink(filename, dir_fd=fd)  # --force: _plan has checked it is a regular file
        write_new_file(filename, data, dir_fd=fd)
    finally:
        os.close(fd)


def init_catalog(root: Path, *, force: bool = False) -> list[Path]:
    """Write the starter catalog into `root` (made if missing); the paths written. UsageError before writing anything
    when a file exists (without `force`) or a link or a non-folder is in the way."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    files = _plan(root, force=force)
    for name, data in files:
        _write(root, name, data)
    return [root / name for name, _ in files]


def cmd_init(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    written = init_catalog(root, force=args.force)
    if args.json:
        from skupin.cli.output import emit

        emit({"catalog": str(root.resolve()), "written": [str(p) for p in written]})
        return 0
    for path in written:
        print(f"wrote {path}")
    where = "" if root.resolve() == Path.cwd().resolve() else f" (first: cd {root})"
    print(f"a starter catalog in {root.resolve()}{where}\n{NEXT}", end="")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `init` to the skupin CLI."""
    p = subparsers.add_parser("init", help="write a starter catalog (a CPU manifest, CI workflows, .gitignore)",
                              description=DESCRIPTION, epilog=EXAMPLES + "\n" + NEXT,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", nargs="?", default=".", metavar="DIR", help="the catalog's folder, made if missing (default: .)")
    p.add_argument("--force", action="store_true", help="overwrite existing starter files (a link is still refused)")
    p.add_argument("--json", action="store_true", help="print the files written as JSON")
    p.set_defaults(func=cmd_init)
