"""The probe, as skupin's own process imports it (the gate's host side, the bench, the tests).

The probe itself is this folder's modules, which import nothing of skupin: skupin_probe.py (the entry point and the
shared machinery) and one adapter module per engine, skupin_probe_<engine>.py (skupin_probe.ADAPTERS). In an image
the gate mounts the folder read-only and runs skupin_probe.py as a script; this file is not used there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .skupin_probe import (
    ADAPTERS,
    ENGINES,
    FORMAT,
    FRAME_MAGIC,
    PROBE_VERSION,
    Adapter,
    Collector,
    Options,
    environment,
    host_driver,
    kernel_battery,
    load_adapter,
    prompt_tensors,
    run_adapter,
    smoke_imports,
    write_safetensors,
)

__all__ = ["ADAPTERS", "ENGINES", "FORMAT", "FRAME_MAGIC", "PROBE_VERSION", "Adapter", "Collector", "Options",
           "environment", "host_driver", "kernel_battery", "load_adapter", "prompt_tensors", "run_adapter",
           "smoke_imports", "write_safetensors"]

if TYPE_CHECKING:  # every registered adapter module implements the interface (checked by mypy, not at run time)
    from . import skupin_probe_llamacpp, skupin_probe_sglang, skupin_probe_transformers, skupin_probe_vllm

    _ADAPTERS: tuple[Adapter, ...] = (skupin_probe_transformers, skupin_probe_vllm, skupin_probe_sglang,
                                      skupin_probe_llamacpp)
