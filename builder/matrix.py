"""Emit the CI matrix: one entry per SKU, with the runner labels its build and gate jobs need."""

from __future__ import annotations

from builder.manifest import SkuManifest


def runner_labels(manifest: SkuManifest) -> dict[str, list[str]]:
    """Build on BuildKit-capable runners; gate on self-hosted runners labelled by hardware class."""
    arch = "x64" if manifest.base.platform == "linux/amd64" else "arm64"
    build = ["self-hosted", "linux", arch, "buildkit"]
    if manifest.accelerator.vendor == "cpu":
        gate = ["self-hosted", "linux", arch, "docker"]
    else:
        gate = ["self-hosted", "linux", arch, "gpu", manifest.accelerator.hardware_class]
    return {"build": build, "gate": gate}


def matrix(*, manifests: list[SkuManifest]) -> dict[str, list[dict]]:
    """GitHub Actions `strategy.matrix` JSON: {"include": [one entry per SKU]}."""
    include = []
    for m in sorted(manifests, key=lambda m: m.name):
        labels = runner_labels(m)
        include.append(
            {
                "sku": m.name,
                "vendor": m.accelerator.vendor,
                "device": m.accelerator.device,
                "hardware_class": m.accelerator.hardware_class,
                "family": m.base.family,
                "platform": m.base.platform,
                "engine": f"{m.stack.engine.name}=={m.stack.engine.version}",
                "build_runner": labels["build"],
                "gate_runner": labels["gate"],
            }
        )
    return {"include": include}
