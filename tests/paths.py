"""This checkout's folders, for tests: the repository is the catalog the tests act on."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKUS = REPO / "skus"
