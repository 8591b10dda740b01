"""The image's software bill of materials: a CycloneDX 1.6 JSON BOM of every Python distribution and Debian package in it.

Read from the image's layers as the Docker engine stores them, never by running the image
(`image_inventory`: the same merged file view the gate's `pins` check walks, skupin/imageview/layers.py,
from the layer-index cache that check filled, so a publish right after a gate reads no layer again):

- Python: every `<name>-<version>.dist-info/METADATA` anywhere in the image. One directly in a
  `site-packages` or `dist-packages` folder is an installed distribution; one deeper (such as
  setuptools' `_vendor/`) is a vendored copy inside another distribution's files, listed with the
  property `skupin:vendored` = `true`. An installed distribution that the lock pins at the same
  version carries the locked wheel's sha256 (the lock's, from the file the build installed), and the
  property `skupin:lock-file`;
- Debian: every installed package of `/var/lib/dpkg/status` (read with the gate's parser,
  skupin/imageview/debian.py), with its architecture; the purl's namespace and `distro` qualifier come from
  the image's `/etc/os-release` (`debian`, `debian-12`).

Everything is bounded and checked (names, versions, counts, file sizes): a name that is not a
distribution's or a package's is an error naming the file, not a component. The document
(`build_bom`) is made with the maintained `cyclonedx-python-lib` and validated against the CycloneDX
1.6 JSON schema that library ships (skupin/publishing/bomschema.py: jsonschema's Draft 7 validator, as the library's
own validator applies it, with a format checker of the four formats that schema uses; `verify` validates with the
same one and never imports the library). It is deterministic for one image: the serial number is a UUID
derived from the image's manifest digest, the timestamp is the publish time passed in, components,
properties and dependencies are sorted, and every bom-ref is derived from the component (a purl, or
for a Python distribution the path of its dist-info folder, which is unique).
"""

from __future__ import annotations

import json
import re
import uuid
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import Field

from skupin.builder.catalog.lockfile import Lock
from skupin.common import __version__
from skupin.common.errors import PublishError
from skupin.common.model import Frozen
from skupin.common.untrusted import UntrustedInputError
from skupin.imageview.debian import DEBIAN_ARCH, DEBIAN_NAME, parse_status
from skupin.imageview.layers import FileView, image_view
from skupin.publishing.bomschema import bom_schema_error

if TYPE_CHECKING:
    from collections.abc import Callable

    from cyclonedx.model import Property
    from packageurl import PackageURL

    from skupin.dockerd import Docker

SPEC_VERSION = "1.6"
MAX_COMPONENTS = 50_000
MAX_STATUS_BYTES = 32 * 1024**2
MAX_OS_RELEASE_BYTES = 64 * 1024
DIST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,198}[A-Za-z0-9])?$")
DEBIAN_VERSION = re.compile(r"^[0-9A-Za-z.+~:-]{1,256}$")
OS_FIELD = re.compile(r"^[a-z0-9._-]{1,32}$")
INSTALL_FOLDERS = ("site-packages", "dist-packages")
SERIAL_NAMESPACE = uuid.UUID("7d0b5a3c-5c1f-5a4e-9d35-0e6f1a2b3c4d")  # skupin's namespace for BOM serial numbers


class PythonDistribution(Frozen):
    """A dist-info folder of the image."""

    name: str = Field(description="The normalised name (PEP 503)")
    version: str
    path: str = Field(description="The dist-info folder, relative to /")
    vendored: bool = Field(description="Inside another distribution's files, not directly in a site-packages folder")


class DebianPackage(Frozen):
    """An installed package of the image's dpkg status file."""

    name: str
    version: str
    arch: str


class ImageInventory(Frozen):
    """What the image's files say is installed in it (sorted)."""

    python: tuple[PythonDistribution, ...] = ()
    debian: tuple[DebianPackage, ...] = ()
    os_id: str = Field("debian", description="ID of /etc/os-release (the deb purls' namespace)")
    os_version: str | None = Field(None, description="VERSION_ID of /etc/os-release")


# ---------------------------------------------------------------- reading the image


def read_inventory(view: FileView) -> ImageInventory:
    """The Python distributions and Debian packages of a merged file view (nothing of it is run or trusted unbounded)."""
    python = sorted({_distribution(path) for path, entry in view.entries.items()
                     if entry.kind == "f" and path.endswith(".dist-info/METADATA")},
                    key=lambda d: (d.name, d.version, d.path))
    debian = sorted(_debian_packages(view), key=lambda p: (p.name, p.arch, p.version))
    if len(python) + len(debian) > MAX_COMPONENTS:
        raise PublishError(f"the image lists {len(python)} Python distributions and {len(debian)} Debian packages, "
                           f"more than the {MAX_COMPONENTS} an SBOM may hold")
    os_id, os_version = _os_release(view)
    return ImageInventory(python=tuple(python), debian=tuple(debian), os_id=os_id, os_version=os_version)


