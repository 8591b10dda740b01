"""Exact versions of the Debian packages a SKU's Dockerfile apt-installs and of everything they pull in, resolved at
lock time from the base's apt sources, and the identity of a bootstrapped base: what `skupin lock` learns from the
Docker engine.

Each apt package the pins-only render installs (per `# layer:` section, the build stage's under BUILD_STAGE) gets
the version `apt-cache policy` names as its candidate in a throwaway container of the base after `apt-get update`
(network on: the base is ours, not an image under test). A version the manifest pins (the compiler's g++-12, a
build package, extras.system) is kept as the manifest says. In the same container `apt-get install -s
--no-install-recommends` simulates the layers cumulatively, in the order the image installs them (a build stage
alone, from the base): a layer's closure is every package its simulation unpacks that the layers before it did not
(dependencies included, at the version apt would take). The locked render installs the whole closure as
name=version, so apt picks nothing else and refuses to build when the archive no longer has a version: the lock then
is stale for this archive (`stale_version_hint` names the fix: relock, or point the recipe's mirror at a snapshot,
snapshot.debian.org/archive/debian/<timestamp>, for versions that stay).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping

from skupin.builder.base import base_diff_id, ensure_base
from skupin.builder.catalog.manifest import SkuManifest
from skupin.builder.render import BUILD_STAGE, apt_roots, render_manifest
from skupin.common.errors import DockerError, LockError
from skupin.common.model import Frozen
from skupin.dockerd import ContainerSpec, Docker

_POLICY_NAME = re.compile(r"^([a-z0-9][a-z0-9.+-]*)(?::[a-z0-9]+)?:$")
_CANDIDATE = re.compile(r"^\s+Candidate:\s+(\S+)$")
# `Inst libc6 [2.36-9+deb12u7] (2.36-9+deb12u10 Debian:12.10/stable [amd64])`: the bracket is an upgrade's old version
_INST = re.compile(r"^Inst (\S+) (?:\[[^\]]*\] )?\((\S+) ")
# apt's refusals of a name=version the archive does not serve (apt-pkg's own wording, as `apt-get install` prints it)
_NOT_SERVED = (
    re.compile(r"Version '([^']+)' for '([^']+)' was not found"),
    re.compile(r"Unable to locate package ([a-z0-9][a-z0-9.+:-]*)"),
    re.compile(r"Package '?([a-z0-9][a-z0-9.+:-]*)'? has no installation candidate"),
)
POLICY_DEADLINE_S = 300.0
OnEvent = Callable[[str], None]


class HostFacts(Frozen):
    """What a lock records from this host: the bootstrapped base's layer, the apt sources and versions."""

    diff_id: str | None = None
    apt_sources: tuple[str, ...] = ()
    system: dict[str, tuple[str, ...]]
    apt_closure: dict[str, tuple[str, ...]] | None = None


def parse_policy(text: str) -> dict[str, str]:
    """name -> candidate version from `apt-cache policy NAME...` output ('(none)' kept as it is)."""
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if found := _POLICY_NAME.match(line):
            name = found.group(1)
        elif name is not None and (found := _CANDIDATE.match(line)):
            out[name] = found.group(1)
            name = None
    return out


def pinned_system(roots: Mapping[str, tuple[str, ...]], candidates: Mapping[str, str], *, sku: str
                  ) -> dict[str, tuple[str, ...]]:
    """Every root as name=version: its own pin when it has one, else its candidate; LockError naming each without."""
    out: dict[str, tuple[str, ...]] = {}
    missing = []
    for layer, items in roots.items():
        pinned = []
        for item in items:
            name, _, version = item.partition("=")
            version = version or candidates.get(name, "")
            if not version or version == "(none)":
                missing.append(f"{name} ({layer} layer)")
                continue
            pinned.append(f"{name}={version}")
        out[layer] = tuple(pinned)
    if missing:
        raise LockError(f"{sku}: the base's apt sources have no candidate for {', '.join(missing)}; fix: check the "
                        "package names, or the base's apt sources (base.bootstrap.mirror)")
    return out


