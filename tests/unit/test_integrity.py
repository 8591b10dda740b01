"""The static integrity rules on a synthetic image: a base layer, Debian packages and one locked wheel.

Each test starts from an image whose files are exactly its lock (no finding) and changes one thing.
The bytecode verifier is a stand-in here (tests/unit/test_pyc_verify.py checks the real one).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from skupin.builder.catalog.lockfile import Lock, LockedBase, LockedPackage
from skupin.builder.imageconfig import ImageConfig
from skupin.gates.integrity.static import Finding, ImageLayout, _HashingDestination, check_integrity, upstream_version
from skupin.imageview.debian import DpkgRecords, parse_alternatives, parse_md5sums, parse_status, relations
from skupin.imageview.layers import Entry, FileView, LayerIndex, merge, scan_layer_tar
from tests.data.wheels import make_wheel

LAYOUT = ImageLayout()
SITE = LAYOUT.site
PATH = f"/{LAYOUT.venv}/bin:/usr/local/bin:/usr/bin:/bin"
# What the rendered Dockerfile gives (builder/imageconfig.py), and the image config that matches it.
EXPECTED = ImageConfig(env=(("PATH", PATH), ("VIRTUAL_ENV", f"/{LAYOUT.venv}"), ("LANG", "C.UTF-8")), cmd=("serve",),
                       shell=("/bin/bash", "-c"))
CONFIG = {"Env": [f"PATH={PATH}", f"VIRTUAL_ENV=/{LAYOUT.venv}", "LANG=C.UTF-8"], "Cmd": ["serve"], "Entrypoint": None,
          "WorkingDir": "", "User": "", "Shell": ["/bin/bash", "-c"], "Volumes": None, "OnBuild": None}
TIMEOUT = b"\x7fELF timeout"
# The base's own dpkg status (layer 0): coreutils, which owns /usr/bin/timeout.
BASE_STATUS = """Package: coreutils
Status: install ok installed
Architecture: amd64
Version: 9.1-1

"""
STATUS = BASE_STATUS + """Package: python3.11
Status: install ok installed
Architecture: amd64
Version: 3.11.2-6+deb12u8
Depends: python3.11-minimal (= 3.11.2-6+deb12u8), libpython3.11-stdlib (= 3.11.2-6+deb12u8), media-types | mime-support

Package: libpython3.11-stdlib
Status: install ok installed
Architecture: amd64
Version: 3.11.2-6+deb12u8

Package: python3.11-minimal
Status: install ok installed
Architecture: amd64
Version: 3.11.2-6+deb12u8
Conffiles:
 /etc/python3.11/sitecustomize.py 0123456789abcdef0123456789abcdef

Package: removed-one
Status: deinstall ok config-files
Architecture: amd64
Version: 1
"""


class Image:
    """Files by layer (0 = the locked base, 1 = above it), turned into a FileView that keeps the base's own view."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, bytes, int]] = {}
        self.links: dict[str, tuple[int, str]] = {}
        self.base_files: dict[str, tuple[int, bytes, int]] = {}
        self.base_links: dict[str, tuple[int, str]] = {}

    def add(self, path: str, data: bytes, *, layer: int = 1, mode: int = 0o644) -> None:
        self.files[path] = (layer, data, mode)
        self.links.pop(path, None)
        if layer == 0:
            self.base_files[path] = (layer, data, mode)

    def link(self, path: str, target: str, *, layer: int = 1) -> None:
        self.links[path] = (layer, target)
        self.files.pop(path, None)
        if layer == 0:
            self.base_links[path] = (layer, target)

    @staticmethod
    def _entries(files, links) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        for path, (layer, data, mode) in files.items():
            entries[path] = Entry("f", mode, len(data), 0, hashlib.sha256(data).hexdigest(),
                                  hashlib.md5(data).hexdigest(), "", data[:4] == b"\x7fELF", layer)
        for path, (layer, target) in links.items():
            entries[path] = Entry("l", 0o777, 0, 0, target=target, layer=layer)
        for path in list(entries):  # the folders of every path, as a real layer has them
            parts = path.split("/")
            for i in range(1, len(parts)):
                entries.setdefault("/".join(parts[:i]), Entry("d", 0o755, 0, 0, layer=0))
        return entries

    def view(self) -> FileView:
        upper = {p: d for p, (_, d, _) in self.files.items()}
        lower = {p: d for p, (_, d, _) in self.base_files.items()}
        return FileView(entries=self._entries(self.files, self.links), layers=("l0", "l1"),
                        read=lambda rel, e, _m: (lower if e.layer == 0 else upper)[rel],
                        bottom=self._entries(self.base_files, self.base_links))


def _installed(wheel: Path) -> dict[str, bytes]:
    """What installing `wheel` into the image's venv writes (path -> bytes), with the gate's own installer run."""
    out: dict[str, bytes] = {}

    class Capture(_HashingDestination):
        def _write(self, scheme, path, stream, is_executable):
            data = stream.read()
            out[f"{self._inner.scheme_dict[scheme]}/{path}".lstrip("/")] = data
            return super()._write(scheme, path, io.BytesIO(data), is_executable)

    from installer import install
    from installer.sources import WheelFile

    with WheelFile.open(wheel) as source:
        install(source, Capture(LAYOUT.scheme(), interpreter=f"/{LAYOUT.venv}/bin/python"), {"INSTALLER": b"skupin\n"})
    return {k.replace("//", "/"): v for k, v in out.items()}


