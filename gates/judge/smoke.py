"""Judge the import smoke test (the probe's `smoke` check, skupin/imagetools/probe/skupin_probe_smoke.py) on the host.

The probe loaded torch, the engine, every extension module of the engine's package and every runtime library the
image carries as wheels, in the sandbox with no accelerator attached, and reported each outcome as "ok" or the
loader's message. Here each outcome becomes one of:

- **ok**: it loaded;
- **host**: it could not load only because a library the host's driver injects at run time is missing (the
  family's declared `host_libraries`, builder/catalog/families.py: libcuda.so.1 and the like): deferred to a host
  with the accelerator, where the boot check loads it for real;
- **broken**: anything else (a missing library the image should carry, an undefined symbol, an extension built for
  another torch or Python, an exception at import). One broken item fails the check, named.

torch and the engine's top-level package must import: a failure there is broken whatever the message says (the
engine cannot even be asked what it needs), and so is a report that does not name them (`expected`: the host says what
the probe was asked to import, the report does not). The report comes from inside the image: the host bounds and
escapes what it copies into the verdict, and trusts only that the image's own interpreter said so (an image that
forges its report can pass this test; the smoke test is a functional check, the boot and numeric checks follow).
The test cannot see what only runs on the accelerator: kernels, the driver's JIT of PTX, the collective library's
transport; the boot and later checks do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from skupin.common.untrusted import printable
from skupin.gates.integrity.binaries import BinaryRules
from skupin.gates.judge.verdict import CheckResult

# The loader's words for a library it did not find ("libcuda.so.1: cannot open shared object file: ..."), in dlopen's
# messages and in the ImportError of an extension module that links it.
# A name starts where the run of name characters starts and is taken whole (possessive): linear in the message, which
# the image writes (the old pattern backtracked cubically: 8 KB of "a.so" took a second, a megabyte forever).
_NOT_FOUND = re.compile(r"(?<![\w.+-])([\w.+-]++): cannot open shared object file")
_LIBRARY = re.compile(r"[\w.+-]+?\.so(?:\.\w+)*")
MAX_OUTCOME = 4000  # characters of one outcome (the probe sends at most 400): a longer one is no loader message
_SHOWN = 12  # broken items listed in the details


def _missing(outcome: str) -> list[str]:
    """The libraries the loader's message `outcome` says it did not find (none for a message over MAX_OUTCOME)."""
    if len(outcome) > MAX_OUTCOME:
        return []
    return [name for name in _NOT_FOUND.findall(outcome) if _LIBRARY.fullmatch(name)]


def classify(outcome: str, host_libraries: Iterable[str]) -> tuple[str, str]:
    """("ok" | "host" | "broken", the library the host must bring for "host", else '')."""
    if outcome == "ok":
        return "ok", ""
    missing = _missing(outcome)
    if missing and all(name in set(host_libraries) for name in missing):
        return "host", missing[0]
    return "broken", ""


def _declared(outcome: str, path: str, rules: BinaryRules, host_libraries: Iterable[str]) -> str:
    """Why the library `path` may fail to load with `outcome`: every library it misses is the host's or declared
    optional for it in gates/data/binaries.yaml (the binaries check's `unresolved` entries); '' otherwise."""
    missing = _missing(outcome)
    rel = path.lstrip("/")
    whys = []
    for name in missing:
        if name in set(host_libraries):
            continue
        rule = next((d for d in rules.unresolved if d.covers(rel, name)), None)
        if rule is None:
            return ""
        whys.append(rule.why)
    return whys[0] if whys else ""


def _plain(value: Any) -> bool | str | None:
    """A value of the image's report as the verdict may hold it: a bool, None, or escaped text of 300 characters."""
    return value if value is None or isinstance(value, bool) else printable(str(value), 300)


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        else None


