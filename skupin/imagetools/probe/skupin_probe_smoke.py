"""The import smoke test: does the image's software load with no accelerator attached?

The gate runs it (the probe's `smoke` check) in the sandbox *without* the SKU's accelerator, before it boots the
image on one, and on a host that has none at all it is the last thing the gate can run (gates/gate.py: a GPU
image's gate there ends "could not run" after it). It loads, in one process:

- torch and the engine's top-level package (`import vllm`, ...);
- every extension module inside the engine's package (each ``*.so`` imported by its dotted name), so an extension
  built for another torch, Python or C++ ABI fails here, named;
- every shared library of the accelerator's runtime that the image carries as wheels: torch's own ``torch/lib``
  and the vendor's runtime wheels (``nvidia/*/lib``, ``triton/backends/*/lib``, ...), each with dlopen(RTLD_NOW), so
  a library whose dependencies or symbols do not resolve fails, named.

Nothing is judged here. Each item's outcome is "ok" or the loader's own message; the gate host decides (an item
whose only problem is a library the host's driver injects at run time, libcuda.so.1 say, is deferred to the host:
gates/judge/smoke.py). Standard library only; imports nothing of skupin.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import time
from typing import Any

# Where a site-packages folder keeps the accelerator runtime's shared libraries (glob-free, walked by hand).
RUNTIME_LIBRARY_FOLDERS = ("torch/lib", "nvidia", "triton/backends")
MAX_ITEMS = 3000  # extension modules + libraries tried, at most (a crafted image cannot make the probe run forever)
MAX_MESSAGE = 400
EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE]


def _import(name: str) -> str:
    try:
        importlib.import_module(name)
    except BaseException as exc:  # an extension may raise anything at import, SystemExit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        return _message(exc)
    return "ok"


def _import_file(name: str, path: str) -> str:
    """Load the extension module file `path` as `name` without importing its parent package first: a package whose
    __init__ wraps its extension's ImportError in its own message would hide the loader's (the library it misses)."""
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return f"ImportError: no loader for {path}"
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as exc:  # an extension may raise anything at import, SystemExit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        return _message(exc)
    return "ok"


def _walk(root: str) -> list[str]:
    """Regular files under `root`, sorted, never following a symlinked folder."""
    found: list[str] = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        found += [os.path.join(folder, f) for f in sorted(files) if not os.path.islink(os.path.join(folder, f))]
    return found


def _extension_name(path: str, top: str) -> str | None:
    """The dotted module name of the extension file `path` under the folder `top` of sys.path, or None: a file with
    an ABI-tagged suffix (.cpython-311-x86_64-linux-gnu.so, .abi3.so), or a plain .so not named like a library."""
    base = os.path.basename(path)
    suffix = next((s for s in EXTENSION_SUFFIXES if s != ".so" and base.endswith(s)), None)
    if suffix is None and base.endswith(".so") and not base.startswith("lib"):
        suffix = ".so"
    if suffix is None:
        return None
    rel = os.path.relpath(path, top)[: -len(suffix)]
    parts = rel.split(os.sep)
    return ".".join(parts) if all(p.isidentifier() for p in parts) else None


def _is_library(path: str) -> bool:
    """A shared library by its name (libfoo.so, libfoo.so.12, ...), not a Python extension."""
    base = os.path.basename(path)
    return ((base.endswith(".so") or ".so." in base) and base.startswith("lib")
            and not any(base.endswith(s) for s in EXTENSION_SUFFIXES if s != ".so"))


def _load(path: str) -> str:
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        return _message(exc)
    return "ok"


def smoke(engine_import: str, *, with_torch: bool = True, site_packages: list[str] | None = None,
          budget_s: float = 300.0) -> dict[str, Any]:
    """Import torch (unless the engine runs without it: `with_torch`) and `engine_import`, then every extension
    module of that package and every runtime library of the site-packages folders: {"imports": {name: outcome},
    "extensions": {module: outcome}, "libraries": {path: outcome}, "accelerator_visible": ..., "truncated": ...};
    an outcome is "ok" or the loader's message."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {"imports": {}, "extensions": {}, "libraries": {}, "truncated": False}
    for name in (("torch",) if with_torch else ()) + (engine_import,):
        report["imports"][name] = _import(name)
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(torch, "cuda", None)
        try:
            report["accelerator_visible"] = bool(cuda.is_available()) if cuda is not None else False
        except Exception as exc:
            report["accelerator_visible"] = _message(exc)
        version = getattr(torch, "version", None)
        report["torch_runtime"] = {k: getattr(version, k, None) for k in ("cuda", "hip", "xpu")}
    roots = site_packages if site_packages is not None else [p for p in sys.path if p.endswith("-packages")]
    count = 0
    package = sys.modules.get(engine_import)
    folder = os.path.dirname(getattr(package, "__file__", None) or "") if package is not None else ""
    runtime = [os.path.join(root, sub) for root in roots for sub in RUNTIME_LIBRARY_FOLDERS]
    # the engine's own folder: its extensions imported, its libraries loaded; then the runtime's libraries
    for base in ([folder] if folder else []) + runtime:
        if not os.path.isdir(base) or os.path.islink(base):
            continue
        for path in _walk(base):
            module = _extension_name(path, os.path.dirname(folder)) if base == folder else None
            if module is None and not _is_library(path):
                continue
            if (module is not None and module in sys.modules) or path in report["libraries"]:
                continue
            if count >= MAX_ITEMS or time.perf_counter() - t0 > budget_s:
                report["truncated"] = True
                break
            count += 1
            if module is not None:
                report["extensions"][module] = _import_file(module, path)
            else:
                report["libraries"][path] = _load(path)
    report["wall_s"] = round(time.perf_counter() - t0, 3)
    return report
