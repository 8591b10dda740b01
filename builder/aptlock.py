"""Exact versions of the Debian packages a SKU's Dockerfile apt-installs, resolved at lock time from the base's apt
sources, and the identity of a bootstrapped base: what `skupin lock` learns from the Docker engine.

Each apt package the pins-only render installs (per `# layer:` section, the build stage's under BUILD_STAGE) gets
the version `apt-cache policy` names as its candidate in a throwaway container of the base after `apt-get update`
(network on: the base is ours, not an image under test). A version the manifest pins (the compiler's g++-12, a
build package, extras.system) is kept as the manifest says. The locked render installs every one as name=version,
so apt refuses to build when the archive no longer has it: the lock then is stale for this archive (relock, or point
the recipe's mirror at a snapshot, snapshot.debian.org/archive/debian/<timestamp>, for versions that stay).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from skupin.builder.base import base_diff_id, ensure_base
from skupin.builder.catalog.manifest import SkuManifest
from skupin.common.errors import DockerError, LockError
from skupin.common.model import Frozen
from skupin.dockerd import ContainerSpec, Docker

_POLICY_NAME = re.compile(r"^([a-z0-9][a-z0-9.+-]*)(?::[a-z0-9]+)?:$")
_CANDIDATE = re.compile(r"^\s+Candidate:\s+(\S+)$")
POLICY_DEADLINE_S = 300.0
OnEvent = Callable[[str], None]


class HostFacts(Frozen):
    """What a lock records from this host: the bootstrapped base's layer, the apt sources and versions."""

    diff_id: str | None = None
    apt_sources: tuple[str, ...] = ()
    system: dict[str, tuple[str, ...]]


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


POLICY_SCRIPT = (
    "set -e; mkdir -p /var/lib/apt/lists/partial /var/cache/apt/archives/partial; "
    "apt-get -qq -o APT::Sandbox::User=root update >&2; echo '--- sources'; "
    "cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | grep -E '^deb ' || true; "
    "echo '--- policy'; apt-cache policy \"$@\""
)


def resolve_candidates(*, docker: Docker, base: str, names: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the base's deb source lines, name -> candidate) read in a throwaway container of `base` after apt-get update."""
    spec = ContainerSpec(
        image=base, command=("sh", "-c", POLICY_SCRIPT, "sh", *names), user="0", network="bridge",
        tmpfs={"/tmp": "rw,size=64m", "/var/lib/apt/lists": "rw,size=512m", "/var/cache/apt": "rw,size=512m"},
        deadline_s=POLICY_DEADLINE_S, labels={"io.skupin.role": "apt-policy"},
    )
    result = docker.run(spec)
    if result.exit_code != 0 or result.overflow:
        raise LockError(f"apt-get update / apt-cache policy in {base} failed (exit {result.exit_code}"
                        f"{', ' + result.overflow if result.overflow else ''}): {result.stderr.strip()[-800:]}")
    text = result.stdout
    if "--- policy" not in text:
        raise LockError(f"apt-cache policy in {base} printed no answer")
    head, _, policy = text.partition("--- policy")
    sources = tuple(line.strip() for line in head.partition("--- sources")[2].splitlines() if line.strip())
    return sources, parse_policy(policy)


def host_facts(*, manifest: SkuManifest, docker: Docker, on_event: OnEvent) -> HostFacts:
    """The bootstrapped base's layer (the base made or found here) and every apt package of the render pinned."""
    from skupin.builder.render import apt_roots, render_manifest  # the pins-only render: what the Dockerfile apt-installs

    diff_id = base_diff_id(manifest=manifest, docker=docker, on_event=on_event)
    roots = apt_roots(render_manifest(manifest=manifest).text)
    names = tuple(dict.fromkeys(i.partition("=")[0] for items in roots.values() for i in items))
    if not names:
        return HostFacts(diff_id=diff_id, system={})
    if not docker.image_exists(manifest.base.reference):  # a registry base (a bootstrapped one was made above)
        try:
            ensure_base(manifest=manifest, docker=docker, on_event=on_event)  # pulled by digest
        except DockerError as exc:
            raise LockError(f"{manifest.name}: the base {manifest.base.reference} is not on this Docker engine and "
                            f"could not be pulled ({exc}), so the versions of its apt packages cannot be read; fix: "
                            "docker load it here, or lock with --apt manifest") from exc
    on_event(f"resolving apt versions of {' '.join(names)} in {manifest.base.reference}")
    sources, candidates = resolve_candidates(docker=docker, base=manifest.base.reference, names=names)
    return HostFacts(diff_id=diff_id, apt_sources=sources, system=pinned_system(roots, candidates, sku=manifest.name))
