"""`skupin verify REF --sigstore-bundle FILE` (issue 30): the keyless (Sigstore) attestation CI publishes, checked with
sigstore-python against an offline trust root and exactly the identity the operator names.

The Sigstore material is real (tests/data/sigstore/README.md): a DSSE bundle sigstore-python's tests sign on Sigstore's
staging instance from a GitHub Actions workflow, with the staging trusted root. It signs a statement about a file, not
about one of our images, so the subject check is tested on its own with the digest the statement carries, and the
policy on the predicate with a verifier stub that returns our statement for that real certificate."""

from __future__ import annotations

import base64
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from skupin.builder.catalog.lockfile import lock_path, read_lock
from skupin.cli import main
from skupin.common import paths
from skupin.common.errors import NetworkError, PublishError, SkupinError, UsageError
from skupin.publishing import keyless
from skupin.publishing.attest import CheckOutcome, ReferencePin, TolerancePin, VerificationPredicate
from skupin.publishing.keyless import (
    GITHUB_ISSUER,
    KeylessIdentity,
    identity_from,
    read_bundles,
    sigstore_verifier,
    statement_predicate,
    verified_statement,
    verify_keyless,
    workflow_identity,
)
from skupin.publishing.policy import Expected
from tests.paths import REPO

pytest.importorskip("sigstore")

DATA = REPO / "tests" / "data" / "sigstore"
BUNDLE = DATA / "a.dsse.staging-rekor-v2.txt.sigstore.json"
ROOT = DATA / "staging_trusted_root.json"
SIGNER = KeylessIdentity(identity="https://github.com/sigstore-conformance/extremely-dangerous-public-oidc-beacon/"
                                  ".github/workflows/extremely-dangerous-oidc-beacon.yml@refs/heads/main")
ASSET_DIGEST = "sha256:a0cfc71271d6e278e57cd332ff957c3f7043fdda354c4cbb190a30d56efa01bf"  # a.txt, the statement's subject
SLSA = "https://slsa.dev/provenance/v1"
OTHER = "sha256:" + "e" * 64


@pytest.fixture(scope="module")
def verifier() -> Any:
    return sigstore_verifier(trusted_root=ROOT, offline=True)[0]


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An operator outside any catalog, whose state stays in tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(paths.ROOT_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".cache"))
    return tmp_path


# ---------------------------------------------------------------- sigstore: trust root, identity, tampering


def test_a_real_bundle_verifies_offline_with_its_identity_and_its_subject_is_checked(verifier: Any) -> None:
    [text] = read_bundles(BUNDLE)
    statement = verified_statement(text, verifier=verifier, identity=SIGNER)
    predicate = statement_predicate(statement, digest=ASSET_DIGEST, predicate_type=SLSA)
    assert predicate["buildDefinition"]["buildType"].startswith("https://github.com/sigstore-conformance/")


@pytest.mark.parametrize("identity", [
    workflow_identity("acme/skupin"),  # ours: the beacon workflow did not sign as it
    SIGNER.model_copy(update={"identity": SIGNER.identity.replace("refs/heads/main", "refs/heads/dev")}),
    SIGNER.model_copy(update={"issuer": "https://accounts.google.com"}),
], ids=["another-repository", "another-branch", "another-issuer"])
def test_another_identity_is_refused(verifier: Any, identity: KeylessIdentity) -> None:
    [text] = read_bundles(BUNDLE)
    with pytest.raises(PublishError, match="does not verify") as caught:
        verified_statement(text, verifier=verifier, identity=identity)
    assert caught.value.exit_code == 8 and "\n" not in str(caught.value)


def test_the_run_must_be_the_named_repositorys_not_a_caller_of_its_workflow(verifier: Any) -> None:
    """The SAN names the workflow file; a reusable workflow called from another repository carries the same SAN.
    The certificate's source repository and ref (Fulcio's OIDs ...1.12 and ...1.14) must be the named ones too."""
    [text] = read_bundles(BUNDLE)
    repo = "https://github.com/sigstore-conformance/extremely-dangerous-public-oidc-beacon"
    own = SIGNER.model_copy(update={"source_repository": repo, "source_ref": "refs/heads/main"})
    assert verified_statement(text, verifier=verifier, identity=own)["_type"]
    for caller in ({"source_repository": "https://github.com/attacker/caller"}, {"source_ref": "refs/heads/dev"}):
        with pytest.raises(PublishError, match="does not verify"):
            verified_statement(text, verifier=verifier, identity=own.model_copy(update=caller))


