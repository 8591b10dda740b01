"""Run the whole flow for one SKU (`skupin run`): check, lock, docker, base, build, gate, registry, publish, verify.

`run_pipeline` is a straight line of the stage calls, each taking the frozen object the one before
made: resolve -> render -> build -> gate -> publish, then verify what was published. The
Dockerfile is rendered once and the verdict read once. Each stage is timed and becomes one row of
the summary; the first failure stops the run and every later stage is reported as not run. Ctrl-C
(SIGINT) stops the stage in progress: the Docker adapter removes any container it started, a build
is cancelled, and nothing is published unless the publish stage had already moved the tags (the
human tags move last, after the record). `RunSummary.table()` is the summary table the CLI prints
at the end.
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from skupin.builder.aptlock import host_facts
from skupin.builder.base import ensure_base
from skupin.builder.build import BuiltImage, build
from skupin.builder.catalog.lockfile import lock_path
from skupin.builder.catalog.stack import ResolvedStack
from skupin.builder.check import resolve
from skupin.builder.lock import default_ca_bundle, relock
from skupin.builder.render import render
from skupin.common.errors import LockError, PublishError, SkupinError
from skupin.common.model import Frozen
from skupin.common.paths import REGISTRY_ADDR, ensure_state, sku_path, state_dir
from skupin.dockerd import Docker, connect, ensure_dockerd
from skupin.gates.gate import gate
from skupin.gates.judge.verdict import GateVerdict, raise_for_verdict
from skupin.publishing.attest import find_signer
from skupin.publishing.local_registry import default_registry, registry_up
from skupin.publishing.publish import (
    PublishedImage,
    parse_target,
    publish,
    publish_target,
    write_verdict_envelope,
)
from skupin.publishing.verify import verified_image_id, verify_reference

OnEvent = Callable[[str], None]
STAGES = ("check", "lock", "docker", "base", "build", "gate", "registry", "publish", "verify")
DEFAULT_WHEELHOUSE = Path("/opt/wheels")
P = ParamSpec("P")
T = TypeVar("T")


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

    def local_wheelhouse(self) -> Path | None:
        """--wheelhouse (whose default is $SKUPIN_WHEELHOUSE), else /opt/wheels when it exists."""
        if self.wheelhouse is not None:
            return self.wheelhouse
        return DEFAULT_WHEELHOUSE if DEFAULT_WHEELHOUSE.is_dir() else None

    def trusted_ca(self) -> Path | None:
        """--ca-bundle, else the host's bundle when TLS is intercepted here."""
        return self.ca_bundle or default_ca_bundle()

    def local_registry(self) -> bool:
        """Whether this run publishes to the local registry (which it then starts)."""
        return self.registry is None or parse_target(self.registry).host == self.addr


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