@pytest.fixture()
def honest(tmp_path: Path):
    """(image, lock, wheels) of a consistent synthetic image."""
    wheel = make_wheel(tmp_path, name="tiny", version="1.0", files={"tiny.py": b"VALUE = 1\n"})
    pkg = LockedPackage(name="tiny", version="1.0", filename=wheel.name,
                        sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), source="wheelhouse")
    lock = Lock(sku="t", manifest_sha256="0" * 64, python="3.11", platform="linux/amd64",
                base=LockedBase(kind="bootstrap", reference="base:1"), layers={"engine": (pkg,)},
                dockerfile_sha256="0" * 64, resolver="test", tool_version="0", created="")
    image = Image()
    image.add("usr/bin/timeout", TIMEOUT, layer=0, mode=0o755)
    image.add("var/lib/dpkg/status", BASE_STATUS.encode(), layer=0)
    image.add("var/lib/dpkg/info/coreutils.list", b"/usr/bin/timeout\n", layer=0)
    image.add("var/lib/dpkg/info/coreutils.md5sums", f"{hashlib.md5(TIMEOUT).hexdigest()}  usr/bin/timeout\n".encode(),
              layer=0)
    image.add("usr/bin/python3.11", b"\x7fELF python", layer=0, mode=0o755)
    image.add("usr/lib/python3.11/json/__init__.py", b"# json\n")
    image.add("usr/lib/python3.11/json/__pycache__/__init__.cpython-311.pyc", b"pyc of json")
    image.add("etc/python3.11/sitecustomize.py", b"# debian's\n")
    image.link("usr/lib/python3.11/sitecustomize.py", "/etc/python3.11/sitecustomize.py")
    image.add("var/lib/dpkg/status", STATUS.replace("0123456789abcdef0123456789abcdef",
                                                    hashlib.md5(b"# debian's\n").hexdigest()).encode())
    md5 = hashlib.md5(b"# json\n").hexdigest()
    image.add("var/lib/dpkg/info/libpython3.11-stdlib:amd64.md5sums", f"{md5}  usr/lib/python3.11/json/__init__.py\n".encode())
    image.add("var/lib/dpkg/info/libpython3.11-stdlib:amd64.list",
              b"/usr/lib/python3.11/json/__init__.py\n/usr/lib/python3.11/sitecustomize.py\n")
    image.add("var/lib/dpkg/info/python3.11-minimal:amd64.list", b"/usr/bin/python3.11\n/etc/python3.11/sitecustomize.py\n")
    image.add("var/lib/dpkg/info/python3.11-minimal.postinst", b"#!/bin/sh\n", mode=0o755)
    image.add(f"{LAYOUT.venv}/pyvenv.cfg", b"home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n")
    image.link(f"{LAYOUT.venv}/bin/python3.11", "/usr/bin/python3.11")
    image.link(f"{LAYOUT.venv}/bin/python", "python3.11")
    for path, data in _installed(wheel).items():
        image.add(path, data)
    image.add(f"{SITE}/__pycache__/tiny.cpython-311.pyc", b"pyc of tiny")
    image.add("etc/ssl/certs/ca-certificates.crt", b"certs")
    image.add("etc/ssl/certs/ISRG.pem", b"a certificate")
    image.link("etc/ssl/certs/4042bcee.0", "ISRG.pem")  # update-ca-certificates makes these: unowned, data
    return image, lock, {"tiny": wheel}


class Verifier:
    """A stand-in bytecode verifier that records what it was asked and fails what it is told to."""

    def __init__(self, bad: set[str] = frozenset()) -> None:
        self.asked: list = []
        self.bad = bad
        self.version = None

    def __call__(self, pycs, view, interpreter, version):
        self.asked, self.version = list(pycs), version
        return [f"/{p.pyc}: its code differs" for p in pycs if p.pyc in self.bad], [], "/usr/bin/python3.11 (test)"


def host_records(status: str, files: dict[str, str] | None = None) -> DpkgRecords:
    """dpkg records of a stand-in host: its status, its info/ and alternatives/ files."""
    data = {"status": status.encode(), **{k: v.encode() for k, v in (files or {}).items()}}
    return DpkgRecords(data.get, groups=lambda: [k.split("/", 1)[1] for k in data if k.startswith("alternatives/")])


def _check(image: Image, lock: Lock, wheels, *, verifier=None, config=None, labels=None, expected=EXPECTED,
           roots=("python3.11",), host=None):
    view = image.view()
    return check_integrity(view=view, base_view=view.bottom_view(1), config=config if config is not None else CONFIG,
                           labels=labels if labels is not None else {"io.skupin.lock-sha256": lock.content_hash()},
                           lock=lock, expected=expected, apt_roots=roots, wheels=wheels, base_layers=1, host=host,
                           verify_bytecode=verifier or Verifier())


def _kinds(report) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for finding in report.findings:
        out.setdefault(finding.kind, []).append(finding.path)
    return out


def test_the_honest_image_has_no_finding(honest) -> None:
    image, lock, wheels = honest
    verifier = Verifier()
    report = _check(image, lock, wheels, verifier=verifier)
    assert report.ok, [f.line() for f in report.findings]
    assert report.counts["wheel_files_verified"] >= 5 and report.counts["debian_files_verified"] == 3
    assert report.counts["debian_packages_base_records"] == 1 and report.counts["debian_packages_image_records"] == 3
    assert sorted(p.pyc for p in verifier.asked) == [f"{SITE}/__pycache__/tiny.cpython-311.pyc",
                                                      "usr/lib/python3.11/json/__pycache__/__init__.cpython-311.pyc"]
    assert verifier.version == "3.11.2"  # from the package owning the interpreter
    assert "etc/ssl/certs/ca-certificates.crt" in report.unowned_data  # data, listed, not failed
    assert not [p for p in report.unowned_data if p.startswith(("usr/lib/python", LAYOUT.venv))]


@pytest.mark.parametrize("path, data, kind", [
    (f"{SITE}/zz_hook.pth", b"import evil\n", "hook"),
    (f"{SITE}/sitecustomize.py", b"import evil\n", "hook"),
    (f"{SITE}/evil.py", b"x = 1\n", "unaccounted"),
    (f"{SITE}/tiny.py", b"VALUE = 2\n", "wheel"),
    (f"{SITE}/other-2.0.dist-info/METADATA", b"Name: other\n", "extra_distribution"),
    (f"{SITE}/tiny-0.9.dist-info/METADATA", b"Name: tiny\nVersion: 0.9\n", "extra_distribution"),
    ("usr/lib/python3.11/json/__init__.py", b"# json\nimport evil\n", "debian"),
    ("etc/python3.11/sitecustomize.py", b"import evil\n", "debian"),
    ("usr/local/bin/tool", b"\x7fELF...", "executable"),
    ("opt/app/run.sh", b"echo hi\n", "executable"),
    ("etc/ld.so.preload", b"/lib/evil.so\n", "config"),
])
def test_one_changed_file_is_named(honest, path: str, data: bytes, kind: str) -> None:
    image, lock, wheels = honest
    image.add(path, data)
    report = _check(image, lock, wheels)
    assert path in _kinds(report).get(kind, []), [f.line() for f in report.findings]


def test_a_version_claimed_by_a_second_dist_info_names_both_versions(honest) -> None:
    image, lock, wheels = honest
    image.add(f"{SITE}/tiny-0.9.dist-info/METADATA", b"Name: tiny\n")
    finding = next(f for f in _check(image, lock, wheels).findings if f.kind == "extra_distribution")
    assert finding.detail == "distribution tiny 0.9 is installed, the lock says 1.0"