def test_a_statement_whose_subject_is_not_a_list_is_refused_not_a_traceback() -> None:
    statement = {"_type": "https://in-toto.io/Statement/v1", "predicateType": SLSA, "subject": 5, "predicate": {}}
    with pytest.raises(PublishError, match="not a list"):
        statement_predicate(statement, digest=ASSET_DIGEST, predicate_type=SLSA)


def test_a_statement_about_another_digest_or_of_another_type_is_refused(verifier: Any) -> None:
    statement = verified_statement(read_bundles(BUNDLE)[0], verifier=verifier, identity=SIGNER)
    with pytest.raises(PublishError, match=r"subject is sha256:a0cfc71271d6.*not sha256:eeeeeeeeeeee"):
        statement_predicate(statement, digest=OTHER, predicate_type=SLSA)
    with pytest.raises(PublishError, match="predicateType is 'https://slsa.dev/provenance/v1', not https://skupin.dev"):
        statement_predicate(statement, digest=ASSET_DIGEST)
    with pytest.raises(PublishError, match="not an in-toto Statement v1"):
        statement_predicate({**statement, "_type": "https://in-toto.io/Statement/v0.1"}, digest=ASSET_DIGEST,
                            predicate_type=SLSA)


def _tampered(path: Path, edit: Any) -> Path:
    bundle = json.loads(BUNDLE.read_text())
    edit(bundle)
    path.write_text(json.dumps(bundle))
    return path


def _swap_subject(bundle: dict[str, Any]) -> None:
    envelope = bundle["dsseEnvelope"]
    payload = base64.b64decode(envelope["payload"]).replace(ASSET_DIGEST[7:].encode(), OTHER[7:].encode())
    envelope["payload"] = base64.b64encode(payload).decode()


