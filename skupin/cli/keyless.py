"""`skupin verify REF --sigstore-bundle FILE`: the keyless (Sigstore) attestation CI publishes (skupin/publishing/keyless.py).

The flags are added to `verify`'s parser by `add_keyless_flags`; `cmd_verify` hands over to `cmd_verify_keyless` when
`--sigstore-bundle` is given, and the key-based verify is untouched otherwise. Nothing here imports sigstore.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from skupin.cli.output import emit
from skupin.cli.output import out as _out
from skupin.common.errors import UsageError

KEYLESS_HELP = (
    "Check the keyless attestation images.yml's publish job signs with actions/attest (Sigstore: a Fulcio certificate "
    "for the workflow's GitHub OIDC identity, logged in Rekor) instead of the key-signed one: the bundle must verify "
    "against a Sigstore trust root, be signed by exactly the identity you name, be a statement about the digest REF "
    "resolves to, and its predicate then passes the same policy as the key-signed record (SKU, checks, catalog, "
    "freshness). Get the bundle with `gh attestation download oci://REF --repo OWNER/REPO` (a .jsonl file is fine). "
    "Offline: pass --trusted-root FILE (a trusted_root.json fetched over TUF on a connected machine) and --offline; "
    "without --trusted-root the public-good root is fetched over TUF. Needs `pip install 'skupin[keyless]'`. "
    "Example: skupin verify ghcr.io/acme/skupin/cpu-x86_64@sha256:... --sigstore-bundle att.jsonl "
    "--keyless-identity acme/skupin --trusted-root trusted_root.json --offline. Exit codes as above; 1 when the bundle "
    "or trust root file cannot be read, 2 for missing identity or trust root. --trusted-root also takes JSON lines of "
    "roots (`gh attestation trusted-root`). docs/guide-operator.md, 'Keyless (Sigstore) verification'.")


def add_keyless_flags(parser: argparse.ArgumentParser) -> None:
    """The keyless flags of `skupin verify`, in their own --help group."""
    group = parser.add_argument_group("keyless (Sigstore) verification", KEYLESS_HELP)
    group.add_argument("--sigstore-bundle", type=Path, metavar="FILE",
                       help="a Sigstore bundle (JSON, or JSON lines of bundles) for REF's digest; a regular file of at "
                            "most 16 MiB, not a link")
    group.add_argument("--keyless-identity", metavar="OWNER/REPO",
                       help="shorthand: the certificate identity https://github.com/OWNER/REPO/.github/workflows/"
                            "images.yml@refs/heads/main, issuer https://token.actions.githubusercontent.com")
    group.add_argument("--certificate-identity", metavar="URI",
                       help="the exact certificate identity (subject alternative name) that must have signed, as cosign "
                            "takes it")
    group.add_argument("--certificate-oidc-issuer", metavar="URL",
                       help="the OIDC issuer the certificate must name (default https://token.actions.githubusercontent.com)")
    group.add_argument("--trusted-root", type=Path, metavar="FILE",
                       help="Sigstore trusted_root.json (or JSON lines of roots) to check against, read offline "
                            "(default: the public-good instance's, fetched over TUF)")
    group.add_argument("--offline", action="store_true",
                       help="never fetch a trust root: --trusted-root FILE is then required")


def _keyless_only(args: argparse.Namespace) -> list[str]:
    return [flag for flag, value in (("--keyless-identity", args.keyless_identity),
                                     ("--certificate-identity", args.certificate_identity),
                                     ("--certificate-oidc-issuer", args.certificate_oidc_issuer),
                                     ("--trusted-root", args.trusted_root), ("--offline", args.offline)) if value]


def check_keyless_flags(args: argparse.Namespace) -> None:
    """UsageError for keyless flags without --sigstore-bundle, or key-only flags with it."""
    if args.sigstore_bundle is None:
        if given := _keyless_only(args):
            raise UsageError(f"{', '.join(given)} apply only with --sigstore-bundle FILE", field=given[0],
                             fix="--sigstore-bundle FILE (the keyless attestation), or leave them out")
        return
    keyed = [flag for flag, value in (("--key", args.key), ("--require-sbom", args.require_sbom),
                                      ("--sbom-out", args.sbom_out)) if value]
    if keyed:
        raise UsageError(f"{', '.join(keyed)} apply to the key-signed attestations, not to --sigstore-bundle",
                         field=keyed[0], fix="run skupin verify once without --sigstore-bundle for those")


def cmd_verify_keyless(args: argparse.Namespace, *, sku: str | None) -> int:
    """`skupin verify REF --sigstore-bundle FILE ...`: one answer line (or JSON), the trust anchors, the exit code."""
    from skupin.publishing.keyless import identity_from, verify_keyless

    check_keyless_flags(args)
    identity = identity_from(identity=args.certificate_identity, issuer=args.certificate_oidc_issuer,
                             repository=args.keyless_identity)
    result = verify_keyless(ref=args.ref, bundle=args.sigstore_bundle, identity=identity, trusted_root=args.trusted_root,
                            offline=args.offline, sku=sku)
    refused = None if result.ok else result.error()
    if args.json:
        emit(result.model_dump(mode="json"), refused)
    else:
        _out(f"{result.line()}\n{result.trust_line()}")
    return refused.exit_code if refused is not None else 0
