"""Validate a CycloneDX 1.6 JSON BOM against its JSON schema, checking only the formats that schema uses.

The schema is the one cyclonedx-python-lib ships (bom-1.6 with the spdx, jsf and cryptography-defs schemas it
references, resolved locally, never fetched), applied with jsonschema's Draft 7 validator, as that library's
`JsonStrictValidator` applies it. What differs is the format checker. jsonschema's default one imports, when it is
installed, `rfc3987_syntax`, which builds a Lark grammar of RFC 3987 when imported: about a second of every `skupin
verify` (docs/BENCHMARKS.md, "Verify"). The 1.6 schemas use four formats, checked here with the standard library:

- `date-time`: RFC 3339 (`2026-12-02T09:00:00Z`, an offset, optional fractions; second 60 for a leap second);
- `iri-reference`: RFC 3987's IRI-reference grammar, as one regular expression (an IP literal checked with
  `ipaddress`);
- `uri`: RFC 3986's URI (a scheme, then the same grammar, ASCII only);
- `idn-email`: holds an "@" (what jsonschema checks too).

One keyword is checked by other code than jsonschema's: `uniqueItems`, in linear time (hashing each item) where
jsonschema compares every pair of objects (a BOM of 300 packages: 0.05 s to validate here, 0.15 s with jsonschema's).

jsonschema is imported without the optional libraries of its own format checkers (`rfc3987_syntax` and the others
of LEFT_OUT: for formats checked here, or that no CycloneDX schema uses, such as `duration`, whose library imports
`arrow`); its checkers are never used here, so `publish` (writing) and `verify` (reading) check the same formats the
same way.
"""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import json
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

SCHEMA_PREFIX = "http://cyclonedx.org/schema/"
BOM_SCHEMA = "bom-1.6.SNAPSHOT.schema.json"
REFERENCED = ("spdx.SNAPSHOT.schema.json", "cryptography-defs.SNAPSHOT.schema.json", "jsf-0.82.SNAPSHOT.schema.json")
# jsonschema imports these, when installed, for its own format checkers: of formats checked here, or of formats no
# CycloneDX schema uses (see the module doc)
LEFT_OUT = ("rfc3987_syntax", "rfc3987", "rfc3986_validator", "rfc3339_validator", "isoduration", "webcolors",
            "uri_template", "fqdn", "idna", "jsonpointer")

# ---------------------------------------------------------------- RFC 3987 / RFC 3986, as regular expressions

_UCSCHAR = ("\u00a0-\ud7ff\uf900-\ufdcf\ufdf0-\uffef"
            + "".join(f"\\U{plane:04x}0000-\\U{plane:04x}fffd" for plane in range(1, 14))
            + "\\U000e1000-\\U000efffd")
_IPRIVATE = "\ue000-\uf8ff\\U000f0000-\\U000ffffd\\U00100000-\\U0010fffd"
_SUB_DELIMS = "!$&'()*+,;="
_PCT = "%[0-9A-Fa-f]{2}"


def _grammar(extra_unreserved: str, extra_query: str) -> re.Pattern[str]:
    """URI-reference (RFC 3986) with `extra_unreserved` added to unreserved: with ucschar it is IRI-reference
    (RFC 3987), whose query also takes `extra_query` (iprivate). Groups: scheme, host (of a URI), relative_host."""
    unreserved = f"A-Za-z0-9\\-._~{extra_unreserved}"
    ipchar = f"(?:[{unreserved}{re.escape(_SUB_DELIMS)}:@]|{_PCT})"
    segment_nz_nc = f"(?:[{unreserved}{re.escape(_SUB_DELIMS)}@]|{_PCT})+"
    userinfo = f"(?:[{unreserved}{re.escape(_SUB_DELIMS)}:]|{_PCT})*"
    reg_name = f"(?:[{unreserved}{re.escape(_SUB_DELIMS)}]|{_PCT})*"
    ip_literal = r"\[[0-9A-Fa-f:.]+\]|\[v[0-9A-Fa-f]+\.[" + f"{unreserved}{re.escape(_SUB_DELIMS)}:" + r"]+\]"
    authority = f"(?:{userinfo}@)?(?P<HOST>{ip_literal}|{reg_name})(?::[0-9]*)?"
    abempty = f"(?:/{ipchar}*)*"
    absolute = f"/(?:{ipchar}+(?:/{ipchar}*)*)?"
    rootless = f"{ipchar}+(?:/{ipchar}*)*"
    noscheme = f"{segment_nz_nc}(?:/{ipchar}*)*"
    query = f"(?:\\?(?:{ipchar}|[/?{extra_query}])*)?"
    fragment = f"(?:#(?:{ipchar}|[/?])*)?"
    absolute_form = (f"(?P<scheme>[A-Za-z][A-Za-z0-9+\\-.]*):"
                     f"(?://{authority.replace('HOST', 'host')}{abempty}|{absolute}|{rootless}|)")
    relative_form = f"(?://{authority.replace('HOST', 'relative_host')}{abempty}|{absolute}|{noscheme}|)"
    return re.compile(f"(?:{absolute_form}|{relative_form}){query}{fragment}")


