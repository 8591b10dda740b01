"""Make tampered images for the integration tests: a thin layer FROM the honest image that changes one thing.

Two kinds of change, because the gate has two kinds of defence:

- *inside the lock* (`locked_swap`): a test wheel `skupin-test-swap` whose module changes what the
  image computes (tests/integration/derived/swap.py), installed by the project's own wheel
  installer, with a test lock that names it and the image labelled with that lock's hash. The
  static `pins` check passes it, as it would pass a point release of a locked package that
  changed its numbers; the numeric checks must catch it.
- *outside the lock* (every other mode of tests/integration/derived/Dockerfile): a start-up hook,
  a lying METADATA, an extra distribution, a tampered bytecode or Debian file, a dropped binary,
  a zeroed lock label. `pins` must fail these before the image runs at all.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from skupin.builder.catalog.lockfile import Lock, LockedPackage
from skupin.builder.render import _tools
from tests.data.wheels import make_wheel

DERIVED = Path(__file__).with_name("derived")
SWAP_DIST = "skupin-test-swap"


def swap_wheel(folder: Path, mode: str) -> Path:
    """The test wheel whose module applies `mode` (see swap.py) in every Python process of the image."""
    module = (DERIVED / "swap.py").read_text(encoding="utf-8").replace('MODE = "@MODE@"', f'MODE = "{mode}"')
    return make_wheel(folder, name=SWAP_DIST, version=f"1.0+{mode.replace('-', '.')}",
                      files={"skupin_test_swap.py": module.encode(), "zz_skupin_test_swap.pth": b"import skupin_test_swap\n"})


def wheel_package(wheel: Path, *, name: str, version: str) -> LockedPackage:
    return LockedPackage(name=name, version=version, filename=wheel.name,
                         sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), source="wheelhouse")


def lock_with(lock: Lock, *packages: LockedPackage) -> Lock:
    """`lock` with `packages` added to its extras layer (what a locked test wheel needs)."""
    layers = dict(lock.layers)
    layers["extras"] = (*layers.get("extras", ()), *packages)
    return lock.model_copy(update={"layers": layers})


def write_context(context: Path, *, wheels: list[Path] = (), requirements: str = "") -> Path:
    """A build context for derived/Dockerfile: the Dockerfile, its helper files, the project's in-build
    tools (the wheel installer and pypa installer, as the real build binds them) and `wheels`."""
    context.mkdir(parents=True, exist_ok=True)
    for item in DERIVED.iterdir():
        if item.is_file():
            shutil.copy(item, context / item.name)
    for rel, text in _tools().items():
        target = context / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    folder = context / "wheels"
    folder.mkdir(exist_ok=True)
    for wheel in wheels:
        shutil.copy(wheel, folder / wheel.name)
    (context / "requirements.txt").write_text(requirements, encoding="utf-8")
    return context


def requirement(pkg: LockedPackage) -> str:
    return pkg.requirement() + "\n"
