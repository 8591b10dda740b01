"""The base families, declared once: one frozen `FamilyInfo` per family and ALL_FAMILIES, the registry everyone reads.

A family is what a SKU's `base.family` names: the Dockerfile template that builds its images, the
accelerator vendors whose SKUs it builds, how `skupin check` judges the driver pin against the torch
wheel's variant, the torch device its SKUs compute on (whether they need an accelerator host), and whether
its template can build an engine from its sdist. `Family` and `Vendor`
(the manifest's `base.family` and `accelerator.vendor`, the compatibility data's `family` fields, the
JSON schema's enums) are derived from the registry, never spelled elsewhere.

Adding a family: its row in ALL_FAMILIES, its template `templates/<family>.Dockerfile.j2` and its
compatibility row in builder/data/compat.yaml (`families`; `variants` and `torch_compiler` rows when its
SKUs install torch), then `skupin schema --write` (skus/schema.json lists the names).
tests/unit/test_families.py checks they agree; tests/unit/test_extension.py adds one that way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

# How `skupin check` judges stack.driver against the torch wheel's variant (builder/catalog/compat.py):
# - "minimum": the driver version is at least the minimum of the variant's runtime series (compat.yaml cuda_driver),
#   and a PyPI torch wheel's own runtime must be the variant's (CUDA);
# - "series": the driver version is in the variant's series (major.minor) and that series is one of the torch
#   release's (compat.yaml torch_rocm: ROCm);
# - "none": nothing beyond the driver pin's name (the variant's `driver`).
DriverCheck = Literal["minimum", "series", "none"]
# The device code its binaries carry, which the gate's binaries check reads (skupin/imageview/fatbin.py): CUDA
# fatbins (.nv_fatbin), HIP offload bundles (.hip_fatbin), or none it can read ("": the ELF closure alone).
DeviceCode = Literal["cuda", "hip", ""]
# What the NVIDIA Container Toolkit mounts into a container from the host's driver, for the capabilities the gate's
# sandbox and production ask for (compute, utility): libnvidia-container's src/nvc_info.c, `utility_libs` and
# `compute_libs`, by soname (a NEEDED names the soname). The image must not carry them (they must match the host's
# kernel driver), so a NEEDED of one resolves on the host, not in the image.
NVIDIA_HOST_LIBRARIES = (
    "libnvidia-ml.so.1", "libnvidia-cfg.so.1", "libnvidia-nscq.so.*",  # utility
    "libcuda.so.1", "libcudadebugger.so.1", "libnvidia-opencl.so.1", "libnvidia-gpucomp.so.*",  # compute
    "libnvidia-ptxjitcompiler.so.1", "libnvidia-fatbinaryloader.so.*", "libnvidia-allocator.so.1",
    "libnvidia-compiler.so.*", "libnvidia-pkcs11.so.*", "libnvidia-pkcs11-openssl3.so.*", "libnvidia-nvvm.so.4",
    "libnvidia-tileiras.so.*",
)


@dataclass(frozen=True, kw_only=True)
class FamilyInfo:
    """One base family: its vendors, its driver rule and what its template can build."""

    name: str
    vendors: tuple[str, ...]  # the accelerator vendors whose SKUs it builds (the first is the one a fix names)
    driver_check: DriverCheck
    torch_device: str  # the torch device its SKUs compute on ("cuda" serves ROCm too: torch's HIP build keeps the name)
    builds_sdist: bool = False  # its template has the build stage of stack.engine.source kind sdist
    device_code: DeviceCode = ""
    # sonames (fnmatch patterns) the container runtime mounts from the host: a NEEDED the image lacks is accepted
    # only when it is one of its family's (ROCm's, Intel's and CPU images carry their whole userspace: none)
    host_libraries: tuple[str, ...] = ()

    @property
    def accelerated(self) -> bool:
        """Whether its SKUs need an accelerator (and its driver) on the host: a GPU runner, a host driver to match."""
        return self.torch_device != "cpu"

    @property
    def template(self) -> str:
        """Its child template under templates/ (it extends base.Dockerfile.j2)."""
        return f"{self.name}.Dockerfile.j2"


ALL_FAMILIES: Final[dict[str, FamilyInfo]] = {row.name: row for row in (
    FamilyInfo(name="cuda", vendors=("nvidia",), driver_check="minimum", torch_device="cuda", device_code="cuda",
               host_libraries=NVIDIA_HOST_LIBRARIES),
    FamilyInfo(name="rocm", vendors=("amd",), driver_check="series", torch_device="cuda", device_code="hip"),
    FamilyInfo(name="xpu", vendors=("intel",), driver_check="none", torch_device="xpu"),
    FamilyInfo(name="cpu", vendors=("cpu",), driver_check="none", torch_device="cpu", builds_sdist=True),
)}
FAMILIES: Final[tuple[str, ...]] = tuple(ALL_FAMILIES)
VENDORS: Final[tuple[str, ...]] = tuple(dict.fromkeys(v for row in ALL_FAMILIES.values() for v in row.vendors))

if TYPE_CHECKING:  # a name the registry holds; pydantic sees the Literal below (its values and the schema's enum)
    Family = str
    Vendor = str
else:
    Family = Literal[FAMILIES]
    Vendor = Literal[VENDORS]


def sdist_families() -> tuple[str, ...]:
    """The families whose template builds an engine from its sdist."""
    return tuple(name for name, row in ALL_FAMILIES.items() if row.builds_sdist)