def test_a_missing_locked_file_and_a_removed_debian_file_are_findings(honest) -> None:
    image, lock, wheels = honest
    del image.files[f"{SITE}/tiny.py"]
    del image.files["usr/lib/python3.11/json/__init__.py"]
    kinds = _kinds(_check(image, lock, wheels))
    assert f"{SITE}/tiny.py" in kinds["wheel"] and "usr/lib/python3.11/json/__init__.py" in kinds["debian"]


def test_a_debian_link_into_an_unowned_file_is_a_finding(honest) -> None:
    image, lock, wheels = honest
    image.add("etc/hook.py", b"import evil\n")
    image.link("usr/lib/python3.11/sitecustomize.py", "/etc/hook.py")
    assert "usr/lib/python3.11/sitecustomize.py" in _kinds(_check(image, lock, wheels))["debian"]


def test_bytecode_that_does_not_verify_fails(honest) -> None:
    image, lock, wheels = honest
    bad = f"{SITE}/__pycache__/tiny.cpython-311.pyc"
    report = _check(image, lock, wheels, verifier=Verifier(bad={bad}))
    assert [f.detail for f in report.findings] == [f"/{bad}: its code differs"]


def test_bytecode_of_an_unaccounted_source_is_not_verified_but_reported(honest) -> None:
    image, lock, wheels = honest
    image.add(f"{SITE}/__pycache__/evil.cpython-311.pyc", b"code")
    verifier = Verifier()
    report = _check(image, lock, wheels, verifier=verifier)
    assert f"{SITE}/__pycache__/evil.cpython-311.pyc" in _kinds(report)["unaccounted"]
    assert all("evil" not in p.pyc for p in verifier.asked)


@pytest.mark.parametrize("changes, labels, words", [
    ({"Env": [*CONFIG["Env"], "LD_PRELOAD=/x.so"]}, None,
     "sets LD_PRELOAD='/x.so', which the rendered Dockerfile does not set, which makes the loader"),
    ({"Env": [*CONFIG["Env"], "PYTHONPATH=/tmp"]}, None, "sets PYTHONPATH='/tmp'"),
    ({"Entrypoint": ["/bin/sh"]}, None, "entrypoint is ['/bin/sh'], the rendered Dockerfile gives none"),
    ({"Cmd": ["sh", "-c", "evil"]}, None, "default command is ['sh', '-c', 'evil'], the rendered Dockerfile gives ['serve']"),
    ({}, {"io.skupin.lock-sha256": "0" * 64}, "not the lock's hash"),
])
def test_the_image_config_is_checked(honest, changes, labels, words) -> None:
    image, lock, wheels = honest
    report = _check(image, lock, wheels, config={**CONFIG, **changes}, labels=labels)
    assert any(words in f.detail for f in report.findings), [f.line() for f in report.findings]


def test_pyvenv_pointing_elsewhere_or_seeing_system_packages_fails(honest) -> None:
    image, lock, wheels = honest
    image.add(f"{LAYOUT.venv}/pyvenv.cfg", b"home = /tmp/py\ninclude-system-site-packages = true\n")
    details = [f.detail for f in _check(image, lock, wheels).findings if f.kind == "venv"]
    assert len(details) == 2 and "home is '/tmp/py'" in details[0]


def test_base_layer_files_are_trusted_and_an_upper_layer_replacing_one_is_not(honest) -> None:
    image, lock, wheels = honest
    image.add("usr/bin/tool", b"\x7fELF base", layer=0, mode=0o755)
    assert _check(image, lock, wheels).ok
    image.add("usr/bin/tool", b"\x7fELF evil", layer=1, mode=0o755)
    assert "usr/bin/tool" in _kinds(_check(image, lock, wheels))["executable"]


def test_dpkg_records_parse() -> None:
    packages = parse_status(STATUS)
    assert [(p.name, p.arch, p.version) for p in packages] == [
        ("coreutils", "amd64", "9.1-1"), ("python3.11", "amd64", "3.11.2-6+deb12u8"),
        ("libpython3.11-stdlib", "amd64", "3.11.2-6+deb12u8"), ("python3.11-minimal", "amd64", "3.11.2-6+deb12u8")]
    assert packages[3].conffiles == {"etc/python3.11/sitecustomize.py": "0123456789abcdef0123456789abcdef"}
    assert packages[1].depends == (("python3.11-minimal",), ("libpython3.11-stdlib",), ("media-types", "mime-support"))
    assert relations("a (>= 1) [amd64], b:any | c (<< 2)") == (("a",), ("b", "c"))
    assert parse_md5sums("0123456789abcdef0123456789abcdef  usr/a b\nbad line\n") == {
        "usr/a b": "0123456789abcdef0123456789abcdef"}
    assert upstream_version("1:3.11.2-6+deb12u8") == "3.11.2" and upstream_version("2.0") == "2.0"
    assert Finding(kind="hook", path="a/b", detail="x").line() == "/a/b: x"


# ---------------------------------------------------------------- the config, PATH and links (unlocked code past pins)


@pytest.mark.parametrize("changes, words", [
    ({"Env": [f"PATH=/opt/evil:{PATH}", *CONFIG["Env"][1:]]},
     f"sets PATH='/opt/evil:{PATH}', the rendered Dockerfile gives '{PATH}'"),
    ({"WorkingDir": "/srv"}, "working folder (WorkingDir) is '/srv', the rendered Dockerfile gives none"),
    ({"Env": [*CONFIG["Env"], "SKUPIN_EXTRA=1"]}, "sets SKUPIN_EXTRA='1', which the rendered Dockerfile does not set"),
    ({"Env": CONFIG["Env"][:-1]}, "does not set LANG, which the rendered Dockerfile sets to 'C.UTF-8'"),
    ({"Env": [*CONFIG["Env"], "LANG=C"]}, "sets LANG more than once"),
    ({"Env": [*CONFIG["Env"], "JUNK"]}, "an entry without '='"),
    ({"User": "0"}, "user is '0', the rendered Dockerfile gives none"),
    ({"Shell": ["/bin/sh", "-c"]}, "shell is ['/bin/sh', '-c'], the rendered Dockerfile gives ['/bin/bash', '-c']"),
    ({"OnBuild": ["RUN evil"]}, "list of ONBUILD triggers is ['RUN evil']"),
    ({"Volumes": {"/opt/skupin/venv": {}}}, "set of volumes is ['/opt/skupin/venv']"),
    ({"Healthcheck": {"Test": ["CMD", "python3", "-c", "evil"]}}, "health check is"),
])
def test_the_config_is_exactly_what_the_render_gives(honest, changes, words) -> None:
    image, lock, wheels = honest
    report = _check(image, lock, wheels, config={**CONFIG, **changes})
    assert {f.kind for f in report.findings} == {"config"}, [f.line() for f in report.findings]
    assert words in report.findings[0].detail, report.findings[0].detail


