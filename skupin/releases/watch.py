"""Watch for point releases each SKU's update policy allows and propose coupled bumps (optionally apply them).

For every manifest, from the index (and a registry for base images):
  - engine: the newest release the engine policy allows. If its Requires-Dist admits the current
    torch, that alone is proposed. If it needs another torch, torch (the newest release satisfying
    it) and the compiler that torch's Requires-Dist needs are proposed with it as ONE change when
    the framework and compiler policies allow; otherwise it is reported blocked, with why, and the
    newest engine release that keeps the current torch is proposed instead (if any);
  - framework alone (when no engine change is proposed): the newest torch the policy allows that
    the engine's torch requirement still admits, with the compiler it requires;
  - compiler alone: the newest release the policy allows that torch's requirement admits;
  - base image (when the driver comes from the base, e.g. ROCm userspace): the newest tag of the
    same flavour (`7.2.1-complete` -> `7.2.2-complete`) the driver policy allows, re-pinned by the
    digest the registry reports, with the driver version moved along.
Policy levels: none; patch (same major.minor); minor (same major); major (anything newer).

A bump to a torch or engine release the compatibility data does not know yet carries the rows it needs, derived
from the release's own Requires-Dist exactly as `skupin compat refresh` derives them (releases.compat_refresh), so
the same pull request adds them; a row that cannot be derived is listed as missing.

`--apply` edits the manifests in place (releases.yamledit: only the version scalars change;
comments and layout stay), adds the proposals' compatibility rows to builder/data/compat.yaml, then relocks the
SKUs whose sources are reachable (builder.lock) and lists the locks it left stale. `--json` prints the report for
machines, `--markdown` a PR body.
"""

from __future__ import annotations

import datetime
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from skupin.builder.catalog.manifest import Pin, SkuManifest, parse_manifest
from skupin.builder.lock import relock as lock_and_write
from skupin.clients.oci import RegistryClient, parse_image_ref
from skupin.clients.pypi import IndexClient
from skupin.common.errors import ManifestError, SkupinError
from skupin.common.model import Frozen
from skupin.common.paths import PYPI_SIMPLE, manifest_files
from skupin.releases.compat_refresh import applicable, engine_torch_row, torch_compiler_row
from skupin.releases.yamledit import get_scalar, set_scalars

if TYPE_CHECKING:
    from skupin.builder.aptlock import HostFacts

Progress = Callable[[str], None]


class Bump(Frozen):
    """One value moved in one manifest."""

    field: str  # dotted manifest path, e.g. stack.engine.version
    component: str  # torch, triton, vllm, base image
    old: str
    new: str


class CompatRow(Frozen):
    """A compatibility row a bump needs that the compatibility data lacks, derived from the package's own
    Requires-Dist (releases.compat_refresh, as `skupin compat refresh` derives it); --apply writes it."""

    section: str  # torch_compiler | engine_torch
    row: dict[str, str]  # the row's keys in the file's order; date as YYYY-MM-DD


class Proposal(Frozen):
    """What watch proposes for one SKU: bumps to apply together (with the compatibility rows they need), or a blocked
    release with why."""

    sku: str
    manifest: str
    state: str  # bump | blocked | error
    bumps: tuple[Bump, ...] = ()
    compat: tuple[CompatRow, ...] = ()
    compat_missing: tuple[str, ...] = ()  # rows the bump needs that could not be derived, with why
    why: str = ""


class WatchReport(Frozen):
    proposals: tuple[Proposal, ...]
    applied: tuple[str, ...] = ()
    relocked: tuple[str, ...] = ()
    stale_locks: tuple[str, ...] = ()
    compat_file: str = ""  # the compatibility file --apply added the proposals' rows to ("" when none was needed)
    notes: tuple[str, ...] = ()


# ------------------------------------------------------------------ policy


def allowed(level: str, current: Version, candidate: Version) -> bool:
    """Is `candidate` a newer release that update level `level` lets CI take from `current`?"""
    if candidate <= current or candidate.is_prerelease or candidate.is_devrelease or level == "none":
        return False
    if level == "patch":
        return candidate.release[:2] == current.release[:2]
    if level == "minor":
        return candidate.major == current.major
    return level == "major"


def _public(version: str) -> Version:
    return Version(Version(version).public)


