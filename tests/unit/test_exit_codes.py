"""Exit codes that mean one thing, and one machine-output contract (issue 34): the README's exit-code paragraph is
the error classes' table; with `--json` every failure is one JSON object on stdout; an absent tag (15) is not an
unreachable registry (9); a malformed image reference and an empty catalog are bad input (2); a signature by a key
the catalog does not trust is told apart from one its claimed key does not verify."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from skupin.cli import EPILOG, main
from skupin.clients.oci import RegistryClient, parse_image_ref
from skupin.clients.transport import new_client
from skupin.common import errors
from skupin.common.errors import (
    OTHER_EXIT_CODES,
    ImageRefError,
    NetworkError,
    NotFoundError,
    PublishError,
    error_classes,
    exit_code_table,
)
from skupin.common.model import canonical_json
from skupin.publishing import verify as verifying
from skupin.publishing.attest import EnvelopeError, Signer, TrustedKeys, open_envelope
from tests.paths import REPO, SKUS

DIGEST = "sha256:" + "ab" * 32


# ---------------------------------------------------------------- the table


def _readme_codes() -> dict[int, list[str]]:
    """README.md's exit-code paragraph as code -> what it means (parenthesized asides left out; a code listed twice,
    as 0 is for `skupin ab`, has both meanings)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("Exit codes:")
    paragraph = text[start + len("Exit codes:"):text.index("\n\n", start)]
    while re.search(r"\([^()]*\)", paragraph):
        paragraph = re.sub(r"\([^()]*\)", "", paragraph)
    paragraph = re.split(r"\.\s", " ".join(paragraph.split()) + " ", maxsplit=1)[0]  # the list ends at its full stop
    found: dict[int, list[str]] = {}
    for item in re.split(r"[,;]", paragraph):
        match = re.fullmatch(r"\s*(?:`skupin ab`:\s*)?(\d+)\s+(.+?)\s*", item)
        assert match, f"README exit codes: {item!r} is not '<code> <meaning>'"
        found.setdefault(int(match.group(1)), []).append(match.group(2))
    return found


def test_the_readme_paragraph_is_the_error_classes_table():
    readme = _readme_codes()
    table = exit_code_table()
    assert set(readme) == set(table), f"README lists {sorted(readme)}, the code has {sorted(table)}"
    for cls in error_classes():
        assert cls.summary in readme[cls.exit_code], (
            f"{cls.__name__} exits {cls.exit_code} meaning {cls.summary!r}; the README says {readme[cls.exit_code]}")
    for code, what in OTHER_EXIT_CODES.items():
        assert what in readme[code], (code, what, readme[code])


def test_each_code_means_one_thing():
    """Classes that share a code share its meaning; the codes are the ones the README table lists."""
    meaning: dict[int, str] = {}
    for cls in error_classes():
        assert meaning.setdefault(cls.exit_code, cls.summary) == cls.summary, cls
        assert cls.kind and re.fullmatch(r"[a-z_]+", cls.kind), cls
    assert meaning[15] == NotFoundError.summary and meaning[9] == NetworkError.summary
    assert ImageRefError.exit_code == errors.CatalogError.exit_code == errors.ManifestError.exit_code == 2
    assert NotFoundError.exit_code != NetworkError.exit_code and issubclass(NotFoundError, NetworkError)


def test_help_lists_every_code():
    listed = {int(c) for c in re.findall(r"\b(\d{1,3}) [a-zA-Z]", EPILOG.split("exit codes:")[1].split("(12 hold")[0])}
    assert listed == set(exit_code_table())


# ---------------------------------------------------------------- --json on failure


def _failure(capsys: pytest.CaptureFixture[str], code: int, kind: str) -> dict:
    """The one JSON object on stdout, checked against the contract."""
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    data = json.loads(lines[-1])
    assert data["ok"] is False and isinstance(data["warnings"], list)
    error = data["error"]
    assert set(error) >= {"code", "kind", "file", "field", "message", "fix"}
    assert error["code"] == code and error["kind"] == kind, error
    assert error["message"]
    return data


def test_a_bad_manifest_is_json_on_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bad = tmp_path / "bad.yaml"
    bad.write_text((SKUS / "cpu-x86_64.yaml").read_text().replace("hardware_class:", "hardwre_class:"))
    assert main(["render", str(bad), "--out", str(tmp_path / "out"), "--json"]) == 2
    data = _failure(capsys, 2, "manifest")
    problem = next(p for p in data["error"]["problems"] if p["field"] == "accelerator.hardwre_class")
    assert "did you mean 'hardware_class'" in str(problem["fix"]) and problem["file"].endswith("bad.yaml")