def test_an_unknown_expected_config_leaves_pins_unverifiable(honest) -> None:
    image, lock, wheels = honest
    report = _check(image, lock, wheels, expected=None)
    assert not report.findings and "was not compared" in report.unverifiable[0]


def test_the_path_workdir_and_symlink_attack_fails(honest) -> None:
    """PATH=/opt/evil:$PATH, WORKDIR /srv, /opt/evil/vllm -> the venv's python, /srv/serve as plain data: the
    unchanged CMD `vllm serve ...` would run /srv/serve. Each part is named."""
    image, lock, wheels = honest
    image.link("opt/evil/vllm", f"/{LAYOUT.venv}/bin/python")
    image.add("srv/serve", b"import os\nos.system('evil')\n")
    config = {**CONFIG, "WorkingDir": "/srv", "Env": [f"PATH=/opt/evil:{PATH}", *CONFIG["Env"][1:]]}
    report = _check(image, lock, wheels, config=config)
    lines = [f.line() for f in report.findings]
    assert any("sets PATH='/opt/evil:" in line for line in lines), lines
    assert any("WorkingDir" in line for line in lines), lines
    assert any(line.startswith("/opt/evil/vllm: ") and "executable /usr/bin/python3.11" in line for line in lines), lines
    assert "srv/serve" in report.unowned_data  # data, as long as nothing may run it


@pytest.mark.parametrize("link, target, words", [
    ("usr/local/bin/transformers", "/usr/bin/python3.11", "sits in a folder of PATH"),
    ("bin/transformers", "/usr/bin/python3.11", "sits in a folder of PATH"),  # /bin -> usr/bin in a usr-merged image
    ("opt/evil/vllm", "/usr/bin/timeout", "leads to the executable /usr/bin/timeout"),
    ("opt/app/hook.py", "/etc/ssl/certs/ISRG.pem", "its name makes it code"),
    ("opt/app/lib", "/tmp/payload", "leads out of the image or nowhere"),
    ("opt/app/venv", f"/{LAYOUT.venv}/bin", "a Python path or a folder of PATH"),
    ("opt/app/run", "/opt/app/real", "code that no package or locked wheel installed"),
    ("skupin/torch.py", "/etc/ssl/certs/ISRG.pem", "in a Python path"),  # the probe's folder: its sys.path[0]
])
def test_an_unowned_link_that_may_lead_to_code_fails(honest, link, target, words) -> None:
    image, lock, wheels = honest
    image.link("bin", "usr/bin", layer=0)
    image.add("opt/app/real", b"\x7fELF not executable", mode=0o644)
    image.link(link, target)
    report = _check(image, lock, wheels)
    mine = [f for f in report.findings if f.path == link and f.kind != "sandbox"]  # /skupin: also a sandbox mount
    assert mine and words in mine[0].detail, [f.line() for f in report.findings]


def test_a_link_to_data_outside_every_path_is_data(honest) -> None:
    image, lock, wheels = honest
    image.link("etc/ssl/certs/ca.pem", "ISRG.pem")
    report = _check(image, lock, wheels)
    assert report.ok and report.counts["unowned_links"] == 2


# ---------------------------------------------------------------- Debian records the image cannot certify itself


def _fabricated(image: Image, name: str, files: dict[str, bytes], *, depends: str = "") -> None:
    """A package the image invents: a status entry, a .list and an .md5sums that match its files."""
    entry = f"Package: {name}\nStatus: install ok installed\nArchitecture: amd64\nVersion: 1.0\n"
    status = image.files["var/lib/dpkg/status"][1].decode() + "\n" + entry + (f"Depends: {depends}\n" if depends else "")
    image.add("var/lib/dpkg/status", status.encode())
    image.add(f"var/lib/dpkg/info/{name}:amd64.list", "".join(f"/{p}\n" for p in files).encode())
    image.add(f"var/lib/dpkg/info/{name}:amd64.md5sums",
              "".join(f"{hashlib.md5(d).hexdigest()}  {p}\n" for p, d in files.items()).encode())
    for path, data in files.items():
        image.add(path, data)


def test_a_package_the_image_invents_is_outside_the_lock(honest) -> None:
    image, lock, wheels = honest
    _fabricated(image, "zzz", {f"{SITE}/zzz.pth": b"import evil\n", "usr/lib/python3/dist-packages/zzz.py": b"x = 1\n"})
    lines = [f.line() for f in _check(image, lock, wheels).findings]
    assert any(line.startswith("/var/lib/dpkg/status: zzz 1.0 (amd64) is a Debian package outside the lock")
               for line in lines), lines
    assert any(line.startswith(f"/{SITE}/zzz.pth: zzz 1.0 claims a file of a Python path no Debian package")
               for line in lines), lines


def test_a_dependency_the_image_adds_to_a_package_the_host_knows_is_not_followed(honest) -> None:
    image, lock, wheels = honest
    _fabricated(image, "zzz", {"usr/share/zzz/data": b"x"})
    status = image.files["var/lib/dpkg/status"][1].decode().replace("media-types | mime-support", "zzz")
    image.add("var/lib/dpkg/status", status.encode())
    kinds = _kinds(_check(image, lock, wheels))
    assert "var/lib/dpkg/status" not in kinds.get("debian", [])  # no trusted record: the image's Depends are followed
    host = host_records("Package: python3.11\nStatus: install ok installed\nArchitecture: amd64\nVersion: 3.11.2-6+deb12u6"
                        "\nDepends: python3.11-minimal, libpython3.11-stdlib, media-types | mime-support\n")
    report = _check(image, lock, wheels, host=host)
    assert "var/lib/dpkg/status" in _kinds(report)["debian"], [f.line() for f in report.findings]
    assert report.counts["debian_depends_from_image_records"] == 2  # the two python packages the host lacks


def test_a_package_the_lock_pins_and_its_dependencies_are_declared(honest) -> None:
    image, lock, wheels = honest
    _fabricated(image, "zlib1g", {"usr/lib/x86_64-linux-gnu/libz.so.1.2.13": b"\x7fELF zlib"})
    _fabricated(image, "g++-12", {"usr/bin/x86_64-linux-gnu-g++-12": b"\x7fELF g++"}, depends="zlib1g (>= 1)")
    assert "var/lib/dpkg/status" in _kinds(_check(image, lock, wheels)).get("debian", [])
    pinned = lock.model_copy(update={"system": {"compiler": ("g++-12=1.0",)}})
    report = _check(image, pinned, wheels, labels={"io.skupin.lock-sha256": pinned.content_hash()})
    assert report.ok, [f.line() for f in report.findings]


