"""Plan the CI matrix (pure): which runner kind builds and gates each SKU, and why a SKU is left out.

GitHub runs what this plans (`.github/workflows/images.yml`, docs/guide-ci-point-releases.md):

- CPU SKUs build and gate on GitHub-hosted runners (`ubuntu-latest`, `ubuntu-24.04-arm` for arm64): their
  images need no accelerator and fit a hosted runner's disk;
- accelerator SKUs build on a labelled self-hosted build runner (`[self-hosted, linux, <arch>, build]`: their
  CUDA/ROCm/XPU bases and wheels outgrow a hosted runner's disk, and engines built from git need hours) and
  gate on a self-hosted runner of their hardware class (`[self-hosted, linux, <arch>, gpu, <hardware_class>]`).

A SKU is in the matrix only when its build can start on its runner: a current lock (a missing, stale or
malformed one is `excluded`, with the reason), and a source for every locked wheel that runner reaches (a
wheel locked from a wheelhouse needs its recorded download URL, or the wheelhouse on that runner). A SKU
whose content-addressed version tag is already published is `current`: rebuilding it would make the same
image, so a push rebuilds exactly the SKUs whose lock or locked Dockerfile changed, however many at once, and
a rerun after a failure retries only what is still unpublished.

A SKU whose gate would end `uncalibrated` (no calibrated tolerance for its key: exit 14, never a pass; the caller
says which, `uncalibrated`) is kept off GPU runners, `excluded` with why, unless `include_uncalibrated`: its run
there could publish nothing. A CPU SKU's gate runs on a hosted or Docker runner, where such a run still shows that it
builds and boots: it stays in, marked `calibrated: false`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from skupin.builder.catalog.families import ALL_FAMILIES
from skupin.builder.catalog.stack import ResolvedStack
from skupin.common.model import Frozen

if TYPE_CHECKING:
    from skupin.builder.catalog.manifest import SkuManifest

HOSTED = {"linux/amd64": "ubuntu-latest", "linux/arm64": "ubuntu-24.04-arm"}
ARCH = {"linux/amd64": "x64", "linux/arm64": "arm64"}


class Excluded(Frozen):
    """A SKU left out of the matrix, and why."""

    sku: str
    reason: str


class Current(Frozen):
    """A SKU whose version tag is already published: nothing to rebuild."""

    sku: str
    tag: str


class MatrixPlan(Frozen):
    """`include` is GitHub's `strategy.matrix`; `excluded` and `current` say why the other SKUs are not in it."""

    include: tuple[dict, ...]
    excluded: tuple[Excluded, ...] = ()
    current: tuple[Current, ...] = ()

    def strategy(self) -> dict:
        """The `strategy.matrix` object (only `include`: any other key would become a matrix dimension)."""
        return {"include": list(self.include)}


def hosted(platform: str) -> bool:
    return platform in HOSTED


def runner_labels(manifest: SkuManifest) -> dict[str, list[str]]:
    """runs-on labels of the build and the gate job of one SKU."""
    platform = manifest.base.platform
    arch = ARCH.get(platform, platform.rsplit("/", 1)[-1])
    accelerated = ALL_FAMILIES[manifest.base.family].accelerated
    if not accelerated and hosted(platform):
        return {"build": [HOSTED[platform]], "gate": [HOSTED[platform]]}
    build = ["self-hosted", "linux", arch, "build"]
    if not accelerated:
        return {"build": build, "gate": ["self-hosted", "linux", arch, "docker"]}
    return {"build": build, "gate": ["self-hosted", "linux", arch, "gpu", manifest.accelerator.hardware_class]}


