"""Run the whole flow for one SKU (`skupin run`): check, lock, engine, base, build, gate, registry, publish, verify.

Each stage is one call into its own module, in order, timed; the first failure stops the run and
every later stage is reported as not run. Ctrl-C (SIGINT) stops the stage in progress: the engine
adapter removes any container it started, a build is cancelled, and nothing is published unless
the publish stage had already moved the tags (the human tags move last, after the record).
`RunSummary.table()` is the summary table the CLI prints at the end.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from common.errors import PublishError, SkupinError
from common.model import Frozen
from common.paths import REGISTRY_ADDR

OnEvent = Callable[[str], None]
STAGES = ("check", "lock", "engine", "base", "build", "gate", "registry", "publish", "verify")
DEFAULT_WHEELHOUSE = Path("/opt/wheels")


def _quiet(_: str) -> None:
    return None


class RunOptions(Frozen):
    """What `skupin run` was asked to do."""

    sku: str = "cpu-x86_64"
    registry: str | None = Field(None, description="host[:port][/namespace]; None = the local registry, started if needed")
    addr: str = REGISTRY_ADDR
    wheelhouse: Path | None = None
    ca_bundle: Path | None = None
    no_cache: bool = False


class StageResult(Frozen):
    """One row of the summary table."""

    stage: str
    result: str = Field(description="ok | skipped | failed | interrupted | not run")
    seconds: float = 0.0
    detail: str = ""


class RunSummary(BaseModel):
    """The stages' results; `error` is the first failure (None when everything passed)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    sku: str
    stages: tuple[StageResult, ...]
    reference: str | None = None
    error: SkupinError | None = None
    interrupted: bool = False

    def table(self) -> list[str]:
        rows = [f"{'stage':<9} {'result':<12} {'seconds':>8}  detail"]
        rows += [f"{s.stage:<9} {s.result:<12} {s.seconds:8.1f}  {s.detail}" for s in self.stages]
        total = sum(s.seconds for s in self.stages)
        verdict = "INTERRUPTED" if self.interrupted else "FAILED" if self.error else "VERIFIED"
        rows.append(f"{'total':<9} {verdict:<12} {total:8.1f}  {self.reference or ''}")
        return rows


class _Run:
    """Mutable bookkeeping for one run (kept private; the result is the frozen RunSummary)."""

    def __init__(self, options: RunOptions, on_event: OnEvent) -> None:
        self.options, self.say = options, on_event
        self.rows: list[StageResult] = []
        self.ctx: dict = {}

    def stage(self, name: str, fn: Callable[[], str]) -> None:
        self.say(f"== {name}")
        start = time.monotonic()
        try:
            detail = fn()
        except KeyboardInterrupt:
            self.rows.append(StageResult(stage=name, result="interrupted", seconds=round(time.monotonic() - start, 2)))
            raise
        except SkupinError as exc:
            self.rows.append(StageResult(stage=name, result="failed", seconds=round(time.monotonic() - start, 2),
                                         detail=exc.lines()[0][:160]))
            raise
        result = "skipped" if detail.startswith("skipped") else "ok"
        self.rows.append(StageResult(stage=name, result=result, seconds=round(time.monotonic() - start, 2), detail=detail[:160]))


def run_pipeline(*, options: RunOptions, on_event: OnEvent = _quiet) -> RunSummary:
    """Run every stage in order; never raises a SkupinError or KeyboardInterrupt (both end in the summary)."""
    run = _Run(options, on_event)
    error: SkupinError | None = None
    interrupted = False
    try:
        for name in STAGES:
            run.stage(name, lambda name=name: _STAGE_FUNCS[name](run))
    except SkupinError as exc:
        error = exc
    except KeyboardInterrupt:
        interrupted = True
        error = SkupinError("interrupted: nothing was published after the interrupted stage")
        error.exit_code = 130  # type: ignore[misc]
    done = {r.stage for r in run.rows}
    rows = run.rows + [StageResult(stage=s, result="not run") for s in STAGES if s not in done]
    return RunSummary(sku=options.sku, stages=tuple(rows), reference=run.ctx.get("reference") if error is None else None,
                      error=error, interrupted=interrupted)


# ---------------------------------------------------------------- the stages


def _check(run: _Run) -> str:
    from builder.check import resolve
    from common.paths import sku_path

    path = sku_path(run.options.sku)
    stack = resolve(path)
    run.ctx.update(path=path, stack=stack)
    return f"{stack.manifest.name}: manifest and pins ok; lock {stack.lock_state}"


def _wheelhouse(run: _Run) -> Path | None:
    if run.options.wheelhouse is not None:
        return run.options.wheelhouse
    return DEFAULT_WHEELHOUSE if DEFAULT_WHEELHOUSE.is_dir() else None


def _ca_bundle(run: _Run) -> Path | None:
    from builder.lock import default_ca_bundle

    return run.options.ca_bundle or default_ca_bundle()