def parse_simulation(text: str) -> dict[str, str]:
    """name -> version of every package an `apt-get install -s` would unpack, from its `Inst` lines (an upgrade's old
    version, in brackets, dropped; `Conf` and `Remv` lines ignored)."""
    return {found.group(1): found.group(2) for line in text.splitlines() if (found := _INST.match(line))}


def simulation_steps(roots: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """layer -> what its simulation installs: each image layer with the roots of every layer before it (the image's
    order, the order of `roots`); a build stage (BUILD_STAGE) alone, from the base."""
    steps: dict[str, tuple[str, ...]] = {}
    below: tuple[str, ...] = ()
    for layer, items in roots.items():
        if layer == BUILD_STAGE:
            steps[layer] = items
            continue
        below = (*below, *(i for i in items if i not in below))
        steps[layer] = below
    return steps


def layer_closures(roots: Mapping[str, tuple[str, ...]], simulated: Mapping[str, Mapping[str, str]]
                   ) -> dict[str, tuple[str, ...]]:
    """layer -> name=version of every package it adds over the layers before it (sorted by name): what its cumulative
    simulation unpacks that the one before did not, or at another version. `simulated`: layer -> parse_simulation of
    its step (simulation_steps)."""
    out: dict[str, tuple[str, ...]] = {}
    before: Mapping[str, str] = {}
    for layer in roots:
        now = simulated.get(layer, {})
        base = {} if layer == BUILD_STAGE else before
        out[layer] = tuple(f"{name}={version}" for name, version in sorted(now.items()) if base.get(name) != version)
        if layer != BUILD_STAGE:
            before = now
    return out


def check_closure(system: Mapping[str, tuple[str, ...]], closure: Mapping[str, tuple[str, ...]], *, sku: str) -> None:
    """LockError when a layer's closure takes one of its locked roots at another version than `system` (apt would then
    not install what the lock says)."""
    taken: dict[str, str] = {}
    differ = []
    for layer, items in system.items():
        if layer != BUILD_STAGE:
            taken.update(item.partition("=")[::2] for item in closure.get(layer, ()))
        own = dict(item.partition("=")[::2] for item in closure.get(layer, ())) if layer == BUILD_STAGE else taken
        for item in items:
            name, _, version = item.partition("=")
            if name in own and own[name] != version:
                differ.append(f"{name} ({layer} layer: lock {version}, apt takes {own[name]})")
    if differ:
        raise LockError(f"{sku}: apt resolves the locked apt packages at other versions than their pins: "
                        f"{', '.join(differ)}; fix: pin versions the base's apt sources agree on")


POLICY_SCRIPT = (
    "set -e; mkdir -p /var/lib/apt/lists/partial /var/cache/apt/archives/partial; "
    "apt-get -qq -o APT::Sandbox::User=root update >&2; echo '--- sources'; "
    "cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | grep -E '^deb ' || true; "
    "echo '--- policy'; apt-cache policy \"$@\""
)
SIMULATE = "; echo '--- simulate {layer}'; apt-get install -s --no-install-recommends {items} 2>&1 || echo '--- failed'"


def apt_script(steps: Mapping[str, tuple[str, ...]]) -> str:
    """POLICY_SCRIPT, then one `apt-get install -s` per step (each printed under `--- simulate <layer>`)."""
    return POLICY_SCRIPT + "".join(
        SIMULATE.format(layer=layer, items=" ".join(shlex.quote(i) for i in items)) for layer, items in steps.items())


def _sections(text: str) -> dict[str, str]:
    """The script's output by its `--- ` headers (the text before the first under '')."""
    out: dict[str, list[str]] = {"": []}
    key = ""
    for line in text.splitlines():
        if line.startswith("--- ") and line != "--- failed":
            key = line[4:]
            out[key] = []
        else:
            out[key].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def resolve_candidates(*, docker: Docker, base: str, names: tuple[str, ...],
                       steps: Mapping[str, tuple[str, ...]] | None = None
                       ) -> tuple[tuple[str, ...], dict[str, str], dict[str, dict[str, str]]]:
    """(the base's deb source lines, name -> candidate, layer -> what its simulated install unpacks) read in a
    throwaway container of `base` after apt-get update; `steps` (simulation_steps) are simulated, none without."""
    spec = ContainerSpec(
        image=base, command=("sh", "-c", apt_script(steps or {}), "sh", *names), user="0", network="bridge",
        tmpfs={"/tmp": "rw,size=64m", "/var/lib/apt/lists": "rw,size=512m", "/var/cache/apt": "rw,size=512m"},
        deadline_s=POLICY_DEADLINE_S, labels={"io.skupin.role": "apt-policy"},
    )
    result = docker.run(spec)
    if result.exit_code != 0 or result.overflow:
        raise LockError(f"apt-get update / apt-cache policy in {base} failed (exit {result.exit_code}"
                        f"{', ' + result.overflow if result.overflow else ''}): {result.stderr.strip()[-800:]}")
    sections = _sections(result.stdout)
    if "policy" not in sections:
        raise LockError(f"apt-cache policy in {base} printed no answer")
    sources = tuple(line.strip() for line in sections.get("sources", "").splitlines() if line.strip())
    simulated: dict[str, dict[str, str]] = {}
    for layer in steps or {}:
        text = sections.get(f"simulate {layer}")
        if text is None or "--- failed" in text.splitlines():
            errors = [line for line in (text or "").splitlines() if line.startswith("E: ")] or ["no answer"]
            raise LockError(f"apt-get install -s of the {layer} layer's packages in {base} failed: {'; '.join(errors)}")
        simulated[layer] = parse_simulation(text)
    return sources, parse_policy(sections["policy"]), simulated


def host_facts(*, manifest: SkuManifest, docker: Docker, on_event: OnEvent) -> HostFacts:
    """The bootstrapped base's layer (the base made or found here), every apt package of the render pinned, and each
    layer's apt closure."""
    diff_id = base_diff_id(manifest=manifest, docker=docker, on_event=on_event)
    roots = apt_roots(render_manifest(manifest=manifest).text)  # the pins-only render: what the Dockerfile apt-installs
    names = tuple(dict.fromkeys(i.partition("=")[0] for items in roots.values() for i in items))
    if not names:
        return HostFacts(diff_id=diff_id, system={}, apt_closure={})
    if not docker.image_exists(manifest.base.reference):  # a registry base (a bootstrapped one was made above)
        try:
            ensure_base(manifest=manifest, docker=docker, on_event=on_event)  # pulled by digest
        except DockerError as exc:
            raise LockError(f"{manifest.name}: the base {manifest.base.reference} is not on this Docker engine and "
                            f"could not be pulled ({exc}), so the versions of its apt packages cannot be read; fix: "
                            "docker load it here, or lock with --apt manifest") from exc
    on_event(f"resolving apt versions of {' '.join(names)} and their dependencies in {manifest.base.reference}")
    sources, candidates, simulated = resolve_candidates(docker=docker, base=manifest.base.reference, names=names,
                                                        steps=simulation_steps(roots))
    system = pinned_system(roots, candidates, sku=manifest.name)
    closure = layer_closures(roots, simulated)
    check_closure(system, closure, sku=manifest.name)
    on_event("apt closure: " + ", ".join(f"{layer} {len(items)}" for layer, items in closure.items()))
    return HostFacts(diff_id=diff_id, apt_sources=sources, system=system, apt_closure=closure)


def stale_version_hint(log: list[str], *, sku: str) -> str:
    """The fix for a build whose apt archive no longer serves a locked version ('' when `log` shows no such refusal):
    which package and version, relock, or a snapshot mirror for versions that stay."""
    missing: list[str] = []
    for line in log:
        for pattern in _NOT_SERVED:
            if found := pattern.search(line):
                what = f"{found.group(2)}={found.group(1)}" if found.lastindex == 2 else found.group(1)
                if what not in missing:
                    missing.append(what)
    if not missing:
        return ""
    return (f"\nthe apt archive no longer serves {', '.join(missing)}, which the lock of {sku} pins (a Debian point "
            f"release moved it on); fix: `skupin lock {sku} --keep-python` remakes the lock's apt part from today's "
            "archive and keeps its Python packages, or point the bootstrap recipe's mirror (base.bootstrap.mirror) at "
            "http://snapshot.debian.org/archive/debian/<timestamp>, a time the locked versions were served")