def test_a_line_added_to_a_packages_list_does_not_make_a_file_owned(honest) -> None:
    image, lock, wheels = honest
    listed = image.files["var/lib/dpkg/info/libpython3.11-stdlib:amd64.list"][1]
    image.add("var/lib/dpkg/info/libpython3.11-stdlib:amd64.list",
              listed + f"/{SITE}/zzz.pth\n/usr/lib/python3.11/zzz.py\n".encode())
    image.add(f"{SITE}/zzz.pth", b"import evil\n")
    image.add("usr/lib/python3.11/zzz.py", b"import evil\n")
    lines = [f.line() for f in _check(image, lock, wheels).findings]
    assert any(line.startswith("/usr/lib/python3.11/zzz.py: a file of libpython3.11-stdlib 3.11.2-6+deb12u8 whose md5 "
                               "no dpkg record gives") for line in lines), lines
    assert any(line.startswith(f"/{SITE}/zzz.pth: ") for line in lines), lines


def test_records_of_a_base_package_are_read_from_the_base_layers(honest) -> None:
    """An upper layer that rewrites a base package's md5sums along with its file does not certify the file."""
    image, lock, wheels = honest
    evil = b"\x7fELF evil"
    image.add("usr/bin/timeout", evil, mode=0o755)
    image.add("var/lib/dpkg/info/coreutils.md5sums", f"{hashlib.md5(evil).hexdigest()}  usr/bin/timeout\n".encode())
    lines = [f.line() for f in _check(image, lock, wheels).findings]
    assert any(line.startswith("/usr/bin/timeout: file of coreutils 9.1-1 was changed") for line in lines), lines


def test_records_of_this_host_win_over_the_images(honest) -> None:
    image, lock, wheels = honest
    listed = image.files["var/lib/dpkg/info/python3.11-minimal:amd64.list"][1]
    image.add("var/lib/dpkg/info/python3.11-minimal:amd64.list", listed + b"/usr/lib/python3.11/evil.py\n")
    image.add("usr/lib/python3.11/evil.py", b"import os\n")
    minimal = STATUS[STATUS.index("Package: python3.11-minimal"):]
    host = host_records(minimal.replace("0123456789abcdef0123456789abcdef", hashlib.md5(b"# debian's\n").hexdigest()),
                        {"info/python3.11-minimal:amd64.list": listed.decode()})
    report = _check(image, lock, wheels, host=host)
    assert report.counts["debian_packages_host_records"] == 1
    assert "usr/lib/python3.11/evil.py" in _kinds(report)["unaccounted"], [f.line() for f in report.findings]


def test_a_debian_link_above_the_base_must_lead_into_the_image(honest) -> None:
    image, lock, wheels = honest
    listed = image.files["var/lib/dpkg/info/python3.11-minimal:amd64.list"][1]
    image.add("var/lib/dpkg/info/python3.11-minimal:amd64.list", listed + b"/usr/bin/python3\n")
    image.link("usr/bin/python3", "python3.11")
    assert _check(image, lock, wheels).ok
    image.link("usr/bin/python3", "/tmp/python")
    assert "usr/bin/python3" in _kinds(_check(image, lock, wheels))["debian"]


def test_the_layout_knows_where_the_gate_mounts_its_probe() -> None:
    from skupin.gates.gate import PROBE_MOUNT, PROBE_PYTHON

    assert PROBE_MOUNT.rpartition("/")[0].strip("/") == LAYOUT.probe_dir and LAYOUT.probe_dir in LAYOUT.python_paths()
    assert PROBE_PYTHON == f"/{LAYOUT.venv}/bin/python3"


def _alternatives(image: Image, *, name: str = "cc", link: str = "/usr/bin/cc", choice: str = "/usr/bin/gcc-12",
                  chosen: str | None = None) -> DpkgRecords:
    """gcc-12 installed above the base with the links its postinst makes with update-alternatives (`name`: `link` ->
    /etc/alternatives/`name` -> `chosen`); returns a host whose alternatives records have `name`: `link` -> `choice`."""
    _fabricated(image, "gcc-12", {"usr/bin/gcc-12": b"\x7fELF gcc"})
    image.add("usr/bin/gcc-12", b"\x7fELF gcc", mode=0o755)
    image.link(link.lstrip("/"), f"/etc/alternatives/{name}")
    image.link(f"etc/alternatives/{name}", chosen or choice)
    return host_records("", {f"alternatives/{name}": f"auto\n{link}\n\n{choice}\n20\n\n"})


def test_links_update_alternatives_made_as_this_hosts_records_have_them_are_accounted(honest) -> None:
    image, lock, wheels = honest
    host = _alternatives(image)
    report = _check(image, lock, wheels, roots=("python3.11", "gcc-12"), host=host)
    assert report.ok and report.counts["alternatives_links"] == 2, [f.line() for f in report.findings]


@pytest.mark.parametrize("change, path, words", [
    ({"chosen": "/usr/bin/python3.11"}, "etc/alternatives/cc", "leads to the executable /usr/bin/python3.11"),
    ({"choice": f"/{LAYOUT.venv}/bin/python"}, "usr/bin/cc", "sits in a folder of PATH"),
    ({"name": "timeout", "link": "/usr/local/bin/timeout"}, "usr/local/bin/timeout",
     "an alternatives link that shadows /usr/bin/timeout"),
])
def test_alternatives_links_the_hosts_records_do_not_account_for_fail(honest, change, path, words) -> None:
    image, lock, wheels = honest
    host = _alternatives(image, **change)
    if "choice" in change:  # the image's link leads where the host's records say, but that is not a verified file
        image.link("etc/alternatives/cc", change["choice"])
    report = _check(image, lock, wheels, roots=("python3.11", "gcc-12"), host=host)
    mine = [f for f in report.findings if f.path == path]
    assert mine and words in mine[0].detail, [f.line() for f in report.findings]


def test_alternatives_links_this_host_does_not_have_are_plain_unowned_links(honest) -> None:
    image, lock, wheels = honest
    _alternatives(image)
    kinds = _kinds(_check(image, lock, wheels, roots=("python3.11", "gcc-12")))
    assert {"usr/bin/cc", "etc/alternatives/cc"} <= set(kinds["unaccounted"])