def _lock(run: _Run) -> str:
    from builder.check import resolve
    from builder.lock import relock
    from builder.lockfile import lock_path
    from common.errors import LockError

    stack, path = run.ctx["stack"], run.ctx["path"]
    if stack.lock_state == "ok":
        return f"skipped: {stack.lock_note}"
    if stack.lock_state == "stale":
        raise LockError(f"{path}: the lock is stale: {stack.lock_note}")
    manifest = stack.manifest
    lock = relock(manifest=manifest, manifest_path=path, wheelhouse=_wheelhouse(run), progress=run.say,
                  ca_bundle=_ca_bundle(run))
    run.ctx["stack"] = resolve(path, require_lock=True)
    return f"wrote {lock_path(path).name} ({lock.content_hash()[:12]})"


def _engine(run: _Run) -> str:
    from dockerd import connect, ensure_dockerd

    status = ensure_dockerd(on_event=run.say)
    run.ctx["docker"] = connect()
    return f"docker {status.server_version}: {status.action}"


def _base(run: _Run) -> str:
    from builder.base import ensure_base

    image_id = ensure_base(manifest=run.ctx["stack"].manifest, docker=run.ctx["docker"], on_event=run.say)
    return f"base {image_id[:19]}"


def _build(run: _Run) -> str:
    from builder.build import build
    from builder.render import render
    from common.paths import STATE

    built = build(render(run.ctx["stack"]), run.ctx["docker"], wheelhouse=_wheelhouse(run), ca_bundle=_ca_bundle(run),
                  progress="plain", on_line=run.say, no_cache=run.options.no_cache, records=STATE / "builds")
    run.ctx["built"] = built
    cached = sum(1 for layer in built.layers if layer.cached)
    return f"{built.image} ({built.image_id[:19]}; {cached}/{len(built.layers)} layers cached)"


def _gate(run: _Run) -> str:
    from common.paths import STATE
    from gates.gate import gate_image
    from gates.verdict import raise_for_verdict

    stack = run.ctx["stack"]  # the locked stack _lock left (or re-resolved after locking)
    built = run.ctx["built"]
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(STATE) / "gates" / stack.manifest.name / stamp
    baseline = _verified_baseline(run, built.image_id)
    if baseline:
        run.say(f"serve A/B baseline: the currently verified image {baseline[:19]}")
    verdict = gate_image(stack=stack, image=built.image, docker=run.ctx["docker"], out=out, on_event=run.say,
                         baseline=baseline, wheelhouse=_wheelhouse(run))
    if not (out / "verdict.json").is_file():
        raise PublishError(f"the gate wrote no {out / 'verdict.json'}")
    run.ctx["verdict_path"] = out / "verdict.json"
    raise_for_verdict(verdict)
    return f"{verdict.decision}: {verdict.reason[:100]} ({out / 'report.md'})"


def _verified_baseline(run: _Run, image_id: str) -> str | None:
    """The SKU's currently verified image, when this engine holds it and it is not the new build."""
    from publishing.publish import publish_target
    from publishing.verify import verified_image_id

    target, _, _ = publish_target(run.options.registry, run.options.addr)
    verified = verified_image_id(sku=run.ctx["stack"].manifest.name, target=target)
    if verified and verified != image_id and run.ctx["docker"].image_exists(verified):
        return verified
    return None


def _is_local(run: _Run) -> bool:
    from publishing.publish import parse_target

    return run.options.registry is None or parse_target(run.options.registry).host == run.options.addr


def _registry(run: _Run) -> str:
    from publishing.local_registry import default_registry, registry_up

    if not _is_local(run):
        return f"skipped: publishing to {run.options.registry}"
    status = registry_up(registry=default_registry(addr=run.options.addr), on_event=run.say)
    return f"{status.url}: {status.action}"


def _publish(run: _Run) -> str:
    from publishing.publish import publish_sku

    built = run.ctx["built"]
    published = publish_sku(sku=run.options.sku, registry=run.options.registry, addr=run.options.addr,
                            verdict_path=run.ctx["verdict_path"], image=built.image_id, docker=run.ctx["docker"],
                            on_event=run.say)
    run.ctx["published"] = published
    return f"{published.reference} (push {published.push_s:.1f} s)"


def _verify(run: _Run) -> str:
    from publishing.verify import verify_reference

    published = run.ctx["published"]
    ref = f"{published.reference.split('@')[0]}:{published.tags[-1]}"
    result = verify_reference(ref=ref)
    run.say(result.line())
    if not result.ok:
        raise PublishError(result.line())
    if result.digest != published.digest:
        raise PublishError(f"{ref} resolves to {result.digest}, this run published {published.digest}")
    run.ctx["reference"] = result.reference
    return result.line()[:160]


_STAGE_FUNCS: dict[str, Callable[[_Run], str]] = {
    "check": _check, "lock": _lock, "engine": _engine, "base": _base, "build": _build, "gate": _gate,
    "registry": _registry, "publish": _publish, "verify": _verify,
}