def _broken_imports(imports: Mapping[Any, Any], expected: tuple[str, ...]) -> list[str]:
    """torch and the engine itself: each of `expected` must be in the report, and nothing there is deferred."""
    broken = [f"import {name}: not in the smoke report (the probe was asked to import it)"
              for name in expected if name not in imports]
    return broken + [f"import {printable(str(name), 100)}: {printable(str(outcome), 300)}"
                     for name, outcome in imports.items() if str(outcome) != "ok"]


def judge_smoke(report: Mapping[str, Any], *, host_libraries: tuple[str, ...], family: str,
                expected: tuple[str, ...] = (), rules: BinaryRules | None = None) -> CheckResult:
    """The smoke CheckResult from the probe's smoke report: pass when every item loaded or needs only the host's
    driver (or, for a runtime library, a library `rules` declares optional for it, as the binaries check does) and
    each of `expected` (torch, the engine) imported; fail naming the first broken one; error when the report is not
    one."""
    imports, extensions, libraries = (report.get(k) for k in ("imports", "extensions", "libraries"))
    if not all(isinstance(x, dict) for x in (imports, extensions, libraries)):
        return CheckResult(name="smoke", status="error", reason="the probe's smoke report is malformed")
    assert isinstance(imports, dict) and isinstance(extensions, dict) and isinstance(libraries, dict)
    broken = _broken_imports(imports, expected)
    deferred: dict[str, str] = {}
    optional: dict[str, str] = {}
    counts = {"ok": 0, "host": 0, "declared": 0, "broken": 0}
    for kind, items in (("extension", extensions), ("library", libraries)):
        for name, outcome in sorted(items.items()):
            verdict, needs = classify(str(outcome), host_libraries)
            if verdict == "broken" and kind == "library" and rules is not None \
                    and (why := _declared(str(outcome), str(name), rules, host_libraries)):
                verdict, optional[str(name)] = "declared", why
            counts[verdict] += 1
            if verdict == "host":
                deferred[str(name)] = needs
            elif verdict == "broken":
                broken.append(f"{kind} {printable(str(name), 300)}: {printable(str(outcome), 300)}")
    details: dict[str, Any] = {
        "imports": {printable(str(k), 100): printable(str(v), 300) for k, v in list(imports.items())[:20]},
        "extensions": len(extensions), "libraries": len(libraries), "counts": counts, "broken": broken[:_SHOWN],
        "broken_count": len(broken),
        "needs_host_driver": {printable(k, 300): printable(v, 100) for k, v in sorted(deferred.items())[:50]},
        "declared_optional": {printable(k, 300): printable(v, 300) for k, v in sorted(optional.items())[:50]},
        "host_libraries": list(host_libraries), "accelerator_visible": _plain(report.get("accelerator_visible")),
        "truncated": bool(report.get("truncated")),
        "wall_s": _seconds(report.get("wall_s"))}
    if broken:
        more = f" (+{len(broken) - 1} more)" if len(broken) > 1 else ""
        return CheckResult(name="smoke", status="fail",
                           reason=f"with no accelerator attached the image does not load: {broken[0]}{more}",
                           details=details)
    if report.get("accelerator_visible") is True:  # the premise of the test: no accelerator attached
        return CheckResult(name="smoke", status="error", details=details,
                           reason="the smoke container saw an accelerator though none was attached (the host's "
                                  "container runtime attaches GPUs by itself): the test did not run as it says")
    if report.get("truncated"):
        return CheckResult(name="smoke", status="error", details=details,
                           reason="the smoke test stopped at its item or time limit before it loaded everything")
    return CheckResult(name="smoke", status="pass", details=details,
                       reason=f"with no accelerator attached: {', '.join(details['imports']) or 'nothing'} import, "
                              f"{counts['ok']} extension modules and runtime libraries load, {counts['host']} wait only "
                              f"for the host's {family} driver ({', '.join(sorted(set(deferred.values()))) or 'none'})"
                              + (f", {counts['declared']} are declared optional plugins (gates/data/binaries.yaml)"
                                 if counts["declared"] else ""))