@functools.cache
def _iri_reference() -> re.Pattern[str]:
    return _grammar(_UCSCHAR, _IPRIVATE)  # compiled on first use: tens of milliseconds


@functools.cache
def _uri_reference() -> re.Pattern[str]:
    return _grammar("", "")


_DATE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(\.\d+)?(?:[Zz]|([+-])(\d{2}):(\d{2}))")


def _ip_literal_ok(host: str | None) -> bool:
    if not host or not host.startswith("[") or host.startswith("[v"):
        return True
    try:
        ipaddress.IPv6Address(host[1:-1])
    except ValueError:
        return False
    return True


def is_iri_reference(text: str) -> bool:
    """Whether `text` is an RFC 3987 IRI-reference (an IRI, or a relative reference)."""
    match = _iri_reference().fullmatch(text)
    return match is not None and _ip_literal_ok(match.group("host") or match.group("relative_host"))


def is_uri(text: str) -> bool:
    """Whether `text` is an RFC 3986 URI: ASCII, with a scheme."""
    match = _uri_reference().fullmatch(text)
    return match is not None and match.group("scheme") is not None and _ip_literal_ok(match.group("host"))


def is_date_time(text: str) -> bool:
    """Whether `text` is an RFC 3339 date-time."""
    match = _DATE_TIME.fullmatch(text)
    if match is None:
        return False
    year, month, day, hour, minute, second = (int(match.group(n)) for n in range(1, 7))
    offset_hour, offset_minute = int(match.group(9) or 0), int(match.group(10) or 0)
    if hour > 23 or minute > 59 or second > 60 or offset_hour > 23 or offset_minute > 59:
        return False
    try:
        datetime(year, month, day)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- the validator


def _import_jsonschema() -> Any:
    """jsonschema, imported (when nothing imported it yet) without the optional modules of LEFT_OUT."""
    if "jsonschema" not in sys.modules:
        blocked = [name for name in LEFT_OUT if name not in sys.modules]
        for name in blocked:
            sys.modules[name] = None  # type: ignore[assignment]  # an import of it raises ImportError
        try:
            import jsonschema
        finally:
            for name in blocked:
                if sys.modules.get(name, False) is None:
                    del sys.modules[name]
    import jsonschema

    return jsonschema


def _schema_folder() -> Path:
    spec = importlib.util.find_spec("cyclonedx")  # its folder, without importing the library
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("cyclonedx-python-lib is not installed: it ships the CycloneDX JSON schemas")
    return Path(next(iter(spec.submodule_search_locations))) / "schema" / "_res"


def _format_checker(jsonschema: Any) -> Any:
    checker = jsonschema.FormatChecker(formats=())
    for name, check in (("date-time", is_date_time), ("iri-reference", is_iri_reference), ("uri", is_uri),
                        ("idn-email", lambda text: "@" in text)):
        checker.checks(name)(lambda value, check=check: not isinstance(value, str) or check(value))
    return checker


def _json_key(value: Any) -> Any:
    """A hashable key equal for two JSON values exactly when JSON Schema calls them equal (1 == 1.0, true != 1)."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, dict):
        return ("object", frozenset((k, _json_key(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("array", tuple(_json_key(v) for v in value))
    return ("value", value)  # str, int, float: Python's own equality and hash (hash(1) == hash(1.0))


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Any:
    """`uniqueItems` in linear time. jsonschema's own compares every pair of objects (uniqueItems on `components`
    and `dependencies`, a few hundred objects for an image)."""
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Any] = set()
    for n, item in enumerate(instance):
        key = _json_key(item)
        if key in seen:
            from jsonschema.exceptions import ValidationError

            yield ValidationError(f"the array has non-unique elements (item {n} repeats an earlier one)")
            return
        seen.add(key)


@functools.cache
def bom_validator() -> Validator:
    """The Draft 7 validator of the CycloneDX 1.6 JSON schema (built once per process)."""
    jsonschema = _import_jsonschema()
    from referencing import Registry
    from referencing.jsonschema import DRAFT7

    folder = _schema_folder()

    def load(name: str) -> Any:
        return json.loads((folder / name).read_text(encoding="utf-8"))

    registry: Registry[Any] = Registry().with_resources(
        [(f"{SCHEMA_PREFIX}{name}", DRAFT7.create_resource(load(name))) for name in REFERENCED])
    draft7 = jsonschema.validators.extend(jsonschema.Draft7Validator, {"uniqueItems": _unique_items})
    validator: Validator = draft7(load(BOM_SCHEMA), registry=registry, format_checker=_format_checker(jsonschema))
    return validator


def bom_schema_error(doc: Any) -> str:
    """'' when `doc` (a parsed JSON document) is valid CycloneDX 1.6, else the first error (bounded)."""
    error = next(iter(bom_validator().iter_errors(doc)), None)
    if error is None:
        return ""
    where = "/".join(str(part) for part in error.absolute_path)
    return f"{error.message} (at {where or 'the top'})"[:300]