def _distribution(metadata: str) -> PythonDistribution:
    folder = metadata.rsplit("/", 1)[0]
    parent, _, leaf = folder.rpartition("/")
    name, _, version = leaf.removesuffix(".dist-info").rpartition("-")
    if not DIST_NAME.match(name) or len(version) > 128:
        raise PublishError(f"/{folder}: not a distribution's dist-info folder (<name>-<version>.dist-info); "
                           "nothing was pushed")
    try:
        Version(version)
    except InvalidVersion as exc:
        raise PublishError(f"/{folder}: the version {version!r} of its folder name is not a Python version; "
                           "nothing was pushed") from exc
    return PythonDistribution(name=str(canonicalize_name(name)), version=version, path=folder,
                              vendored=parent.rsplit("/", 1)[-1] not in INSTALL_FOLDERS)


def _debian_packages(view: FileView) -> set[DebianPackage]:
    path = "var/lib/dpkg/status"
    if view.get(path) is None:
        return set()  # no dpkg in the image: no Debian packages
    try:
        text = view.read_file(path, max_bytes=MAX_STATUS_BYTES).decode("utf-8")
    except (UntrustedInputError, UnicodeDecodeError) as exc:
        raise PublishError(f"/{path}: unreadable: {exc}; nothing was pushed") from exc
    found = set()
    for pkg in parse_status(text):
        for field, value, pattern in (("Package", pkg.name, DEBIAN_NAME), ("Architecture", pkg.arch, DEBIAN_ARCH),
                                      ("Version", pkg.version, DEBIAN_VERSION)):
            if not value or not pattern.match(value):
                raise PublishError(f"/{path}: package {pkg.name[:64]!r}: field {field} {value[:64]!r} is not a Debian "
                                   f"{field.lower()}; nothing was pushed")
        found.add(DebianPackage(name=pkg.name, version=pkg.version, arch=pkg.arch))
    return found


def _os_release(view: FileView) -> tuple[str, str | None]:
    """(ID, VERSION_ID) of the image's /etc/os-release (a link into /usr/lib is followed inside the image)."""
    path = view.resolve("etc/os-release")
    if path is None or view.get(path) is None:
        return "debian", None
    try:
        text = view.read_file(path, max_bytes=MAX_OS_RELEASE_BYTES).decode("utf-8", "replace")
    except UntrustedInputError:
        return "debian", None
    values = {k.strip(): v.strip().strip("\"'") for k, _, v in (ln.partition("=") for ln in text.splitlines())}
    os_id = values.get("ID", "")
    os_version = values.get("VERSION_ID", "")
    return (os_id if OS_FIELD.match(os_id) else "debian"), (os_version if OS_FIELD.match(os_version) else None)


def image_inventory(*, docker: Docker, image_id: str, cache: Path,
                    on_event: Callable[[str], None] = lambda _s: None) -> ImageInventory:
    """The inventory of local image `image_id`, read from its layers (the layer-index cache under `cache` is the one
    the gate's `pins` check fills)."""
    info = docker.inspect_image(image_id)
    if info is None:
        raise PublishError(f"image {image_id} is not on this engine; nothing was pushed")
    try:
        view = image_view(docker=docker, image=info.id, layers=info.layers, cache=cache, on_event=on_event)
    except UntrustedInputError as exc:
        raise PublishError(f"the layers of {image_id[:19]} cannot be read for its SBOM: {exc}; nothing was pushed") from exc
    return read_inventory(view)


# ---------------------------------------------------------------- the document


def _timestamp(text: str) -> datetime:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError as exc:
        raise PublishError(f"the SBOM's timestamp {text!r} is not YYYY-MM-DDTHH:MM:SSZ") from exc


def serial_number(digest: str) -> uuid.UUID:
    """The BOM's serial number: a name-based UUID (v5) of the image's manifest digest."""
    return uuid.uuid5(SERIAL_NAMESPACE, digest)


def image_purl(*, registry: str, repository: str, digest: str) -> PackageURL:
    """pkg:oci/<name>@sha256:...?repository_url=<registry>/<repository> (the purl spec's oci type)."""
    from packageurl import PackageURL

    return PackageURL(type="oci", name=repository.rsplit("/", 1)[-1].lower(), version=digest,
                      qualifiers={"repository_url": f"{registry}/{repository}"})


def _props(pairs: dict[str, str]) -> list[Property]:
    from cyclonedx.model import Property

    return [Property(name=k, value=v) for k, v in sorted(pairs.items())]