def test_check_json_carries_the_contract_beside_its_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bad = tmp_path / "bad.yaml"
    bad.write_text((SKUS / "cpu-x86_64.yaml").read_text().replace("name: cpu-x86_64", "name: bad")
                   .replace("batch_size: 8", "batch_size: many"))
    assert main(["check", str(bad), "--json", "--no-lock"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["exit_code"] == data["error"]["code"] == 2 and data["manifests"]
    assert any(p["field"] == "gate.batch_size" for p in data["error"]["problems"]), data["error"]
    assert isinstance(data["warnings"], list)
    assert main(["check", str(SKUS / "cpu-x86_64.yaml"), "--json"]) == 0
    good = json.loads(capsys.readouterr().out)
    assert good["ok"] is True and good["error"] is None


def test_an_empty_catalog_is_bad_input_with_a_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "skus").mkdir()
    assert main(["--root", str(tmp_path), "check", "--json"]) == 2
    data = _failure(capsys, 2, "catalog")
    assert "no manifests" in data["error"]["message"] and "--root" in data["error"]["fix"]
    assert main(["--root", str(tmp_path), "check"]) == 2
    assert "error: no manifests (*.yaml) in" in capsys.readouterr().err


def test_a_malformed_image_reference_is_bad_input(capsys: pytest.CaptureFixture[str]):
    for ref in ("127.0.0.1:5000/CPU X:verified", "127.0.0.1:5000/cpu-x86_64@sha256:zz", "127.0.0.1:5000/cpu-x86_64"):
        for command in (["verify", ref], ["inspect", ref]):
            assert main([*command, "--json"]) == 2, (command, ref)
            data = _failure(capsys, 2, "image_reference")
            assert data["error"]["fix"], data
    assert main(["verify", "a b"]) == 2
    assert "is not an image reference" in capsys.readouterr().err
    with pytest.raises(ImageRefError, match="the tag '-x' is not a tag"):
        parse_image_ref("ghcr.io/org/repo:-x")
    assert parse_image_ref("ghcr.io/org/repo:v1.2").tag == "v1.2"  # a good one is still one


def test_an_argparse_refusal_is_json_too(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as stop:
        main(["verify", "--json", "--no-such-flag", "127.0.0.1:5000/x:y"])
    assert stop.value.code == 2
    data = _failure(capsys, 2, "usage")
    assert "--no-such-flag" in data["error"]["message"]


def test_an_os_error_is_json_with_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch):
    import skupin.cli.publish as cli_publish

    def refuse(_args: object) -> int:
        raise PermissionError(13, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(cli_publish, "cmd_inspect", refuse)
    assert main(["inspect", "127.0.0.1:5000/x:y", "--json"]) == 1
    assert _failure(capsys, 1, "file")["error"]["file"] == str(tmp_path / "x")


# ---------------------------------------------------------------- absent (15) vs unreachable (9)


def _registry(handler) -> type:
    """A RegistryClient class whose requests go to `handler` (no socket), with no retries."""

    class Fake(RegistryClient):
        def __init__(self, url: str, **_kw: object) -> None:
            super().__init__(url, retries=0, credentials=None, docker_config=Path("/nonexistent"))
            self.http.client = new_client(timeout=1, transport=httpx.MockTransport(handler))

    return Fake


def _absent(request: httpx.Request) -> httpx.Response:
    return httpx.Response(404, json={"errors": [{"code": "MANIFEST_UNKNOWN"}]})


def _down(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_the_client_tells_absent_from_unreachable():
    with _registry(_absent)("127.0.0.1:5000") as reg, pytest.raises(NotFoundError, match="HTTP 404") as absent:
        reg.resolve("cpu-x86_64", "verified")
    assert absent.value.exit_code == 15 and absent.value.fix
    with _registry(_absent)("127.0.0.1:5000") as reg, pytest.raises(NotFoundError):
        reg.get_manifest("cpu-x86_64", DIGEST)
    with _registry(_down)("127.0.0.1:5000") as reg, pytest.raises(NetworkError) as down:
        reg.resolve("cpu-x86_64", "verified")
    assert not isinstance(down.value, NotFoundError) and down.value.exit_code == 9


@pytest.fixture
def operator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No catalog (an operator's folder) and one trusted key file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SKUPIN_ROOT", raising=False)
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path / "state"))
    key = tmp_path / "trusted.pub"
    key.write_bytes(Signer(ec.generate_private_key(ec.SECP256R1())).public_pem())
    return key


@pytest.mark.parametrize("handler, code, kind", [(_absent, 15, "absent"), (_down, 9, "network")])
def test_verify_and_inspect_exit_15_for_an_absent_tag_and_9_for_a_registry_down(
        operator: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], handler, code, kind):
    monkeypatch.setattr(verifying, "RegistryClient", _registry(handler))
    ref = "127.0.0.1:5000/cpu-x86_64:verified"
    assert main(["verify", ref, "--key", str(operator), "--json"]) == code
    data = _failure(capsys, code, kind)
    assert data["ref"] == ref and data["absent"] is (code == 15) and data["unreachable"] is (code == 9)  # verify's own
    assert main(["verify", ref, "--key", str(operator)]) == code
    assert "NOT verified" in capsys.readouterr().out
    assert main(["inspect", ref, "--key", str(operator), "--json"]) == code
    _failure(capsys, code, kind)


# ---------------------------------------------------------------- whose signature


TRUSTED_SIGNER = Signer(ec.generate_private_key(ec.SECP256R1()))
STRANGER = Signer(ec.generate_private_key(ec.SECP256R1()))
TRUSTED = TrustedKeys({TRUSTED_SIGNER.keyid: (TRUSTED_SIGNER.key.public_key(), "keys/trusted/ci.pub")})


def _statement() -> dict:
    return {"_type": "https://in-toto.io/Statement/v1", "subject": [{"name": "x", "digest": {"sha256": "ab" * 32}}],
            "predicateType": "https://example.com/x", "predicate": {"sku": "cpu-x86_64"}}


def _refusal(envelope: bytes) -> str:
    with pytest.raises(EnvelopeError) as refused:
        open_envelope(envelope, TRUSTED)
    assert refused.value.exit_code == PublishError.exit_code  # the policy refuses both: exit 8
    return str(refused.value)


def test_a_key_this_catalog_does_not_trust_is_named():
    why = _refusal(STRANGER.sign_statement(_statement()))
    assert f"signed by a key this catalog does not trust: {STRANGER.keyid}" in why
    assert "tampered" not in why and "fix:" in why


def test_a_signature_its_claimed_key_does_not_verify_is_tampered_or_re_signed():
    for signer in (TRUSTED_SIGNER, STRANGER):  # the payload changed after a trusted key, or any key, signed it
        env = json.loads(signer.sign_statement(_statement()))
        env["payload"] = base64.b64encode(canonical_json({**_statement(), "predicate": {"sku": "other"}})).decode()
        why = _refusal(canonical_json(env))
        assert f"does not verify with the key that claims it ({signer.keyid[:12]}): tampered or re-signed" in why
    env = json.loads(STRANGER.sign_statement(_statement()))  # re-signed by a stranger, claiming the trusted key
    env["signatures"][0]["publicKey"] = base64.b64encode(TRUSTED_SIGNER.public_der()).decode()
    assert "tampered or re-signed" in _refusal(canonical_json(env))


def test_a_signature_that_names_no_key_says_both_are_possible():
    env = json.loads(STRANGER.sign_statement(_statement()))
    del env["signatures"][0]["publicKey"]  # as `cosign attest` writes it
    why = _refusal(canonical_json(env))
    assert "names no key" in why and "does not trust, or tampered" in why


def test_the_trusted_key_still_verifies_and_the_claim_is_never_trusted():
    got, keyid = open_envelope(TRUSTED_SIGNER.sign_statement(_statement()), TRUSTED)
    assert keyid == TRUSTED_SIGNER.keyid and got["predicate"] == {"sku": "cpu-x86_64"}
    lone = TrustedKeys({STRANGER.keyid: (STRANGER.key.public_key(), "x")})
    env = json.loads(TRUSTED_SIGNER.sign_statement(_statement()))
    env["signatures"][0]["publicKey"] = base64.b64encode(STRANGER.public_der()).decode()  # a false claim
    with pytest.raises(EnvelopeError, match="tampered or re-signed"):
        open_envelope(canonical_json(env), lone)


def test_check_json_lists_each_manifests_warnings_at_the_top_too(capsys) -> None:
    """The contract's `warnings` holds every warning the command gave, a manifest's included (it also stays under the
    manifest's own entry)."""
    from skupin.cli import main

    code = main(["check", "--json", "--no-lock"])
    doc = json.loads(capsys.readouterr().out)
    per_manifest = [w for m in doc["manifests"] for w in m.get("warnings", [])]
    assert code == 0 and doc["ok"] is True and per_manifest
    assert len(doc["warnings"]) >= len(per_manifest) and any("uncalibrated" in w for w in doc["warnings"])


@pytest.mark.parametrize("code", [10, 11, 14])
def test_a_gate_verdicts_exit_code_is_its_error_class(code: int) -> None:
    from skupin.cli.gate import _verdict_error
    from skupin.cli.output import failure

    doc = failure(_verdict_error(code, "the reason"))
    assert doc["ok"] is False and doc["error"]["code"] == code and doc["error"]["message"] == "the reason"


def test_run_json_reports_an_interrupt_as_interrupted(monkeypatch, capsys) -> None:
    """`run --json` ends an interrupt in its summary (exit 130); the contract's kind says "interrupted", not "file"."""
    import skupin.pipeline as pipeline
    from skupin.cli import main

    def stop(options, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "ensure_state", lambda: None)
    monkeypatch.setattr(pipeline, "_flow", stop)
    code = main(["run", "cpu-x86_64", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 130 and doc["interrupted"] is True and doc["ok"] is False
    assert (doc["error"]["code"], doc["error"]["kind"]) == (130, "interrupted")