def _with_local(new: Version, old: str) -> str:
    local = Version(old).local
    return f"{new}+{local}" if local else str(new)


class _Context:
    """The index (and registry) a watch run reads, with small caches."""

    def __init__(self, *, index_url: str | None, registry_url: str | None, ca_bundle: Path | None,
                 timeout: float, compat_path: Path | None = None) -> None:
        self.index_url, self.registry_url, self.ca_bundle, self.timeout = index_url, registry_url, ca_bundle, timeout
        self.compat_path = compat_path
        self._indexes: dict[str, IndexClient] = {}
        self._registries: dict[str, RegistryClient] = {}

    def index(self, pin: Pin) -> IndexClient:
        src = pin.source
        # a git source has neither url nor index: its dependencies come from PyPI
        url = self.index_url or getattr(src, "url", None) or getattr(src, "index", None) or PYPI_SIMPLE
        if url not in self._indexes:
            self._indexes[url] = IndexClient(url, ca_bundle=self.ca_bundle, timeout=self.timeout)
        return self._indexes[url]

    def registry(self, host: str) -> RegistryClient:
        url = self.registry_url or host
        if url not in self._registries:
            self._registries[url] = RegistryClient(url, ca_bundle=self.ca_bundle, timeout=self.timeout)
        return self._registries[url]

    def close(self) -> None:
        for index in self._indexes.values():
            index.close()
        for registry in self._registries.values():
            registry.close()

    def requires(self, pin: Pin, version: Version, dist: str) -> SpecifierSet | None:
        """The specifier the release's Linux x86_64 wheel puts on `dist` (None when it has no such requirement)."""

        reqs = applicable(self.index(pin).requires_dist(pin.distribution, version), python="3.12")
        req: Requirement | None = reqs.get(canonicalize_name(dist))
        return req.specifier if req is not None else None


# ------------------------------------------------------------------ planning one SKU


def _torch_pins(m: SkuManifest) -> tuple[Pin, Pin, Pin]:
    return m.stack.framework, m.stack.compiler, m.stack.engine


def _watchable(pin: Pin) -> bool:
    return pin.name != "none" and pin.source.kind in ("index", "wheelhouse", "git")


def _compiler_for(ctx: _Context, m: SkuManifest, torch: Version) -> tuple[str | None, str]:
    """(compiler version for `torch`, why when none): the newest release of the SKU's compiler its torch requires."""
    fw, comp, _ = _torch_pins(m)
    if not _watchable(comp):
        return None, ""
    spec = ctx.requires(fw, torch, comp.distribution)
    if spec is None:
        from skupin.builder.catalog.compat import COMPAT_PATH, load_compat

        row = load_compat(ctx.compat_path or COMPAT_PATH).torch_row(torch, m.base.family)
        if row is None or canonicalize_name(row.compiler) != canonicalize_name(comp.distribution):
            return None, f"no requirement of torch {torch} on {comp.distribution} (metadata or compatibility data)"
        spec = SpecifierSet(row.requires)
    if spec.contains(_public(comp.version), prereleases=True):
        return comp.version, ""
    found = [v for v in ctx.index(comp).versions(comp.distribution) if spec.contains(v)]
    if not found:
        return None, f"no {comp.distribution} release on the index satisfies torch {torch}'s {comp.distribution}{spec}"
    return str(max(found)), ""


def _coupled(ctx: _Context, m: SkuManifest, torch: Version, why_prefix: str) -> tuple[list[Bump], str]:
    """torch (+ compiler) bumps to reach `torch`, or the reason the policy forbids it."""
    fw, comp, _ = _torch_pins(m)
    pol = m.update_policy
    bumps: list[Bump] = []
    if torch != _public(fw.version):
        if not allowed(pol.framework, _public(fw.version), torch):
            return (
                [],
                f"{why_prefix} needs torch {torch}; framework policy '{pol.framework}' does not allow {fw.version} -> {torch}",
            )
        bumps.append(Bump(field="stack.framework.version", component=fw.distribution, old=fw.version,
                          new=_with_local(torch, fw.version)))
    new_comp, why = _compiler_for(ctx, m, torch)
    if why:
        return [], f"{why_prefix}: {why}"
    if new_comp is not None and new_comp != comp.version:
        if not allowed(pol.compiler, _public(comp.version), Version(new_comp)):
            return [], (f"{why_prefix} needs torch {torch}, which requires {comp.distribution} {new_comp}; "
                        f"compiler policy '{pol.compiler}' does not allow {comp.version} -> {new_comp}")
        bumps.append(Bump(field="stack.compiler.version", component=comp.distribution, old=comp.version, new=new_comp))
    return bumps, ""