def _flip_signature(bundle: dict[str, Any]) -> None:
    sig = bytearray(base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"]))
    sig[-5] ^= 1
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()


def _drop_certificate(bundle: dict[str, Any]) -> None:
    del bundle["verificationMaterial"]["certificate"]


@pytest.mark.parametrize(("edit", "why"), [
    (_swap_subject, "DSSE: invalid signature"),  # the statement re-pointed at another image: its signature breaks
    (_flip_signature, "not enough sources of verified time"),  # the timestamp authority signed the original signature
    (_drop_certificate, "failed to load bundle"),
])
def test_a_tampered_bundle_is_refused(verifier: Any, tmp_path: Path, edit: Any, why: str) -> None:
    [text] = read_bundles(_tampered(tmp_path / "bundle.json", edit))
    with pytest.raises(PublishError, match=f"does not verify: {why}"):
        verified_statement(text, verifier=verifier, identity=SIGNER)


def _production_root() -> Path:
    from importlib.resources import files

    return Path(str(files("sigstore") / "_store" / "https%3A%2F%2Ftuf-repo-cdn.sigstore.dev" / "trusted_root.json"))


def test_another_trust_root_refuses_the_bundle() -> None:
    other, _ = sigstore_verifier(trusted_root=_production_root(), offline=True)
    with pytest.raises(PublishError, match="does not verify: not enough sources of verified time"):
        verified_statement(read_bundles(BUNDLE)[0], verifier=other, identity=SIGNER)


def test_json_lines_of_trust_roots_as_gh_prints_them_accept_a_bundle_one_of_them_signed(tmp_path: Path) -> None:
    roots = tmp_path / "trusted_root.jsonl"  # `gh attestation trusted-root`: public-good's and GitHub's, one a line
    roots.write_text("".join(json.dumps(json.loads(p.read_text())) + "\n" for p in (_production_root(), ROOT)))
    both, words = sigstore_verifier(trusted_root=roots, offline=True)
    assert words.startswith(f"Sigstore trusted roots {roots} (sha256 ")
    assert verified_statement(read_bundles(BUNDLE)[0], verifier=both, identity=SIGNER)["_type"]
    with pytest.raises(PublishError, match="root 1: not enough sources.*; root 2: Certificate's SANs do not match"):
        verified_statement(read_bundles(BUNDLE)[0], verifier=both, identity=workflow_identity("acme/skupin"))


# ---------------------------------------------------------------- files and trust roots: one line, the right code


def test_a_missing_linked_fifo_or_oversized_bundle_is_one_line_exit_1(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(BUNDLE)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (tmp_path / "absent.json", link, fifo, tmp_path):
        with pytest.raises(SkupinError) as caught:
            read_bundles(path)
        assert type(caught.value) is SkupinError and caught.value.exit_code == 1, path
        assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    monkeypatch.setattr(keyless, "MAX_BUNDLE_BYTES", 1024)
    with pytest.raises(SkupinError, match="exceed the limit of 1024") as caught:
        read_bundles(BUNDLE)
    assert caught.value.exit_code == 1


def test_json_lines_and_wrapped_bundles_are_read_and_garbage_is_refused(tmp_path: Path) -> None:
    one = json.loads(BUNDLE.read_text())
    lines = tmp_path / "sha256:x.jsonl"
    lines.write_text(json.dumps(one) + "\n" + json.dumps({"bundle": one, "repository_id": 1}) + "\n")
    assert [json.loads(b) for b in read_bundles(lines)] == [one, one]
    for garbage in ("not json", "[1, 2]", '{"a": 1}\n[2]\n'):
        (tmp_path / "bad.json").write_text(garbage)
        with pytest.raises(PublishError, match="not a Sigstore bundle"):
            read_bundles(tmp_path / "bad.json")


def test_offline_without_a_trust_root_is_a_clear_usage_error() -> None:
    with pytest.raises(UsageError, match="--offline: no Sigstore trust root") as caught:
        sigstore_verifier(trusted_root=None, offline=True)
    assert "--trusted-root FILE" in caught.value.fix and caught.value.exit_code == 2


def test_online_when_tuf_cannot_be_reached_is_a_network_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from sigstore.errors import TUFError
    from sigstore.verify import Verifier

    def unreachable(**_kw: Any) -> Any:
        raise TUFError("Failed to refresh TUF metadata")

    monkeypatch.setattr(Verifier, "production", unreachable)
    with pytest.raises(NetworkError, match="cannot fetch Sigstore's public-good trust root") as caught:
        sigstore_verifier(trusted_root=None, offline=False)
    assert caught.value.exit_code == 9 and "--trusted-root" in caught.value.fix


def test_without_the_sigstore_package_the_fix_is_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "sigstore.verify", None)  # as if sigstore were not installed
    with pytest.raises(UsageError, match="needs the sigstore package") as caught:
        sigstore_verifier(trusted_root=ROOT, offline=True)
    assert "skupin[keyless]" in caught.value.fix


def test_the_key_based_verify_never_imports_sigstore() -> None:
    import subprocess
    import sys

    code = ("import sys; from skupin.cli import build_parser; build_parser(); import skupin.cli.publish; "
            "print(sorted(m for m in sys.modules if m.startswith('sigstore')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert done.stdout.strip() == "[]", done.stdout


def test_a_file_that_is_no_trusted_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root.json").write_text('{"mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=9"}')
    with pytest.raises(UsageError, match="not a Sigstore trusted_root.json"):
        sigstore_verifier(trusted_root=tmp_path / "root.json", offline=True)
    for garbage in ("[]", "", "not json\nat all"):
        (tmp_path / "root.json").write_text(garbage)
        with pytest.raises(UsageError, match="not a Sigstore trusted_root.json"):
            sigstore_verifier(trusted_root=tmp_path / "root.json", offline=True)
    (tmp_path / "link.json").symlink_to(ROOT)
    with pytest.raises(SkupinError, match="cannot be opened") as caught:
        sigstore_verifier(trusted_root=tmp_path / "link.json", offline=True)
    assert caught.value.exit_code == 1


def test_the_identity_is_always_named_and_the_shorthand_is_ci_s_workflow() -> None:
    assert workflow_identity("acme/skupin") == KeylessIdentity(
        identity="https://github.com/acme/skupin/.github/workflows/images.yml@refs/heads/main", issuer=GITHUB_ISSUER,
        source_repository="https://github.com/acme/skupin", source_ref="refs/heads/main")
    assert identity_from(identity=None, issuer=None, repository="acme/skupin") == workflow_identity("acme/skupin")
    assert identity_from(identity="https://x/y", issuer="https://issuer", repository=None).issuer == "https://issuer"
    for bad in (dict(identity=None, issuer=None, repository=None), dict(identity="u", issuer=None, repository="a/b"),
                dict(identity=None, issuer="https://accounts.google.com", repository="a/b"),
                dict(identity=None, issuer=None, repository="acme"), dict(identity=None, issuer=None, repository="a/../b")):
        with pytest.raises(UsageError):
            identity_from(**bad)


# ---------------------------------------------------------------- the whole check: registry, subject, policy


class _Manifest:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = json.dumps(body).encode()

    def json(self) -> Any:
        return json.loads(self.body)


class _Registry:
    """Serves one digest for every tag, its manifest naming config `image_id`."""

    def __init__(self, digest: str, image_id: str = "sha256:" + "1" * 64) -> None:
        self.digest, self.image_id = digest, image_id

    def __call__(self, _host: str) -> _Registry:
        return self

    def resolve(self, _repository: str, _ref: str) -> str:
        return self.digest

    def get_manifest(self, _repository: str, _digest: str) -> _Manifest:
        return _Manifest({"schemaVersion": 2, "config": {"digest": self.image_id}})

    def close(self) -> None:
        pass


def _predicate(**update: Any) -> VerificationPredicate:
    lock = read_lock(lock_path(REPO / "skus" / "cpu-x86_64.yaml"))
    now = datetime.now(UTC).isoformat()
    return VerificationPredicate(
        sku="cpu-x86_64", repository="cpu-x86_64", image_id="sha256:" + "1" * 64, lock_sha256=lock.content_hash(),
        lock=lock.json_data(), reference=ReferencePin(sha256="d" * 64),
        tolerance=TolerancePin(key="cpu/x86_64", entry_sha256="f" * 64), decision="pass", reason="passed",
        checks=tuple(CheckOutcome(name=n, status="pass") for n in ("pins", "boot", "model")),
        verdict_sha256="2" * 64, gate_created=now, gate_tool_version="0.1.0", tool_version="0.1.0", published=now,
    ).model_copy(update=update)


class _Stub:
    """sigstore's identity check on the real certificate, then our statement in place of the asset's payload."""

    def __init__(self, statement: dict[str, Any]) -> None:
        self.statement = statement

    def verify_dsse(self, bundle: Any, policy: Any) -> tuple[str, bytes]:
        policy.verify(bundle.signing_certificate)
        return "application/vnd.in-toto+json", json.dumps(self.statement).encode()


def _statement(digest: str, predicate: VerificationPredicate) -> dict[str, Any]:
    from skupin.publishing.attest import statement

    return statement(repository="ghcr.io/acme/skupin/cpu-x86_64", digest=digest, predicate=predicate)


def _no_catalog(sku: str) -> Expected:
    return Expected(sku=sku, lock_sha256=None, bundle_sha256=None, tolerance_key=None, tolerance_sha256=None,
                    catalog=None)


REF = "ghcr.io/acme/skupin/cpu-x86_64@" + "sha256:" + "c" * 64


def test_an_honest_keyless_record_for_this_digest_verifies_and_names_its_anchors(elsewhere: Path) -> None:
    digest = REF.split("@")[1]
    answer = verify_keyless(ref=REF, bundle=BUNDLE, identity=SIGNER, expect=_no_catalog, client_for=_Registry(digest),
                            verifier=_Stub(_statement(digest, _predicate())))
    assert answer.ok, answer.reason
    assert answer.line().startswith(f"verified (keyless): {REF} -> ghcr.io/acme/skupin/cpu-x86_64@{digest} (cpu-x86_64")
    assert f"signed by {SIGNER.identity} via Sigstore" in answer.line()
    assert any(a.startswith("keyless signer https://github.com/sigstore-conformance/") for a in answer.trust)


@pytest.mark.parametrize(("statement_digest", "predicate", "reason"), [
    (OTHER, {}, "subject is sha256:eeeeeeeeeeee"),
    (None, {"sku": "cpu-x86_64-vllm"}, "for SKU cpu-x86_64-vllm, not cpu-x86_64"),
    (None, {"decision": "fail", "reason": "model"}, "the gate did not pass"),
    (None, {"image_id": "sha256:" + "9" * 64}, "the image's config is sha256:11111111111"),
    (None, {"published": "2020-01-01T00:00:00+00:00"}, "days ago"),
])
def test_the_keyless_record_gets_the_same_policy(elsewhere: Path, statement_digest: str | None,
                                                 predicate: dict[str, Any], reason: str) -> None:
    digest = REF.split("@")[1]
    answer = verify_keyless(ref=REF, bundle=BUNDLE, identity=SIGNER, expect=_no_catalog, client_for=_Registry(digest),
                            verifier=_Stub(_statement(statement_digest or digest, _predicate(**predicate))))
    assert not answer.ok and reason in answer.reason, answer.reason
    assert answer.error().exit_code == 8 and answer.line().startswith("NOT verified (keyless): ")


def test_the_registry_serving_another_digest_is_refused(elsewhere: Path) -> None:
    answer = verify_keyless(ref=REF, bundle=BUNDLE, identity=SIGNER, expect=_no_catalog, client_for=_Registry(OTHER),
                            verifier=_Stub({}))
    assert not answer.ok and "the registry serves sha256:eee" in answer.reason


# ---------------------------------------------------------------- the command line


def _verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["verify", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_cli_checks_the_real_bundle_offline_down_to_its_predicate_type(
        elsewhere: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyless, "RegistryClient", _Registry(ASSET_DIGEST))
    ref = f"ghcr.io/acme/skupin/cpu-x86_64@{ASSET_DIGEST}"
    base = [ref, "--sigstore-bundle", str(BUNDLE), "--trusted-root", str(ROOT), "--offline"]
    code, out, _ = _verify(capsys, *base, "--certificate-identity", SIGNER.identity)
    # sigstore verified the signature, the identity and the subject: what is left is that it is not our predicate
    assert code == 8 and out.startswith(f"NOT verified (keyless): {ref}: the statement's predicateType is "), out
    assert "trust anchors: keyless signer https://github.com/sigstore-conformance/" in out
    code, out, _ = _verify(capsys, *base, "--keyless-identity", "acme/skupin", "--json")
    answer = json.loads(out)
    assert code == 8 and answer["ok"] is False and "Certificate's SANs do not match" in answer["reason"]
    assert answer["error"]["code"] == 8 and answer["identity"].endswith("acme/skupin/.github/workflows/images.yml"
                                                                        "@refs/heads/main")


@pytest.mark.parametrize(("argv", "code", "says"), [
    (["--sigstore-bundle", "{tmp}/absent.json", "--keyless-identity", "acme/skupin", "--trusted-root", str(ROOT)], 1,
     "absent.json: cannot be opened as a regular file"),
    (["--sigstore-bundle", str(BUNDLE), "--trusted-root", str(ROOT)], 2, "needs the identity"),
    (["--sigstore-bundle", str(BUNDLE), "--keyless-identity", "acme/skupin", "--offline"], 2, "--offline: no Sigstore"),
    (["--keyless-identity", "acme/skupin"], 2, "apply only with --sigstore-bundle"),
    (["--sigstore-bundle", str(BUNDLE), "--keyless-identity", "acme/skupin", "--require-sbom"], 2,
     "apply to the key-signed attestations"),
])
def test_the_cli_refuses_bad_keyless_arguments_in_one_line(elsewhere: Path, capsys: pytest.CaptureFixture[str],
                                                            argv: list[str], code: int, says: str) -> None:
    got, out, err = _verify(capsys, "ghcr.io/acme/skupin/cpu-x86_64:verified",
                            *(a.replace("{tmp}", str(elsewhere)) for a in argv))
    assert got == code and says in err, (got, out, err)
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err


def test_verify_help_teaches_the_keyless_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("--sigstore-bundle FILE", "--keyless-identity OWNER/REPO", "--certificate-identity URI",
                   "--trusted-root FILE", "gh attestation download", "skupin[keyless]"):
        assert needle in text, needle


def test_images_yml_cannot_be_called_from_another_repository() -> None:
    """A `workflow_call` trigger would let any repository run images.yml and sign with its SAN; the source-repository
    check refuses such records, and this keeps the trigger out in the first place."""
    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / ".github/workflows/images.yml").read_text())
    triggers = doc.get("on", doc.get(True))  # YAML 1.1 reads a bare `on` as True
    assert "workflow_call" not in (triggers if isinstance(triggers, dict) else {t: None for t in triggers or []})
