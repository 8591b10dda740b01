"""The static integrity rules on a synthetic image: a base layer, a Debian package and one locked wheel.

Each test starts from an image whose files are exactly its lock (no finding) and changes one thing.
The bytecode verifier is a stand-in here (tests/unit/test_pyc_verify.py checks the real one).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from builder.lockfile import Lock, LockedBase, LockedPackage
from gates.static.integrity import (
    Finding,
    ImageLayout,
    _HashingDestination,
    check_integrity,
    parse_md5sums,
    parse_status,
    upstream_version,
)
from gates.static.layers import Entry, FileView
from tests.data.wheels import make_wheel

LAYOUT = ImageLayout()
SITE = LAYOUT.site
STATUS = """Package: libpython3.11-stdlib
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
    """Files by layer (0 = the locked base), turned into a FileView."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, bytes, int]] = {}
        self.links: dict[str, tuple[int, str]] = {}

    def add(self, path: str, data: bytes, *, layer: int = 1, mode: int = 0o644) -> None:
        self.files[path] = (layer, data, mode)

    def link(self, path: str, target: str, *, layer: int = 1) -> None:
        self.links[path] = (layer, target)

    def view(self) -> FileView:
        entries: dict[str, Entry] = {}
        for path, (layer, data, mode) in self.files.items():
            entries[path] = Entry("f", mode, len(data), 0, hashlib.sha256(data).hexdigest(),
                                  hashlib.md5(data).hexdigest(), "", data[:4] == b"\x7fELF", layer)
        for path, (layer, target) in self.links.items():
            entries[path] = Entry("l", 0o777, 0, 0, target=target, layer=layer)
        for path in list(entries):  # the folders of every path, as a real layer has them
            parts = path.split("/")
            for i in range(1, len(parts)):
                entries.setdefault("/".join(parts[:i]), Entry("d", 0o755, 0, 0, layer=0))
        data = {p: d for p, (_, d, _) in self.files.items()}
        return FileView(entries=entries, layers=("l0", "l1"), read=lambda rel, _e, _m: data[rel])


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


def _check(image: Image, lock: Lock, wheels, *, verifier=None, config=None, labels=None, cmd=("serve",)):
    return check_integrity(view=image.view(), config=config if config is not None else {"Cmd": list(cmd)},
                           labels=labels if labels is not None else {"io.skupin.lock-sha256": lock.content_hash()},
                           lock=lock, expected_cmd=cmd, wheels=wheels, base_layers=1, host=None,
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
    assert report.counts["wheel_files_verified"] >= 5 and report.counts["debian_files_verified"] == 2
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


@pytest.mark.parametrize("config, labels, words", [
    ({"Cmd": ["serve"], "Env": ["LD_PRELOAD=/x.so"]}, None, "sets LD_PRELOAD"),
    ({"Cmd": ["serve"], "Env": ["PYTHONPATH=/tmp"]}, None, "sets PYTHONPATH"),
    ({"Cmd": ["serve"], "Entrypoint": ["/bin/sh"]}, None, "has an entrypoint"),
    ({"Cmd": ["sh", "-c", "evil"]}, None, "default command is"),
    ({"Cmd": ["serve"]}, {"io.skupin.lock-sha256": "0" * 64}, "not the lock's hash"),
])
def test_the_image_config_is_checked(honest, config, labels, words) -> None:
    image, lock, wheels = honest
    report = _check(image, lock, wheels, config=config, labels=labels)
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
        ("libpython3.11-stdlib", "amd64", "3.11.2-6+deb12u8"), ("python3.11-minimal", "amd64", "3.11.2-6+deb12u8")]
    assert packages[1].conffiles == {"etc/python3.11/sitecustomize.py": "0123456789abcdef0123456789abcdef"}
    assert parse_md5sums("0123456789abcdef0123456789abcdef  usr/a b\nbad line\n") == {
        "usr/a b": "0123456789abcdef0123456789abcdef"}
    assert upstream_version("1:3.11.2-6+deb12u8") == "3.11.2" and upstream_version("2.0") == "2.0"
    assert Finding(kind="hook", path="a/b", detail="x").line() == "/a/b: x"


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
    assert report.counts["requirements_checked"] == 2 and report.counts["requirements_omitted"] == 1


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