def _engine_bumps(m: SkuManifest, version: str) -> list[Bump]:
    eng = m.stack.engine
    bumps = [Bump(field="stack.engine.version", component=eng.distribution, old=eng.version, new=version)]
    if eng.source.kind == "git" and eng.version in eng.source.ref:
        bumps.append(Bump(field="stack.engine.source.ref", component=f"{eng.distribution} git ref",
                          old=eng.source.ref, new=eng.source.ref.replace(eng.version, version)))
    return bumps


def _newest_torch(ctx: _Context, fw: Pin, spec: SpecifierSet) -> Version | None:
    found = [v for v in ctx.index(fw).versions(fw.distribution) if spec.contains(v)]
    return max(found) if found else None


def plan_engine(ctx: _Context, m: SkuManifest) -> tuple[list[Bump], str]:
    """(bumps, blocked-why) for the engine and whatever it drags along."""
    fw, _, eng = _torch_pins(m)
    level = m.update_policy.engine
    if not _watchable(eng) or level == "none":
        return [], ""
    current = Version(eng.version)
    candidates = sorted((v for v in ctx.index(eng).versions(eng.distribution) if allowed(level, current, v)),
                        reverse=True)
    blocked = ""
    torch_now = _public(fw.version) if fw.distribution == "torch" else None
    for cand in candidates:
        spec = ctx.requires(eng, cand, "torch")
        if spec is None or torch_now is None or spec.contains(torch_now, prereleases=True):
            comp_bumps, why = _coupled(ctx, m, torch_now, f"{eng.distribution} {cand}") if torch_now else ([], "")
            if not why:
                return comp_bumps + _engine_bumps(m, str(cand)), blocked
            blocked = blocked or why
            continue
        torch = _newest_torch(ctx, fw, spec)
        if torch is None:
            blocked = blocked or f"{eng.distribution} {cand} needs torch{spec}, which the index does not have"
            continue
        bumps, why = _coupled(ctx, m, torch, f"{eng.distribution} {cand}")
        if why:
            blocked = blocked or why
            continue
        return bumps + _engine_bumps(m, str(cand)), blocked
    return [], blocked


def plan_framework(ctx: _Context, m: SkuManifest) -> tuple[list[Bump], str]:
    """A torch release alone (with its compiler), when the engine's torch requirement admits it."""
    fw, _, eng = _torch_pins(m)
    level = m.update_policy.framework
    if not _watchable(fw) or fw.distribution != "torch" or level == "none":
        return [], ""
    current = _public(fw.version)
    candidates = sorted((v for v in ctx.index(fw).versions("torch") if allowed(level, current, v)), reverse=True)
    engine_spec = ctx.requires(eng, Version(eng.version), "torch") if _watchable(eng) else None
    blocked = ""
    for cand in candidates:
        if engine_spec is not None and not engine_spec.contains(cand, prereleases=True):
            blocked = blocked or f"torch {cand}: {eng.distribution} {eng.version} requires torch{engine_spec}"
            continue
        bumps, why = _coupled(ctx, m, cand, f"torch {cand}")
        if why:
            blocked = blocked or why
            continue
        return bumps, blocked
    return [], blocked


def plan_compiler(ctx: _Context, m: SkuManifest) -> list[Bump]:
    fw, comp, _ = _torch_pins(m)
    level = m.update_policy.compiler
    if not _watchable(comp) or not _watchable(fw) or fw.distribution != "torch" or level == "none":
        return []
    spec = ctx.requires(fw, _public(fw.version), comp.distribution)
    if spec is None:
        return []
    current = _public(comp.version)
    found = [v for v in ctx.index(comp).versions(comp.distribution) if allowed(level, current, v) and spec.contains(v)]
    if not found:
        return []
    return [Bump(field="stack.compiler.version", component=comp.distribution, old=comp.version, new=str(max(found)))]


_TAG = re.compile(r"^(?P<version>\d+(?:\.\d+)*)(?P<rest>.*)$")


