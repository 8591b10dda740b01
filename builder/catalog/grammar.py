"""Strict grammars for every manifest value that can reach a Dockerfile or a shell."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, StringConstraints

if TYPE_CHECKING:
    from collections.abc import Callable

# Names: package, SKU, label-ish identifiers. No spaces, no shell metacharacters.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Env names as POSIX shells accept them.
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Env values and free text that may reach a Dockerfile: printable, no quotes, no $, `, \ or ;.
SAFE_VALUE_RE = re.compile(r"^[A-Za-z0-9 ._:/@+=,%-]{0,256}$")
# OCI reference pinned by digest: [registry[:port]/]path[:tag]@sha256:<64 hex>.
IMAGE_REF_RE = re.compile(
    r"^(?P<name>(?:[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"@(?P<digest>sha256:[0-9a-f]{64})$"
)
# http(s) URLs without spaces, quotes or shell metacharacters.
URL_RE = re.compile(r"^https?://[A-Za-z0-9.-]+(?::[0-9]+)?(?:/[A-Za-z0-9._~%/+:@=-]*)?$")
# git refs: tags, branches or commit ids.
GIT_REF_RE = re.compile(r"^(?!-)[A-Za-z0-9._/+-]{1,128}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# Debian-style package versions (apt pins), e.g. 12.2.0-14+deb12u1.
DEB_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]{1,63}$")
DEB_VERSION_RE = re.compile(r"^[0-9][A-Za-z0-9.+~:-]{0,63}$")
MEM_RE = re.compile(r"^[1-9][0-9]{0,5}[kmgKMG]?$")


def _pep440(value: str) -> str:
    """Accept an exact PEP 440 version (local labels allowed: 2.13.0+cpu)."""
    try:
        Version(value)
    except InvalidVersion as exc:
        raise ValueError(f"{value!r} is not a PEP 440 version (e.g. 2.13.0 or 2.13.0+cpu)") from exc
    if not re.fullmatch(r"[A-Za-z0-9.+!-]+", value):
        raise ValueError(f"{value!r} carries characters outside a plain version")
    return value


def _match(pattern: re.Pattern[str], what: str, example: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid {what} (e.g. {example})")
        return value

    return check


def has_control_chars(value: str) -> bool:
    """True when a string carries a newline, tab or any other control character."""
    return any(ord(c) < 32 or ord(c) == 127 for c in value)


Pep440 = Annotated[str, AfterValidator(_pep440)]
Name = Annotated[str, AfterValidator(_match(NAME_RE, "name", "vllm or rocm-7.2"))]
EnvName = Annotated[str, AfterValidator(_match(ENV_NAME_RE, "environment variable name", "OMP_NUM_THREADS"))]
SafeValue = Annotated[str, AfterValidator(_match(SAFE_VALUE_RE, "plain value (no quotes, $, `, \\ or ;)", "1 or /dev/kfd"))]
ImageRef = Annotated[
    str,
    AfterValidator(
        _match(IMAGE_REF_RE, "image reference pinned by digest", "docker.io/rocm/dev-ubuntu-22.04:7.2.1@sha256:<64 hex>")
    ),
]
Url = Annotated[str, AfterValidator(_match(URL_RE, "http(s) URL", "https://download.pytorch.org/whl/rocm7.2"))]
GitRef = Annotated[str, AfterValidator(_match(GIT_REF_RE, "git ref", "v0.25.0"))]
Sha256 = Annotated[str, AfterValidator(_match(SHA256_RE, "sha256 (64 lowercase hex)", "e3b0c442..."))]
DebName = Annotated[str, AfterValidator(_match(DEB_NAME_RE, "Debian package name", "g++-12"))]
DebVersion = Annotated[str, AfterValidator(_match(DEB_VERSION_RE, "Debian package version", "12.2.0-14+deb12u1"))]
MemSize = Annotated[str, AfterValidator(_match(MEM_RE, "memory size", "16g"))]
Text = Annotated[str, StringConstraints(max_length=2000), AfterValidator(lambda v: _no_control(v))]


def _no_control(value: str) -> str:
    if has_control_chars(value.replace("\n", " ")) or "\n" in value.strip():
        raise ValueError("free text must be one line without control characters")
    return value