def test_alternatives_records_parse() -> None:
    text = ("auto\n/usr/bin/awk\nawk.1.gz\n/usr/share/man/man1/awk.1.gz\n\n/usr/bin/mawk\n5\n/usr/share/man/man1/mawk.1.gz\n"
            "/usr/bin/gawk\n10\n\n\n")
    assert parse_alternatives("awk", text) == {
        "awk": ("/usr/bin/awk", frozenset({"/usr/bin/mawk", "/usr/bin/gawk"})),
        "awk.1.gz": ("/usr/share/man/man1/awk.1.gz", frozenset({"/usr/share/man/man1/mawk.1.gz"}))}
    assert parse_alternatives("x", "auto\n") == {}


def test_a_virtual_dependency_is_met_by_a_trusted_provider_before_one_only_the_image_names() -> None:
    from skupin.imageview.debian import declared_packages

    def entry(name: str, extra: str = "") -> str:
        return f"Package: {name}\nStatus: install ok installed\nArchitecture: amd64\nVersion: 1\n{extra}\n"

    image = host_records(entry("app", "Depends: awk-virtual\n") + entry("mawk", "Provides: awk-virtual\n")
                         + entry("evil", "Provides: awk-virtual\n"))
    host = host_records(entry("mawk", "Provides: awk-virtual\n"))
    reached, from_image = declared_packages(("app",), image, [host])
    assert reached == {"app", "mawk"} and from_image == {"app"}
    assert "evil" in declared_packages(("app",), image, [])[0]  # with no trusted record, the image's word is all there is


def _with_wheel(tmp_path: Path, image: Image, lock: Lock, wheels: dict, *, name: str, version: str,
                files: dict[str, bytes], requires: tuple[str, ...] = ()) -> Lock:
    """`image` and `wheels` gain one more locked wheel, installed; the lock that also names it."""
    wheel = make_wheel(tmp_path, name=name, version=version, files=files, requires=requires)
    pkg = LockedPackage(name=name, version=version, filename=wheel.name,
                        sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), source="wheelhouse")
    for path, data in _installed(wheel).items():
        image.add(path, data)
    wheels[name] = wheel
    return lock.model_copy(update={"layers": {"engine": (*lock.layers["engine"], pkg)}})


def test_every_requirement_of_a_locked_wheel_is_locked_or_omitted_with_a_reason(honest, tmp_path: Path) -> None:
    image, lock, wheels = honest
    lock = _with_wheel(tmp_path, image, lock, wheels, name="engine-x", version="1.0", files={"engine_x.py": b"X = 1\n"},
                       requires=("tiny>=1", "vision-thing", "tiny-gpu; sys_platform == 'win32'", "extra-only; extra == 'a'"))
    report = _check(image, lock, wheels)
    assert [f.detail for f in report.findings] == [
        "engine-x requires vision-thing, which the lock does not install and stack.omit does not name"]
    omitted = lock.model_copy(update={"omitted": {"vision-thing": "not served by this SKU"}})
    report = _check(image, omitted, wheels, labels={"io.skupin.lock-sha256": omitted.content_hash()})
    assert report.ok, [f.line() for f in report.findings]
    assert report.omitted == ("vision-thing (required by engine-x): not served by this SKU",)
    assert report.counts["requirements_met"] == 1 and report.counts["requirements_omitted"] == 1


def test_a_requirement_the_locked_version_does_not_meet_is_a_finding(honest, tmp_path: Path) -> None:
    image, lock, wheels = honest
    lock = _with_wheel(tmp_path, image, lock, wheels, name="engine-x", version="1.0", files={"engine_x.py": b"X = 1\n"},
                       requires=("tiny>=2",))
    assert [f.detail for f in _check(image, lock, wheels).findings] == [
        "engine-x requires tiny>=2, but the lock installs tiny 1.0"]


def test_bytecode_a_wheel_ships_may_be_recompiled_but_must_verify(honest, tmp_path: Path) -> None:
    """numpy ships __pycache__ files; the build compiles the source again over them: verified like any bytecode."""
    image, lock, wheels = honest
    pyc = "shipped/__pycache__/mod.cpython-311.pyc"
    lock = _with_wheel(tmp_path, image, lock, wheels, name="shipper", version="1.0",
                       files={"shipped/mod.py": b"A = 1\n", pyc: b"the wheel's own bytecode"})
    image.add(f"{SITE}/{pyc}", b"bytecode compiled at build time")
    verifier = Verifier()
    report = _check(image, lock, wheels, verifier=verifier)
    assert report.ok, [f.line() for f in report.findings]
    assert f"{SITE}/{pyc}" in {item.pyc for item in verifier.asked}
    assert report.counts["wheel_bytecode_recompiled"] == 1
    report = _check(image, lock, wheels, verifier=Verifier(bad={f"{SITE}/{pyc}"}))
    assert [f.kind for f in report.findings] == ["bytecode"]


def test_a_second_status_entry_under_a_declared_name_does_not_bring_its_own_records(honest) -> None:
    """Declared is by name; a second entry (another architecture, a made-up version) with image-written records fails."""
    image, lock, wheels = honest
    status = image.files["var/lib/dpkg/status"][1].decode()
    fake = "\nPackage: python3.11-minimal\nStatus: install ok installed\nArchitecture: i386\nVersion: 9\n"
    image.add("var/lib/dpkg/status", (status.rstrip("\n") + "\n" + fake).encode())
    image.add("var/lib/dpkg/info/python3.11-minimal:i386.list", b"/usr/bin/evil\n")
    image.add("var/lib/dpkg/info/python3.11-minimal:i386.md5sums",
              f"{hashlib.md5(b'#!/bin/sh').hexdigest()}  usr/bin/evil\n".encode())
    image.add("usr/bin/evil", b"#!/bin/sh", mode=0o755)
    details = [f.detail for f in _check(image, lock, wheels).findings]
    assert "python3.11-minimal has more than one installed entry in the dpkg status file" in details, details
    assert any("installed for architecture 'i386', not the image's 'amd64'" in d for d in details), details


def test_a_marker_the_gate_cannot_evaluate_is_a_finding_not_a_crash(honest, tmp_path: Path) -> None:
    image, lock, wheels = honest
    lock = _with_wheel(tmp_path, image, lock, wheels, name="engine-x", version="1.0", files={"engine_x.py": b"X = 1\n"},
                       requires=("tiny; dependency_groups == 'x'",))
    report = _check(image, lock, wheels)
    assert [f.kind for f in report.findings] == ["requirement"] and "cannot be evaluated" in report.findings[0].detail


# ---------------------------------------------------------------- issue 30: archives are code; what the sandbox hides


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buf.getvalue()


PAYLOAD = _zip({"torch/__init__.py": b"import os; os.environ['SKUPIN_HIJACKED'] = '1'\n"})