def plan_base(ctx: _Context, m: SkuManifest) -> list[Bump]:
    """A newer tag of the same flavour of the base image, when the driver comes from the base image."""
    drv = m.stack.driver
    if m.base.image is None or drv.source.kind != "base" or m.update_policy.driver == "none":
        return []
    ref = parse_image_ref(m.base.image)
    match = _TAG.match(ref.tag or "")
    if not match:
        return []
    current, rest = Version(match["version"]), match["rest"]
    reg = ctx.registry(ref.registry)
    found = []
    for tag in reg.list_tags(ref.repository):
        tm = _TAG.match(tag)
        if tm and tm["rest"] == rest:
            try:
                v = Version(tm["version"])
            except InvalidVersion:
                continue
            if allowed(m.update_policy.driver, current, v):
                found.append((v, tag))
    if not found:
        return []
    version, tag = max(found)
    digest = reg.resolve(ref.repository, tag)
    old_ref = m.base.image
    new_ref = old_ref.split("@")[0].rsplit(":", 1)[0] + f":{tag}@{digest}"
    bumps = [Bump(field="base.image", component="base image", old=old_ref, new=new_ref)]
    if drv.version == match["version"]:
        bumps.append(Bump(field="stack.driver.version", component=drv.name, old=drv.version, new=str(version)))
    return bumps


def plan_compat(ctx: _Context, m: SkuManifest, bumps: list[Bump]) -> tuple[list[CompatRow], list[str]]:
    """(rows, missing): the compatibility rows the bumped torch and engine releases need that the data lacks, derived
    from each release's own Requires-Dist as `skupin compat refresh` derives them; `missing`: those it could not
    derive, with why (then `skupin check` stops the bump with exit 3 until a row is added by hand)."""
    from skupin.builder.catalog.compat import COMPAT_PATH, load_compat

    data = load_compat(ctx.compat_path or COMPAT_PATH)
    moved = {b.field: b.new for b in bumps}
    fw, _, eng = _torch_pins(m)
    today = datetime.date.today()
    rows: list[CompatRow] = []
    missing: list[str] = []
    if "stack.framework.version" in moved and fw.distribution == "torch" and m.base.family == "cuda":
        torch = _public(moved["stack.framework.version"])
        if data.torch_row(torch, "cuda") is None:
            row = torch_compiler_row(ctx.index(fw), torch, today=today, python="3.12", skipped=missing)
            if row is not None:
                rows.append(CompatRow(section="torch_compiler", row={k: str(v) for k, v in row.items()}))
    if "stack.engine.version" in moved and _watchable(eng):
        version = Version(moved["stack.engine.version"])
        if data.engine_row(eng.distribution, version) is None:
            row = engine_torch_row(ctx.index(eng), eng.distribution, version, today=today, python="3.12",
                                   skipped=missing)
            if row is not None:
                rows.append(CompatRow(section="engine_torch", row={k: str(v) for k, v in row.items()}))
    return rows, missing


def write_compat(path: Path, rows: tuple[CompatRow, ...]) -> None:
    """Put `rows` into the compatibility file at `path` (comments and other rows kept), validated before it is
    written; the process's cached compatibility data is dropped so that relock and check read the new rows."""
    import yaml
    from pydantic import ValidationError

    from skupin.builder.catalog.compat import CompatData, load_compat
    from skupin.common.errors import CompatError
    from skupin.releases.compat_refresh import add_row

    text = path.read_text(encoding="utf-8")
    for r in rows:
        row: dict[str, object] = dict(r.row)
        row["date"] = datetime.date.fromisoformat(r.row["date"])
        text = add_row(text=text, section=r.section, row=row)
    try:
        CompatData.model_validate(yaml.safe_load(text))
    except ValidationError as exc:
        raise CompatError(f"{path}: the derived rows would not validate: {exc}") from exc
    path.write_text(text, encoding="utf-8")
    load_compat.cache_clear()


