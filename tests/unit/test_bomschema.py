"""The SBOM's schema check without jsonschema's heavy format libraries (skupin/publishing/bomschema.py), and what the
command line and `verify` import: never the URI grammar (rfc3987_syntax, lark), the CycloneDX writer, the gate,
numpy or Docker (docs/BENCHMARKS.md, "Verify")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from skupin.publishing.bomschema import bom_schema_error, is_date_time, is_iri_reference, is_uri

HEAVY = ("rfc3987_syntax", "lark", "arrow", "cyclonedx", "numpy", "docker", "matplotlib", "jinja2",
         "skupin.gates.judge.compare", "skupin.builder.build", "skupin.dockerd")


def _imported_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(proc.stdout.splitlines()[-1]))


def test_the_command_line_and_verify_import_none_of_the_heavy_modules() -> None:
    loaded = _imported_after(
        "import skupin.cli\n"
        "skupin.cli.build_parser()\n"
        "import skupin.publishing.verify\n"
        "from skupin.publishing.bomschema import bom_validator\n"
        "bom_validator()  # jsonschema and the schemas are loaded: what verify does with an SBOM\n"
        "from skupin.clients.transport import httpx\n"
        "httpx.Client  # the lazy httpx, loaded as a registry request loads it\n")
    assert "jsonschema" in loaded and "httpx" in loaded  # the probe did reach what verify uses
    assert sorted(m for m in loaded if m.split(".")[0] in HEAVY or m in HEAVY) == []


def test_the_parser_alone_imports_no_stage() -> None:
    loaded = _imported_after("import skupin.cli\nskupin.cli.build_parser()\n")
    assert not {m for m in loaded if m.startswith(("skupin.publishing.", "skupin.builder.", "skupin.gates.",
                                                   "pydantic", "httpx", "jsonschema"))}


def test_a_later_import_of_a_left_out_library_still_works() -> None:
    loaded = _imported_after("from skupin.publishing.bomschema import bom_validator\nbom_validator()\n"
                             "import importlib.util\n"
                             "assert importlib.util.find_spec('rfc3339_validator') is None or "
                             "__import__('rfc3339_validator')\n")
    assert "rfc3987_syntax" not in loaded


IRI_REFERENCES = [
    "http://example.com", "https://ex.com/a/b?c=d#e", "", "a/b", "./a:b", "a:b", "//host", "//h:80/p", "http://[::1]/",
    "http://[v1.x]/", "pkg:pypi/torch@2.13.0", "pkg:oci/cpu@sha256:ab?repository_url=127.0.0.1:5000/cpu", "mailto:a@b",
    "http://ü.example/ä", "http://a/?\ue000", "#frag", "?q", "http://user:pw@h/p", "file:///etc/passwd", "x:/",
    "http://a/%41", "g;x=1/../y", "http://a/\U00010001",
]
NOT_IRI_REFERENCES = [
    ":a", "http://exa mple.com", "http://ex.com/%zz", "http://a/b\u0007", "http://a\\b", "http://a/b|c", "1a:b",
    "http://a/{x}", "http://a/`", "http://a/^", 'http://a/"', "http://a/\ue000", "http://[::zz]/", "http://[::1",
    "http://a/\ufffe", "http://h:x/",
]


@pytest.mark.parametrize("text", IRI_REFERENCES)
def test_iri_references_pass(text: str) -> None:
    assert is_iri_reference(text)


@pytest.mark.parametrize("text", NOT_IRI_REFERENCES)
def test_what_is_no_iri_reference_is_refused(text: str) -> None:
    assert not is_iri_reference(text)


def test_the_iri_grammar_agrees_with_rfc3987_syntax() -> None:
    """The library jsonschema would use, on every example without an IP literal or a character beyond the BMP (which
    it refuses, though RFC 3987 allows both)."""
    rfc3987_syntax = pytest.importorskip("rfc3987_syntax")
    for text in IRI_REFERENCES + NOT_IRI_REFERENCES:
        if "[" not in text and all(ord(c) <= 0xFFFF for c in text):
            assert is_iri_reference(text) == rfc3987_syntax.is_valid_syntax("iri_reference", text), text


def test_a_uri_has_a_scheme_and_is_ascii() -> None:
    assert is_uri("https://cyclonedx.org/schema") and is_uri("urn:uuid:3e671687-395b-41f5-a30f-a58921a69b79")
    assert not is_uri("/relative") and not is_uri("http://ü.example/") and not is_uri("http://a b/")


@pytest.mark.parametrize(("text", "ok"), [
    ("2026-12-02T09:00:00Z", True), ("2026-12-02T09:00:00.123+01:00", True), ("2026-12-31T23:59:60Z", True),
    ("2026-02-30T00:00:00Z", False), ("2026-12-02 09:00:00Z", False), ("2026-12-02T24:00:00Z", False),
    ("2026-12-02T09:00:00", False), ("2026-12-02T09:00:00+24:00", False), ("nope", False),
])
def test_date_time_is_rfc_3339(text: str, ok: bool) -> None:
    assert is_date_time(text) is ok


def _bom(**more: object) -> dict:
    return {"bomFormat": "CycloneDX", "specVersion": "1.6", "version": 1, **more}


def test_the_schema_check_names_the_field_and_the_format() -> None:
    assert bom_schema_error(_bom(metadata={"timestamp": "2026-12-02T09:00:00Z"})) == ""
    assert "date-time" in bom_schema_error(_bom(metadata={"timestamp": "yesterday"}))
    assert "externalReferences/0/url" in bom_schema_error(_bom(externalReferences=[{"type": "website",
                                                                                    "url": "http://a b/"}]))
    assert "not-a-type" in bom_schema_error(_bom(components=[{"type": "not-a-type", "name": "x"}]))
    assert "additional" in bom_schema_error(_bom(surprise=True)).lower()


def test_unique_items_is_json_equality_in_linear_time() -> None:
    component = {"type": "library", "name": "x", "version": "1", "bom-ref": "a"}
    assert bom_schema_error(_bom(components=[component, {**component, "bom-ref": "b"}])) == ""
    assert "non-unique" in bom_schema_error(_bom(components=[component, dict(reversed(component.items()))]))
    deps = [{"ref": "a", "dependsOn": ["b", "c"]}, {"ref": "a", "dependsOn": ["c", "b"]}]  # order counts in arrays
    assert bom_schema_error(_bom(dependencies=deps)) == ""


def test_publish_names_the_builds_dockerfile_label() -> None:
    from skupin.builder import build
    from skupin.publishing import publish

    assert publish.DOCKERFILE_LABEL == build.DOCKERFILE_LABEL