def build_bom(inventory: ImageInventory, *, registry: str, repository: str, digest: str, image_id: str,
              timestamp: str, lock: Lock | None = None, sku: str | None = None) -> dict[str, Any]:
    """The CycloneDX 1.6 JSON BOM (as a dict) of an image pushed as `registry/repository@digest` (see the module doc)."""
    # the library only where a BOM is written: `verify` reads one back without it (skupin/publishing/bomschema.py)
    from cyclonedx.model import HashAlgorithm, HashType
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.model.tool import ToolRepository
    from cyclonedx.output.json import JsonV1Dot6
    from packageurl import PackageURL

    hexpart = digest.removeprefix("sha256:")
    if not digest.startswith("sha256:") or not re.fullmatch(r"[0-9a-f]{64}", hexpart):
        raise PublishError(f"not a sha256 digest: {digest!r}")
    purl = image_purl(registry=registry, repository=repository, digest=digest)
    image_props = {"skupin:image-id": image_id}
    if sku:
        image_props["skupin:sku"] = sku
    if lock is not None:
        image_props["skupin:lock-sha256"] = lock.content_hash()
    image = Component(type=ComponentType.CONTAINER, name=repository, version=digest, purl=purl,
                      bom_ref=purl.to_string(), hashes=[HashType(alg=HashAlgorithm.SHA_256, content=hexpart)],
                      properties=_props(image_props))
    locked = lock.packages() if lock is not None else {}
    components = []
    for dist in inventory.python:
        props = {"skupin:path": "/" + dist.path}
        hashes = []
        pin = locked.get(dist.name)
        if not dist.vendored and pin is not None and pin.filename.endswith(".whl") and _same(pin.version, dist.version):
            hashes = [HashType(alg=HashAlgorithm.SHA_256, content=pin.sha256)]
            props["skupin:lock-file"] = pin.filename
        if dist.vendored:
            props["skupin:vendored"] = "true"
        components.append(Component(
            type=ComponentType.LIBRARY, name=dist.name, version=dist.version, hashes=hashes, properties=_props(props),
            purl=PackageURL(type="pypi", name=dist.name, version=dist.version), bom_ref=f"pypi:/{dist.path}"))
    qualifiers = {"distro": f"{inventory.os_id}-{inventory.os_version}"} if inventory.os_version else {}
    for pkg in inventory.debian:
        deb = PackageURL(type="deb", namespace=inventory.os_id, name=pkg.name, version=pkg.version,
                         qualifiers={"arch": pkg.arch, **qualifiers})
        components.append(Component(type=ComponentType.LIBRARY, name=pkg.name, version=pkg.version, purl=deb,
                                    bom_ref=deb.to_string(), properties=_props({"skupin:arch": pkg.arch})))
    tools = ToolRepository(components=[Component(type=ComponentType.APPLICATION, name="skupin", version=__version__,
                                                 bom_ref=f"skupin@{__version__}")])
    bom = Bom(serial_number=serial_number(digest), components=components,
              metadata=BomMetaData(timestamp=_timestamp(timestamp), component=image, tools=tools))
    bom.register_dependency(image, components)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the library warns about things this BOM does not use (licenses)
        text = JsonV1Dot6(bom).output_as_string()
    doc: dict[str, Any] = json.loads(text)
    problem = bom_schema_error(doc)
    if problem:
        raise PublishError(f"the SBOM made for {digest[:19]} is not valid CycloneDX {SPEC_VERSION}: {problem}")
    return doc


def _same(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


# ---------------------------------------------------------------- reading a (signed) BOM back


class BomSummary(Frozen):
    """What `verify` and `inspect` report of a verified SBOM."""

    spec_version: str
    serial_number: str
    timestamp: str
    image: str = Field(description="The metadata component's version: the image digest the BOM describes")
    python: int = Field(description="Installed Python distributions (pkg:pypi, not vendored)")
    python_vendored: int = Field(description="Vendored copies of distributions inside others (pkg:pypi)")
    debian: int = Field(description="Debian packages (pkg:deb)")
    components: int
    tool: str = ""

    def line(self) -> str:
        vendored = f" (+{self.python_vendored} vendored)" if self.python_vendored else ""
        return f"{self.python} Python distributions{vendored}, {self.debian} Debian packages"


def bom_summary(doc: Any) -> BomSummary:
    """The summary of a CycloneDX JSON BOM (PublishError when it is not one this module could have written)."""
    if not isinstance(doc, dict) or doc.get("bomFormat") != "CycloneDX":
        raise PublishError("the SBOM is not a CycloneDX JSON document (bomFormat)")
    if doc.get("specVersion") != SPEC_VERSION:
        raise PublishError(f"the SBOM's specVersion is {str(doc.get('specVersion'))[:20]!r}, not {SPEC_VERSION}")
    problem = bom_schema_error(doc)
    if problem:
        raise PublishError(f"the SBOM is not valid CycloneDX {SPEC_VERSION}: {problem}")
    components = doc.get("components") or []
    metadata = doc.get("metadata") or {}
    counts = {"python": 0, "python_vendored": 0, "debian": 0}
    for c in components:
        purl = str(c.get("purl") or "")
        vendored = any(p.get("name") == "skupin:vendored" and p.get("value") == "true" for p in c.get("properties") or ())
        if purl.startswith("pkg:pypi/"):
            counts["python_vendored" if vendored else "python"] += 1
        elif purl.startswith("pkg:deb/"):
            counts["debian"] += 1
    block = metadata.get("tools")
    tools = [f"{t.get('name')} {t.get('version')}" for t in (block.get("components") or () if isinstance(block, dict) else ())]
    return BomSummary(spec_version=SPEC_VERSION, serial_number=str(doc.get("serialNumber") or ""),
                      timestamp=str(metadata.get("timestamp") or ""),
                      image=str((metadata.get("component") or {}).get("version") or ""), components=len(components),
                      tool=", ".join(tools), **counts)
