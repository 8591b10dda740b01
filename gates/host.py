"""Whether this host has the accelerator a SKU's family computes on, read on the host (nothing of the image runs).

The gate asks before it checks the host's driver (`pins`) and before it boots a GPU image (`boot`): on a host
without the accelerator a GPU image's gate runs every check that needs none (reference, pins, binaries, smoke)
and then ends "could not run: no <class> accelerator here", never pass. What counts as present:

- cuda: the NVIDIA driver answers (nvidia-smi, or /proc/driver/nvidia/version): the container toolkit needs it;
- rocm: /dev/kfd, the AMD compute device every ROCm container is given;
- xpu: a DRM render node of an Intel device (/sys/class/drm/renderD*/device/vendor 0x8086);
- cpu: always.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.imagetools.probe import host_driver

INTEL_VENDOR = "0x8086"


@dataclass(frozen=True)
class HostAccelerator:
    """What the host has for one family: present or not, what was seen (or looked for), the driver it reports."""

    family: str
    present: bool
    evidence: str
    driver: dict[str, Any] = field(default_factory=dict)


def host_accelerator(family: str, *, root: Path = Path("/"),
                     driver: Callable[[], dict[str, Any]] = host_driver) -> HostAccelerator:
    """The accelerator of `family` on this host (`root` and `driver` are the host's; tests give their own)."""
    if not ALL_FAMILIES[family].accelerated:
        return HostAccelerator(family=family, present=True, evidence="a CPU family needs no accelerator")
    if family == "cuda":
        found = driver()
        version = found.get("version")
        return HostAccelerator(family=family, present=bool(version), driver=found,
                               evidence=(f"NVIDIA driver {version} ({found.get('source')})" if version else
                                         "no NVIDIA driver answers (nvidia-smi, /proc/driver/nvidia/version)"))
    if family == "rocm":
        kfd = root / "dev" / "kfd"
        present = kfd.exists() and not kfd.is_symlink()
        return HostAccelerator(family=family, present=present, driver=driver() if present else {},
                               evidence="/dev/kfd is present" if present else "no /dev/kfd (the AMD compute device)")
    if family == "xpu":
        nodes = sorted(_intel_render_nodes(root))
        return HostAccelerator(family=family, present=bool(nodes),
                               evidence=(f"Intel render node {nodes[0]}" if nodes else
                                         "no Intel DRM render node (/sys/class/drm/renderD*/device/vendor 0x8086)"))
    return HostAccelerator(family=family, present=False, evidence=f"no rule says what a {family} accelerator is")


def _intel_render_nodes(root: Path) -> list[str]:
    drm = root / "sys" / "class" / "drm"
    try:
        names = [n for n in os.listdir(drm) if n.startswith("renderD")]
    except OSError:
        return []
    found = []
    for name in names:
        try:
            with open(drm / name / "device" / "vendor", encoding="ascii") as fh:
                if fh.read(16).strip().lower() == INTEL_VENDOR:
                    found.append(name)
        except OSError:
            continue
    return found