class _Rows:
    """The summary rows of one run, one per stage as it ends (the result is the frozen RunSummary)."""

    def __init__(self, say: OnEvent) -> None:
        self.say = say
        self.rows: list[StageResult] = []

    def stage(self, name: str, fn: Callable[P, tuple[T, str]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run one stage, timed: its value for the next stage; its detail (or its error) goes into the row."""
        self.say(f"== {name}")
        start = time.monotonic()
        try:
            value, detail = fn(*args, **kwargs)
        except KeyboardInterrupt:
            self.rows.append(StageResult(stage=name, result="interrupted", seconds=round(time.monotonic() - start, 2)))
            raise
        except SkupinError as exc:
            self.rows.append(StageResult(stage=name, result="failed", seconds=round(time.monotonic() - start, 2),
                                         detail=exc.lines()[0][:160]))
            raise
        result = "skipped" if detail.startswith("skipped") else "ok"
        self.rows.append(StageResult(stage=name, result=result, seconds=round(time.monotonic() - start, 2),
                                     detail=detail[:160]))
        return value


def run_pipeline(*, options: RunOptions, on_event: OnEvent = _quiet) -> RunSummary:
    """Run every stage in order; never raises a SkupinError or KeyboardInterrupt (both end in the summary)."""
    rows = _Rows(on_event)
    reference: str | None = None
    error: SkupinError | None = None
    interrupted = False
    try:
        ensure_state()  # builds, gates, the registry and the signing key go there: it ignores itself for git
        reference = _flow(options, rows)
    except SkupinError as exc:
        error = exc
    except KeyboardInterrupt:
        interrupted = True
        error = SkupinError("interrupted: nothing was published after the interrupted stage")
        error.exit_code = 130
    done = {r.stage for r in rows.rows}
    stages = rows.rows + [StageResult(stage=s, result="not run") for s in STAGES if s not in done]
    return RunSummary(sku=options.sku, stages=tuple(stages), reference=reference, error=error, interrupted=interrupted)


def _flow(options: RunOptions, rows: _Rows) -> str:
    """The straight line: each stage takes what the one before made; the verified reference."""
    say = rows.say
    stack = rows.stage("check", _check, sku_path(options.sku))
    stack = rows.stage("lock", _lock, stack, options, say)
    docker = rows.stage("docker", _docker, say)
    rows.stage("base", _base, stack, docker, say)
    built = rows.stage("build", _build, stack, docker, options, say)
    verdict, envelope = rows.stage("gate", _gate, built, docker, options, say)
    rows.stage("registry", _registry, options, say)
    published = rows.stage("publish", _publish, built, verdict, envelope, docker, options, say)
    return rows.stage("verify", _verify, published, say)


def build_sku(*, options: RunOptions, on_event: OnEvent = _quiet) -> tuple[ResolvedStack, BuiltImage, Docker]:
    """The first stages of the flow for one SKU (check, lock when missing, docker, base, build; the build is
    cached when nothing changed): what `skupin ab` runs for a side it was not given an image for."""
    stack, _ = _check(sku_path(options.sku))
    stack, _ = _lock(stack, options, on_event)
    docker, _ = _docker(on_event)
    _base(stack, docker, on_event)
    built, detail = _build(stack, docker, options, on_event)
    on_event(f"build: {detail}")
    return stack, built, docker


# ---------------------------------------------------------------- the stages: (value, detail for the summary)


def _check(path: Path) -> tuple[ResolvedStack, str]:
    stack = resolve(path)
    return stack, f"{stack.manifest.name}: manifest and pins ok; lock {stack.lock_state}"


def _lock(stack: ResolvedStack, options: RunOptions, say: OnEvent) -> tuple[ResolvedStack, str]:
    """The stack with a current lock: as it is, or locked now when it had none (a stale lock is an error)."""
    path = stack.manifest_path
    if stack.lock_state == "ok":
        return stack, f"skipped: {stack.lock_note}"
    if stack.lock_state == "stale":
        raise LockError(f"{path}: the lock is stale: {stack.lock_note}")
    docker, _ = _docker(say)
    host = host_facts(manifest=stack.manifest, docker=docker, on_event=say)
    lock = relock(manifest=stack.manifest, manifest_path=path, wheelhouse=options.local_wheelhouse(), progress=say,
                  ca_bundle=options.trusted_ca(), host=host)
    return resolve(path, require_lock=True), f"wrote {lock_path(path).name} ({lock.content_hash()[:12]})"


def _docker(say: OnEvent) -> tuple[Docker, str]:
    status = ensure_dockerd(on_event=say)
    return connect(), f"docker {status.server_version}: {status.action}"


def _base(stack: ResolvedStack, docker: Docker, say: OnEvent) -> tuple[str, str]:
    image_id = ensure_base(manifest=stack.manifest, docker=docker, on_event=say)
    return image_id, f"base {image_id[:19]}"


def _build(stack: ResolvedStack, docker: Docker, options: RunOptions, say: OnEvent) -> tuple[BuiltImage, str]:
    built = build(render(stack), docker, wheelhouse=options.local_wheelhouse(), ca_bundle=options.trusted_ca(),
                  progress="plain", on_line=say, no_cache=options.no_cache, records=state_dir() / "builds")
    cached = sum(1 for layer in built.layers if layer.cached)
    return built, f"{built.image} ({built.image_id[:19]}; {cached}/{len(built.layers)} layers cached)"


def _gate(built: BuiltImage, docker: Docker, options: RunOptions,
          say: OnEvent) -> tuple[tuple[GateVerdict, bytes], str]:
    """Gate the build; the verdict and the envelope this host's key signed over it (verdict.dsse.json beside
    verdict.json: what binds the verdict to this gate run for publish)."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = state_dir() / "gates" / built.sku / stamp
    signer = find_signer(create=True, on_event=say)  # before the gate: a broken key is the first thing to fix
    baseline = _verified_baseline(built, docker, options)
    if baseline:
        say(f"serve A/B baseline: the currently verified image {baseline[:19]}")
    verdict = gate(built, docker, out=out, on_event=say, baseline=baseline, wheelhouse=options.local_wheelhouse())
    envelope = write_verdict_envelope(out, verdict, signer)
    raise_for_verdict(verdict)
    return (verdict, envelope.read_bytes()), f"{verdict.decision}: {verdict.reason[:100]} ({out / 'report.md'})"


def _verified_baseline(built: BuiltImage, docker: Docker, options: RunOptions) -> str | None:
    """The SKU's currently verified image, when this Docker daemon holds it and it is not the new build."""
    target, _, _ = publish_target(options.registry, options.addr)
    verified = verified_image_id(sku=built.sku, target=target)
    if verified and verified != built.image_id and docker.image_exists(verified):
        return verified
    return None


def _registry(options: RunOptions, say: OnEvent) -> tuple[None, str]:
    if not options.local_registry():
        return None, f"skipped: publishing to {options.registry}"
    status = registry_up(registry=default_registry(addr=options.addr), on_event=say)
    return None, f"{status.url}: {status.action}"


def _publish(built: BuiltImage, verdict: GateVerdict, envelope: bytes, docker: Docker, options: RunOptions,
             say: OnEvent) -> tuple[PublishedImage, str]:
    target, untag, hint = publish_target(options.registry, options.addr)  # after `registry up`: it knows the local one
    published = publish(built, verdict, target, docker=docker, untag=untag, registry_hint=hint, on_event=say,
                        verdict_envelope=envelope)
    return published, f"{published.reference} (push {published.push_s:.1f} s)"


def _verify(published: PublishedImage, say: OnEvent) -> tuple[str, str]:
    ref = f"{published.reference.split('@')[0]}:{published.tags[-1]}"
    result = verify_reference(ref=ref)
    say(result.line())
    if not result.ok or result.reference is None:
        raise PublishError(result.line())
    if result.digest != published.digest:
        raise PublishError(f"{ref} resolves to {result.digest}, this run published {published.digest}")
    return result.reference, result.line()[:160]