def plan_sku(ctx: _Context, m: SkuManifest, path: Path) -> Proposal:
    """Everything the policy allows for one SKU, as one proposal (or blocked / error with why)."""
    try:
        engine, blocked = plan_engine(ctx, m)
        bumps = list(engine)
        if not any(b.field == "stack.framework.version" for b in bumps):
            fw_bumps, fw_blocked = plan_framework(ctx, m) if not engine else ([], "")
            bumps += fw_bumps
            if not engine and not fw_bumps:
                bumps += plan_compiler(ctx, m)
            blocked = blocked or fw_blocked
    except SkupinError as exc:
        return Proposal(sku=m.name, manifest=str(path), state="error", why=str(exc))
    try:
        bumps += plan_base(ctx, m)
    except SkupinError as exc:
        if not bumps:
            return Proposal(sku=m.name, manifest=str(path), state="error", why=f"base image: {exc}")
        blocked = "; ".join(filter(None, [blocked, f"base image not checked: {exc}"]))
    if bumps:
        try:
            compat, missing = plan_compat(ctx, m, bumps)
        except SkupinError as exc:
            compat, missing = [], [f"compatibility rows not derived: {exc}"]
        return Proposal(sku=m.name, manifest=str(path), state="bump", bumps=tuple(bumps), compat=tuple(compat),
                        compat_missing=tuple(missing), why=blocked)
    return Proposal(sku=m.name, manifest=str(path), state="blocked" if blocked else "current", why=blocked)


# ------------------------------------------------------------------ applying


def _description(text: str, bumps: tuple[Bump, ...]) -> dict[str, str]:
    """The description with each bumped version token replaced, when it appears exactly once."""

    try:
        desc = get_scalar(text, "description")
    except SkupinError:
        return {}
    new = desc
    for b in bumps:
        if b.field.endswith(".version") and len(re.findall(rf"(?<![\w.]){re.escape(b.old)}(?![\w.])", new)) == 1:
            new = re.sub(rf"(?<![\w.]){re.escape(b.old)}(?![\w.])", b.new, new)
    return {"description": new} if new != desc else {}


def apply_proposal(proposal: Proposal) -> tuple[Path, SkuManifest]:
    """Rewrite one manifest in place: only the bumped scalars (and the description's version tokens)
    change. Returns the path and the rewritten manifest, validated before it replaced the file."""

    path = Path(proposal.manifest)
    text = path.read_text(encoding="utf-8")
    values = {b.field: b.new for b in proposal.bumps}
    values.update(_description(text, proposal.bumps))
    new_text = set_scalars(text, values)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp_dir:
        tmp = Path(tmp_dir) / path.name  # same name: parse_manifest checks name == file stem
        tmp.write_text(new_text, encoding="utf-8")
        manifest, problems = parse_manifest(tmp)
        if manifest is None or problems:
            raise ManifestError(f"{path}: the bump would make the manifest invalid", tuple(problems))
        tmp.replace(path)
    return path, manifest


Relock = Callable[[SkuManifest, Path], None]


def relock(manifest: SkuManifest, path: Path, *, wheelhouse: Path | None = None, index_url: str | None = None,
           host: HostFacts | None = None) -> None:
    """Lock one SKU with builder.lock (raises LockError when its sources are unreachable); `index_url` is the mirror
    watch asked (`--index-url`), so the lock resolves against the same index that offered the release; `host`: the
    base's layer and the apt versions (builder/aptlock.py), as `skupin lock` records them."""

    lock_and_write(manifest=manifest, manifest_path=path, wheelhouse=wheelhouse, index_url=index_url, host=host)