@pytest.mark.parametrize("path", ["opt/app/payload.zip", "srv/lib.egg", "var/cache/torch-9-py3-none-any.whl",
                                  "usr/local/share/app.pyz"])
def test_an_unowned_importable_archive_anywhere_fails_like_an_unowned_module(honest, path) -> None:
    """A zip Python can be pointed at (PYTHONPATH, a .pth, sys.path.insert) is code, not data, whatever folder it is in."""
    image, lock, wheels = honest
    image.add(path, PAYLOAD)
    report = _check(image, lock, wheels)
    mine = [f for f in report.findings if f.path == path]
    assert mine and mine[0].kind == "executable" and "importable archive" in mine[0].detail, report.findings


def test_a_link_named_as_an_archive_is_code_too(honest) -> None:
    image, lock, wheels = honest
    image.link("opt/app/payload.zip", "/etc/ssl/certs/ISRG.pem")
    assert "opt/app/payload.zip" in _kinds(_check(image, lock, wheels))["unaccounted"]


def test_a_zip_without_an_archive_name_in_a_python_path_is_named_as_an_archive(honest) -> None:
    image, lock, wheels = honest
    image.add(f"{SITE}/payload.dat", PAYLOAD)
    report = _check(image, lock, wheels)
    mine = [f for f in report.findings if f.path == f"{SITE}/payload.dat"]
    assert mine and mine[0].kind == "unaccounted" and "importable archive (zip) in a Python path" in mine[0].detail


@pytest.mark.parametrize("line", ["/srv/payload", "../../../../../../srv/payload"])
def test_what_a_locked_pth_adds_to_sys_path_is_a_python_path(honest, tmp_path: Path, line) -> None:
    """A .pth line names a folder or an archive for sys.path: an unowned zip there is code, even without a zip name."""
    image, lock, wheels = honest
    lock = _with_wheel(tmp_path, image, lock, wheels, name="pather", version="1.0",
                       files={"pather.pth": f"# a comment\nimport os\n{line}\n".encode()})
    assert _check(image, lock, wheels, labels={"io.skupin.lock-sha256": lock.content_hash()}).ok
    image.add("srv/payload", PAYLOAD)  # data outside every path, had the .pth not named it
    report = _check(image, lock, wheels, labels={"io.skupin.lock-sha256": lock.content_hash()})
    mine = [f for f in report.findings if f.path == "srv/payload"]
    assert mine and "importable archive (zip) in a path a .pth adds to sys.path" in mine[0].detail, report.findings
    image.files.pop("srv/payload")
    image.add("srv/payload/torch/__init__.py", b"evil = 1\n")  # a folder it names: its modules must be accounted too
    report = _check(image, lock, wheels, labels={"io.skupin.lock-sha256": lock.content_hash()})
    assert "srv/payload/torch/__init__.py" in _kinds(report)["unaccounted"]


def test_owned_archives_pass(honest, tmp_path: Path) -> None:
    """A locked wheel's own zip (package data) and a Debian-owned wheel (python3-pip-whl) are accounted bytes."""
    image, lock, wheels = honest
    lock = _with_wheel(tmp_path, image, lock, wheels, name="zipper", version="1.0",
                       files={"zipper/__init__.py": b"", "zipper/data.zip": PAYLOAD, "zipper/tool.pyz": PAYLOAD})
    _fabricated(image, "python3-pip-whl", {"usr/share/python-wheels/pip-23.0.1-py3-none-any.whl": PAYLOAD})
    labels = {"io.skupin.lock-sha256": lock.content_hash()}
    report = _check(image, lock, wheels, labels=labels, roots=("python3.11", "python3-pip-whl"))
    assert report.ok, [f.line() for f in report.findings]
    image.add(f"{SITE}/zipper/data.zip", _zip({"torch/__init__.py": b"other = 1\n"}))  # the wheel's archive, changed
    report = _check(image, lock, wheels, labels=labels, roots=("python3.11", "python3-pip-whl"))
    assert [(f.kind, f.path) for f in report.findings] == [("wheel", f"{SITE}/zipper/data.zip")]


@pytest.mark.parametrize("path, kind, layer", [
    ("tmp/payload.zip", "file", 1), ("tmp/deep/hook.py", "file", 1), ("tmp/.X0-lock", "file", 0),
    ("model/config.json", "file", 1), ("skupin/torch.py", "file", 1), ("tmp/lib", "link", 1), ("model", "link", 1),
])
def test_anything_where_the_sandbox_mounts_over_the_image_fails(honest, path, kind, layer) -> None:
    """The gate runs with a tmpfs on /tmp and its model and probe folders mounted: what the image keeps there a plain
    `docker run` sees and the gate never does (even from the base)."""
    image, lock, wheels = honest
    if kind == "link":
        image.link(path, "/etc/ssl/certs/ISRG.pem", layer=layer)
    else:
        image.add(path, b"# present in production only\n", layer=layer)
    report = _check(image, lock, wheels)
    mine = [f for f in report.findings if f.kind == "sandbox"]
    assert [f.path for f in mine] == [path], [f.line() for f in report.findings]
    assert "the gate's sandbox mounts" in mine[0].detail and "production would see it, the gate would not" in mine[0].detail
    assert mine[0].detail.startswith(f"a {kind} under /{path.split('/')[0]}: ")


def test_empty_folders_where_the_sandbox_mounts_pass(honest) -> None:
    image, lock, wheels = honest
    view = image.view()
    for folder in ("tmp", "tmp/skupin-wheels", "model", "skupin"):  # Debian's empty /tmp; BuildKit's mount points
        view.entries[folder] = Entry("d", 0o1777, 0, 0, layer=1)
    report = check_integrity(view=view, base_view=view.bottom_view(1), config=CONFIG,
                             labels={"io.skupin.lock-sha256": lock.content_hash()}, lock=lock, expected=EXPECTED,
                             apt_roots=("python3.11",), wheels=wheels, base_layers=1, host=None,
                             verify_bytecode=Verifier())
    assert report.ok, [f.line() for f in report.findings]


