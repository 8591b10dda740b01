"""What every part of skupin shares: the error hierarchy, frozen models, where the catalog and the state live, apt."""

__version__ = "0.1.0"