def _shown(path: Path) -> str:
    """`path` relative to the current folder when it is under it (a pull-request body names repository paths)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def watch(*, paths: list[Path], index_url: str | None = None, registry_url: str | None = None,
          apply: bool = False, relock_fn: Relock | None = None, ca_bundle: Path | None = None,
          timeout: float = 30.0, compat_path: Path | None = None) -> WatchReport:
    """Plan every SKU under `paths`; with `apply`, edit manifests, add the compatibility rows the bumps need to
    `compat_path` (default builder/data/compat.yaml) and relock with `relock_fn` (None: leave stale)."""

    from skupin.builder.catalog.compat import COMPAT_PATH

    compat_path = compat_path or COMPAT_PATH
    ctx = _Context(index_url=index_url, registry_url=registry_url, ca_bundle=ca_bundle, timeout=timeout,
                   compat_path=compat_path)
    proposals: list[Proposal] = []
    notes: list[str] = []
    try:
        for path in manifest_files(paths):
            manifest, problems = parse_manifest(path)
            if manifest is None:
                notes.append(f"{path}: skipped, invalid manifest ({len(problems)} problem(s))")
                continue
            proposals.append(plan_sku(ctx, manifest, path))
    finally:
        ctx.close()
    applied, relocked, stale = [], [], []
    compat_file = ""
    if apply:
        for p in proposals:
            if p.state != "bump":
                continue
            path, manifest = apply_proposal(p)
            applied.append(p.sku)
            if p.compat:
                write_compat(compat_path, p.compat)
                compat_file = _shown(compat_path)
            if relock_fn is None:
                stale.append(f"{p.sku}: not relocked (run `skupin lock {p.sku}`)")
                continue
            try:
                relock_fn(manifest, path)
                relocked.append(p.sku)
            except SkupinError as exc:
                stale.append(f"{p.sku}: {str(exc).splitlines()[0]}")
    return WatchReport(proposals=tuple(proposals), applied=tuple(applied), relocked=tuple(relocked),
                       stale_locks=tuple(stale), compat_file=compat_file, notes=tuple(notes))


# ------------------------------------------------------------------ reports


def markdown(report: WatchReport) -> str:
    """A pull-request body: one section per SKU with a bump, the blocked ones with why, stale locks."""
    bumps = [p for p in report.proposals if p.state == "bump"]
    lines = ["## Point releases (skupin watch)", ""]
    if not bumps:
        lines.append("No release the update policies allow.")
    for p in bumps:
        lines += [f"### `{p.sku}`", "", "| component | from | to | field |", "|---|---|---|---|"]
        lines += [f"| {b.component} | `{b.old}` | `{b.new}` | `{b.field}` |" for b in p.bumps]
        if p.compat:
            lines += ["", "Compatibility rows the bump needs, from each release's own Requires-Dist "
                          "(as `skupin compat refresh` derives them):", ""]
            lines += [f"- `{r.section}`: {_row_text(r)}" for r in p.compat]
        if p.compat_missing:
            lines += ["", "Compatibility rows still missing (add them by hand; `skupin check` exits 3 until then):", ""]
            lines += [f"- {m}" for m in p.compat_missing]
        if p.why:
            lines += ["", f"Not taken: {p.why}"]
        lines.append("")
    blocked = [p for p in report.proposals if p.state in ("blocked", "error")]
    if blocked:
        lines += ["### Blocked or failed", ""] + [f"- `{p.sku}` ({p.state}): {p.why}" for p in blocked] + [""]
    if report.applied:
        lines += [f"Applied to: {', '.join(report.applied)}.", ""]
    if report.compat_file:
        lines += [f"Compatibility rows added to `{report.compat_file}`.", ""]
    if report.relocked:
        lines += [f"Relocked: {', '.join(report.relocked)}.", ""]
    if report.stale_locks:
        lines += ["Locks left stale (relock where the sources are reachable):", ""]
        lines += [f"- {s}" for s in report.stale_locks] + [""]
    lines += ["Every image is rebuilt and re-gated against the reference before it is published."]
    return "\n".join(lines) + "\n"


def _row_text(r: CompatRow) -> str:
    what = f"torch {r.row['torch']} -> triton{r.row['requires']}" if r.section == "torch_compiler" else \
        f"{r.row['engine']} {r.row['version']} -> torch{r.row['torch']}"
    return f"{what} ({r.row['source']})"


def text_report(report: WatchReport) -> list[str]:
    lines = []
    for p in report.proposals:
        if p.state == "bump":
            moves = ", ".join(f"{b.component} {b.old} -> {b.new}" for b in p.bumps if b.field != "base.image")
            if any(b.field == "base.image" for b in p.bumps):
                moves += (", " if moves else "") + "base image re-pinned"
            lines.append(f"bump     {p.sku:<24} {moves}" + (f"  (not taken: {p.why})" if p.why else ""))
            lines += [f"compat   {p.sku:<24} {r.section}: {_row_text(r)}" for r in p.compat]
            lines += [f"compat   {p.sku:<24} missing: {m}" for m in p.compat_missing]
        else:
            lines.append(f"{p.state:<8} {p.sku:<24} {p.why}".rstrip())
    lines += [f"applied  {s}" for s in report.applied] + [f"relocked {s}" for s in report.relocked]
    lines += [f"stale    {s}" for s in report.stale_locks] + list(report.notes)
    return lines