def test_a_file_under_tmp_from_a_real_layer_tar_fails_unless_a_later_layer_removes_it(honest) -> None:
    """Layer tars as an engine exports them: a file a later layer whites out is gone in production too."""
    image, lock, wheels = honest
    honest_view = image.view()
    lower = LayerIndex("sha256:0", entries=dict(honest_view.bottom or {}))
    upper = LayerIndex("sha256:1", entries={p: e for p, e in honest_view.entries.items() if e.layer == 1 or e.kind == "d"})

    def _tar(members: dict[str, bytes]) -> io.BytesIO:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.addfile(_folder("tmp"))
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        buf.seek(0)
        return buf

    def _folder(name: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type = tarfile.DIRTYPE
        return info

    planted = scan_layer_tar(_tar({"tmp/skupin/hook.pth": b"import evil\n", "tmp/payload.zip": PAYLOAD}),
                             diff_id="sha256:2")
    removed = scan_layer_tar(_tar({"tmp/.wh.payload.zip": b"", "tmp/.wh.skupin": b""}), diff_id="sha256:3")

    def check(layers: list[LayerIndex]):
        view = FileView(entries=merge(layers), layers=tuple(x.diff_id for x in layers), read=honest_view.read,
                        bottom=merge(layers[:1]))
        return check_integrity(view=view, base_view=view.bottom_view(1), config=CONFIG,
                               labels={"io.skupin.lock-sha256": lock.content_hash()}, lock=lock, expected=EXPECTED,
                               apt_roots=("python3.11",), wheels=wheels, base_layers=1, host=None,
                               verify_bytecode=Verifier())

    report = check([lower, upper, planted])
    assert sorted(f.path for f in report.findings if f.kind == "sandbox") == ["tmp/payload.zip", "tmp/skupin/hook.pth"]
    report = check([lower, upper, planted, removed])
    assert report.ok, [f.line() for f in report.findings]


def test_the_layout_covers_every_mount_and_tmpfs_of_the_gates_sandbox(tmp_path: Path) -> None:
    """The folders `pins` requires empty are exactly where the probe's and the server's containers mount over the image."""
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.common.paths import sku_path
    from skupin.gates.gate import probe_spec
    from skupin.gates.serving.serve import launch_command, server_spec

    manifest = load_manifest(sku_path("cpu-x86_64"))
    probe = probe_spec(manifest=manifest, image="sha256:x", out=tmp_path, model_dir=tmp_path)
    server = server_spec(manifest=manifest, image="sha256:x", model_dir=tmp_path, launch=launch_command(manifest=manifest))
    targets = {m.target for spec in (probe, server) for m in spec.mounts} | set(probe.tmpfs) | set(server.tmpfs)
    assert {t.strip("/") for t in targets} <= set(LAYOUT.sandbox_mounts())
    assert {"tmp", "model", "skupin"} == set(LAYOUT.sandbox_mounts())


@pytest.mark.parametrize("path, kind", [
    ("root/.triton/cache/4f2a/matmul_kernel.cubin", "file"),  # Triton's compiled kernels (no code suffix needed)
    ("root/.cache/vllm/torch_compile_cache/rank_0/graph.bin", "file"),  # a pickled compiled graph: data to no one else
    ("root/.nv/ComputeCache/index", "file"),  # CUDA's JIT cache
    ("root/.cache/huggingface/hub/models--x/config.json", "file"),
    ("root/.config/miopen/gfx942.udb", "file"),  # MIOpen's kernel database
    ("root/.bashrc", "file"),  # anything: the sandbox hides the whole home
    ("home/app/.cache/torch_extensions/py311_cpu/op/op.so", "file"),
    ("srv/app/.triton/cache/k.json", "file"),  # the HOME the image's config names
    ("root/.triton/cache", "link"),
    ("root/.cache", "link"),  # the cache folder itself, leading elsewhere
    ("root", "link"),  # the home itself
])
def test_anything_in_a_home_fails_because_the_sandbox_gives_every_process_an_empty_home(
        honest, path: str, kind: str) -> None:
    """Issue 30: the sandbox sets HOME and every cache variable to its empty tmpfs; production uses the image's home,
    where Triton, CUDA, Inductor, vLLM, MIOpen and Hugging Face load what they find. Whatever an image ships there
    above the base fails, a link at the home or at a cache folder too."""
    image, lock, wheels = honest
    if kind == "link":
        image.link(path, "/srv/elsewhere", layer=1)
    else:
        image.add(path, b"\x7fELF or a pickle: loaded in production only\n", layer=1)
    view = image.view()
    config = {**CONFIG, "Env": [*CONFIG.get("Env", ()), "HOME=/srv/app"]} if path.startswith("srv/") else CONFIG
    report = check_integrity(view=view, base_view=view.bottom_view(1), config=config,
                             labels={"io.skupin.lock-sha256": lock.content_hash()}, lock=lock,
                             expected=None if path.startswith("srv/") else EXPECTED, apt_roots=("python3.11",),
                             wheels=wheels, base_layers=1, host=None, verify_bytecode=Verifier())
    mine = [f for f in report.findings if f.kind == "sandbox"]
    assert [f.path for f in mine] == [path], [f.line() for f in report.findings]
    assert "in the home /" in mine[0].detail and "production would load it and the gate would not" in mine[0].detail


def test_the_home_the_images_own_passwd_gives_its_user_is_checked_too(honest) -> None:
    """With no HOME in the config, Docker takes the user's home from the image's /etc/passwd: an image that moves
    root's home there and ships a cache in it fails as it would in /root."""
    image, lock, wheels = honest
    image.add("etc/passwd", b"root:x:0:0:root:/srv/x:/bin/bash\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n",
              layer=1)
    image.add("srv/x/.cache/vllm/graph.bin", b"pickle", layer=1)
    view = image.view()
    report = check_integrity(view=view, base_view=view.bottom_view(1), config=CONFIG,
                             labels={"io.skupin.lock-sha256": lock.content_hash()}, lock=lock, expected=EXPECTED,
                             apt_roots=("python3.11",), wheels=wheels, base_layers=1, host=None,
                             verify_bytecode=Verifier())
    assert "srv/x/.cache/vllm/graph.bin" in [f.path for f in report.findings if f.kind == "sandbox"]


def test_a_homes_files_from_the_base_and_empty_home_folders_pass(honest) -> None:
    image, lock, wheels = honest
    image.add("root/.bashrc", b"# Debian's skeleton\n", layer=0)  # the base's, verified with the base
    image.add("root/.cache/motd.legal-displayed", b"", layer=0)
    view = image.view()
    view.entries["root/.cache"] = Entry("d", 0o700, 0, 0, layer=1)
    view.entries["home/app"] = Entry("d", 0o755, 0, 0, layer=1)
    report = check_integrity(view=view, base_view=view.bottom_view(1), config=CONFIG,
                             labels={"io.skupin.lock-sha256": lock.content_hash()}, lock=lock, expected=EXPECTED,
                             apt_roots=("python3.11",), wheels=wheels, base_layers=1, host=None,
                             verify_bytecode=Verifier())
    assert not [f for f in report.findings if f.kind == "sandbox"], [f.line() for f in report.findings]