def unbuildable(stack: ResolvedStack, *, wheelhouse: Path | None) -> str | None:
    """Why the SKU's build cannot start on its runner (None when it can)."""
    if stack.lock_state == "unlocked":
        return f"no lock ({stack.lock_note})"
    if stack.lock_state != "ok" or stack.lock is None:
        return f"stale lock ({stack.lock_note})"
    lock = stack.lock
    if lock.base.kind == "bootstrap" and lock.base.diff_id is None:  # what builder/base.py: check_locked_base refuses
        return (f"the lock records no identity of its bootstrapped base (base.diff_id); fix: skupin lock "
                f"{stack.manifest.name} (it makes or finds the base and records its layer)")
    missing = []
    for pkg in (*lock.packages().values(), *lock.build):
        if pkg.url and pkg.url.startswith(("https://", "http://")):
            continue
        if wheelhouse is not None and (wheelhouse / pkg.filename).is_file():
            continue
        missing.append(pkg.filename)
    if missing:
        where = f"not in the wheelhouse {wheelhouse}" if wheelhouse is not None else "the runner has no wheelhouse"
        return (f"no wheel source reachable: {', '.join(sorted(missing))} locked without a download URL and "
                f"{where}; fix: give its wheelhouse source a `url` and relock (docs/guide-ci-point-releases.md)")
    return None


def plan_matrix(stacks: Iterable[ResolvedStack], *, wheelhouse: Path | None = None,
                version_tag: Callable[[ResolvedStack], str] | None = None,
                published: Callable[[str, str], bool] | None = None,
                uncalibrated: Callable[[ResolvedStack], str | None] | None = None,
                include_uncalibrated: bool = False) -> MatrixPlan:
    """The matrix for `stacks` (each checked with its lock).

    With `published(sku, tag)` (and `version_tag(stack)`), a SKU whose version tag is already published is
    `current`, not rebuilt. With `uncalibrated(stack)` (why its gate would end 'uncalibrated', or None), such a SKU is
    excluded from GPU runners unless `include_uncalibrated`.
    """
    include: list[dict] = []
    excluded: list[Excluded] = []
    current: list[Current] = []
    for stack in sorted(stacks, key=lambda s: s.manifest.name):
        m = stack.manifest
        why = unbuildable(stack, wheelhouse=wheelhouse)
        if why is not None:
            excluded.append(Excluded(sku=m.name, reason=why))
            continue
        tag = version_tag(stack) if version_tag is not None else None
        if tag is not None and published is not None and published(m.name, tag):
            current.append(Current(sku=m.name, tag=tag))
            continue
        labels = runner_labels(m)
        why_uncalibrated = uncalibrated(stack) if uncalibrated is not None else None
        if why_uncalibrated and ALL_FAMILIES[m.base.family].accelerated and not include_uncalibrated:
            excluded.append(Excluded(sku=m.name, reason=(
                f"its gate would end 'uncalibrated' (exit 14, never a pass), so a GPU runner would publish nothing: "
                f"{why_uncalibrated}; to run it there anyway (a build for `skupin calibrate`): --include-uncalibrated")))
            continue
        include.append({
            "sku": m.name,
            "vendor": m.accelerator.vendor,
            "hardware_class": m.accelerator.hardware_class,
            "platform": m.base.platform,
            "engine": f"{m.stack.engine.name}=={m.stack.engine.version}",
            "lock_sha256": stack.lock.content_hash() if stack.lock is not None else "",
            "hosted": labels["build"] == labels["gate"] and labels["build"][0] != "self-hosted",
            "build_runner": labels["build"],
            "gate_runner": labels["gate"],
            "calibrated": not why_uncalibrated,
        })
    return MatrixPlan(include=tuple(include), excluded=tuple(excluded), current=tuple(current))


def summary_markdown(plan: MatrixPlan) -> str:
    """The plan as a job summary: what is built where, what is current, what is left out and why."""
    lines = ["## SKU matrix", "", "| SKU | build runner | gate runner |", "|---|---|---|"]
    lines += [f"| `{e['sku']}` | `{', '.join(e['build_runner'])}` | `{', '.join(e['gate_runner'])}` |"
              for e in plan.include]
    if not plan.include:
        lines.append("| (nothing to build) | | |")
    if plan.current:
        lines += ["", "Already published (not rebuilt): " + ", ".join(f"`{c.sku}:{c.tag}`" for c in plan.current)]
    if plan.excluded:
        lines += ["", "| left out | why |", "|---|---|"]
        lines += [f"| `{e.sku}` | {e.reason.replace('|', '/')} |" for e in plan.excluded]
    return "\n".join(lines) + "\n"
