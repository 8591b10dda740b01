"""skupin: per-SKU LLM inference images, pinned and gated against NVIDIA reference tensors."""

__version__ = "0.1.0"
