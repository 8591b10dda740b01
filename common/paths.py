"""Where the repository's data lives (skus/, templates/, gates/) and how a SKU argument becomes a file."""

from __future__ import annotations

import os
from pathlib import Path

from common.errors import ManifestError

REPO = Path(os.environ.get("SKUPIN_ROOT", Path(__file__).resolve().parents[1]))
SKUS = REPO / "skus"
TEMPLATES = REPO / "templates"
STATE = Path(os.environ.get("SKUPIN_STATE", REPO / ".skupin"))
# Defaults that CLI argument parsers need: kept here (stdlib only) so building the CLI stays light.
PYPI_SIMPLE = "https://pypi.org/simple"
REGISTRY_ADDR = "127.0.0.1:5000"  # the local registry `skupin registry up` runs


def manifest_files(paths: list[Path]) -> list[Path]:
    """Expand files and folders into manifest files (*.yaml, sorted); folders default to skus/."""
    found: list[Path] = []
    for path in paths or [SKUS]:
        if path.is_dir():
            found += sorted(p for p in path.glob("*.yaml") if p.is_file())
        else:
            found.append(path)
    return found


def sku_path(sku: str) -> Path:
    """A SKU name (skus/<name>.yaml) or a path to a manifest."""
    candidate = Path(sku)
    if candidate.suffix in (".yaml", ".yml") or os.sep in sku:
        if not candidate.is_file():
            raise ManifestError(f"{sku}: no such manifest file")
        return candidate
    path = SKUS / f"{sku}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SKUS.glob("*.yaml"))
        import difflib

        close = difflib.get_close_matches(sku, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known SKUs: {', '.join(known)}"
        raise ManifestError(f"{sku}: unknown SKU (no {path}); fix: {hint}")
    return path
