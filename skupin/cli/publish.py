"""CLI commands of the publishing stage: `registry up|down|status`, `keys generate|list`, `publish`, `verify`, `pull`, `run`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from skupin.cli.keyless import add_keyless_flags, check_keyless_flags, cmd_verify_keyless
from skupin.cli.output import emit, install_missing_flag
from skupin.cli.output import err as _err
from skupin.cli.output import out as _out
from skupin.common.errors import NetworkError, PublishError, UsageError

if TYPE_CHECKING:
    from skupin.publishing.local_registry import LocalRegistry

# ---------------------------------------------------------------- registry


def _local(args: argparse.Namespace) -> LocalRegistry:
    from skupin.publishing.local_registry import default_registry

    return default_registry(addr=args.addr)


def cmd_registry(args: argparse.Namespace) -> int:
    from skupin.publishing.local_registry import registry_down, registry_status, registry_up

    reg = _local(args)
    if args.registry_command == "up":
        status = registry_up(registry=reg, deadline_s=args.deadline, on_event=_err)
    elif args.registry_command == "down":
        status = registry_down(registry=reg)
    else:
        status = registry_status(registry=reg)
    down = NetworkError(f"the registry {status.url} does not answer", fix="skupin registry up") \
        if args.registry_command == "status" and not status.answering else None
    if args.json:
        emit(status.model_dump(mode="json"), down)
    else:
        _out(f"registry {status.url}: {status.action}")
    return down.exit_code if down else 0


# ---------------------------------------------------------------- publish


def cmd_publish(args: argparse.Namespace) -> int:
    from skupin.dockerd import connect
    from skupin.publishing.publish import publish_sku

    published = publish_sku(sku=args.sku, registry=args.registry, addr=args.addr, verdict_path=args.verdict,
                            image=args.image, docker=connect(), signing_key=args.signing_key, on_event=_err)
    if args.json:
        emit(published.model_dump(mode="json"), indent=2, sort_keys=True)
        return 0
    for tag in published.tags:
        _out(f"  {published.registry}/{published.repository}:{tag}")
    _out(f"  attestation {published.repository}:{published.attestation_tag} (signed by key {published.keyid[:12]})")
    if published.sbom is not None:
        _out(f"  SBOM (CycloneDX {published.sbom.spec_version}, in the same attestation manifest): {published.sbom.line()}")
    if published.leftover_tags:
        _out(f"  note: temporary tag(s) left in the registry: {', '.join(published.leftover_tags)}")
    _out(f"published {published.reference} in {published.total_s:.1f} s (push {published.push_s:.1f} s)")
    return 0


# ---------------------------------------------------------------- verify / pull


def _sku_name(sku: str | None) -> str | None:
    """The SKU an operator names: a name as given (no catalog needed), or a manifest path read for its `name`."""
    if sku is None or not (sku.endswith((".yaml", ".yml")) or "/" in sku):
        return sku
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.common.paths import sku_path

    return load_manifest(sku_path(sku)).name


def cmd_verify(args: argparse.Namespace) -> int:
    from skupin.common.files import writable_file, write_atomic
    from skupin.publishing.verify import verify_reference

    check_keyless_flags(args)
    if args.rebuild:
        return _verify_rebuild(args)
    if args.sigstore_bundle is not None:  # the keyless (Sigstore) attestation instead (skupin/cli/keyless.py)
        return cmd_verify_keyless(args, sku=_sku_name(args.sku))
    if args.sbom_out is not None:
        writable_file(args.sbom_out, flag="--sbom-out")  # before asking any registry
    result = verify_reference(ref=args.ref, sku=_sku_name(args.sku), trusted=args.key or None,
                              require_sbom=args.require_sbom or args.sbom_out is not None)
    refused = None if result.ok else result.error()
    if args.json:
        emit(result.model_dump(mode="json"), refused)
    else:
        _out(f"{result.line()}\n{result.trust_line()}")
    if refused is not None:
        return refused.exit_code
    if args.sbom_out is not None and result.bom is not None:
        write_atomic(args.sbom_out, json.dumps(result.bom, indent=2, sort_keys=True) + "\n")
        if not args.json:
            _out(f"wrote the verified SBOM to {args.sbom_out}")
    return 0


def _verify_rebuild(args: argparse.Namespace) -> int:
    from skupin.dockerd import connect
    from skupin.publishing.rebuild import rebuild_reference

    if args.sigstore_bundle is not None or args.sbom_out is not None or args.require_sbom:
        raise UsageError("--rebuild takes the key-signed record only: leave out --sigstore-bundle, --sbom-out and "
                         "--require-sbom (verify those without --rebuild)")
    result = rebuild_reference(ref=args.ref, docker=connect(), sku=_sku_name(args.sku), trusted=args.key or None,
                               on_event=_err)
    refused = None if result.ok else result.error()
    if args.json:
        emit(result.model_dump(mode="json"), refused)
    else:
        _out(result.line())
    return refused.exit_code if refused is not None else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from skupin.common.untrusted import printable as _shown  # text from a registry: control characters escaped, bounded
    from skupin.publishing.verify import inspect_reference

    found = inspect_reference(ref=args.ref, trusted=args.key or None)
    trusted = any(r.predicate is not None for r in found.records)
    if args.json:
        refused = None if trusted else PublishError(f"{found.reference}: no verification attestation signed by a "
                                                    "trusted key", fix="--key FILE naming the key that signed it, if "
                                                    "you trust it")
        emit(found.model_dump(mode="json"), refused, indent=2, sort_keys=True)
    else:
        _out(f"{found.ref} -> {found.reference}")
        _out(f"trust anchors: {_shown('; '.join(found.trust) or 'none', 2000)}")
        for number, record in enumerate(found.records, 1):
            p, bom = record.predicate, record.sbom
            if bom is not None:
                _out(f"attestation {number}: SBOM signed by {record.signer}")
                for label, value in (("format", f"CycloneDX {bom.spec_version} ({bom.tool})"),
                                     ("serial number", bom.serial_number), ("timestamp", bom.timestamp),
                                     ("image", bom.image), ("components", f"{bom.components}: {bom.line()}")):
                    _out(f"  {label:<17}{_shown(str(value))}")
                continue
            if p is None:
                _out(f"attestation {number}: not read (not signed by a trusted key): {_shown(record.problem)}")
                continue
            _out(f"attestation {number}: signed by {record.signer}")
            for label, value in (("sku", p.sku), ("decision", f"{p.decision}: {p.reason}"), ("image id", p.image_id),
                                 ("lock", p.lock_sha256), ("reference bundle", f"{p.reference.sha256} {p.reference.path}"),
                                 ("tolerance", f"{p.tolerance.key} {p.tolerance.entry_sha256}" if p.tolerance else "none"),
                                 ("gate", f"{p.gate_created} (skupin {p.gate_tool_version})"),
                                 ("published", f"{p.published} (skupin {p.tool_version})"),
                                 ("source", (f"{p.source.url or '(no remote)'} @ {p.source.revision}"
                                             + (" (uncommitted changes)" if p.source.dirty else ""))
                                  if p.source else "not recorded (the catalog was not a git checkout)"),
                                 ("checks", ", ".join(f"{c.name} {c.status}" for c in p.checks))):
                _out(f"  {label:<17}{_shown(str(value))}")
    return 0 if trusted else PublishError.exit_code


def cmd_pull(args: argparse.Namespace) -> int:
    from skupin.dockerd import connect
    from skupin.publishing.local_registry import default_registry
    from skupin.publishing.publish import parse_target
    from skupin.publishing.verify import pull_verified

    target = parse_target(args.registry or default_registry(addr=args.addr).addr)
    result, image_id = pull_verified(sku=str(_sku_name(args.sku)), target=target, docker=connect(),
                                     trusted=args.key or None, require_sbom=args.require_sbom)
    if args.json:
        emit({**result.model_dump(mode="json"), "image_id": image_id})
        return 0
    _out(result.line())
    _out(result.trust_line())
    _out(f"image id {image_id}")
    _out(str(result.reference))
    return 0


# ---------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from skupin.pipeline import RunOptions, run_pipeline

    options = RunOptions(sku=args.sku, registry=args.registry, addr=args.addr, wheelhouse=args.wheelhouse,
                         ca_bundle=args.ca_bundle, no_cache=args.no_cache)
    summary = run_pipeline(options=options, on_event=_err)
    if args.json:
        error = summary.error
        emit({"sku": summary.sku, "reference": summary.reference, "interrupted": summary.interrupted,
              "stages": [s.model_dump(mode="json") for s in summary.stages]}, error,
             kind="interrupted" if summary.interrupted and error is not None else None)
        return 0 if error is None else error.exit_code
    for line in summary.table():
        _out(line)
    if summary.error is not None:
        err = summary.error
        for line in err.lines():
            _err(f"error: {line}")
        return err.exit_code
    return 0


# ---------------------------------------------------------------- keys


def cmd_keys(args: argparse.Namespace) -> int:
    from skupin.publishing.attest import generate_keys, trusted_keys

    if args.keys_command == "generate":
        pair = generate_keys(out=args.out)
        if args.json:
            emit(pair.model_dump(mode="json"), indent=2, sort_keys=True)
            return 0
        _out(f"private key {pair.private} (mode 0600; keep it out of git)")
        _out(f"public key  {pair.public} (key id {pair.keyid})")
        if pair.trusted_copy:
            _out(f"trusted on this machine: {pair.trusted_copy}")
        _out("to let everyone who clones the repository verify what it signs: commit the public key as "
             "keys/trusted/<name>.pub")
        return 0
    keys = trusted_keys(args.key or None)
    none = None if len(keys) else PublishError(
        "no trusted keys: keys/trusted/*.pub, .skupin/keys/trusted/*.pub",
        fix="skupin keys generate, or commit the publisher's public key as keys/trusted/<name>.pub")
    if args.json:
        listed = [{"keyid": k, "source": src} for k, (_key, src) in sorted(keys.keys.items())]
        emit({"keys": listed}, none)  # the list under "keys", with the failure beside it when there are none
        return none.exit_code if none else 0
    for keyid, (_key, source) in sorted(keys.keys.items()):
        _out(f"{keyid}  {source}")
    if none:
        _err(f"error: {none.lines()[0]}")
        return none.exit_code
    return 0


# ---------------------------------------------------------------- registration


def add_commands(sub: argparse._SubParsersAction) -> None:
    """`registry`, `keys`, `publish`, `verify`, `inspect`, `pull`, `run`."""
    from skupin.common.paths import REGISTRY_ADDR as DEFAULT_ADDR
    from skupin.common.paths import env_wheelhouse

    p = sub.add_parser("registry", help="the default local OCI registry: up, down, status (127.0.0.1:5000)")
    rsub = p.add_subparsers(dest="registry_command", metavar="ACTION", required=True)
    for action, text in (("up", "start it (Debian's docker-registry; --install-missing installs it); never touches a "
                                "running one"),
                         ("down", "stop the registry skupin started (data kept)"),
                         ("status", "does it answer, and did skupin start it (exit 9 when it does not answer)")):
        q = rsub.add_parser(action, help=text)
        q.add_argument("--addr", default=DEFAULT_ADDR, help=f"loopback host:port (default {DEFAULT_ADDR})")
        q.add_argument("--json", action="store_true", help="print the status as JSON")
        if action == "up":
            q.add_argument("--deadline", type=float, default=20, metavar="S", help="seconds to wait for it (default 20)")
            install_missing_flag(q)
        q.set_defaults(func=cmd_registry)

    p = sub.add_parser("keys", help="signing keys of the attestation: generate a key pair, list the trusted keys")
    ksub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    q = ksub.add_parser("generate", help="write signing.key (ECDSA P-256, mode 0600) and signing.pub; default folder "
                                         ".skupin/keys/ (git-ignored), whose key is also trusted on this machine")
    q.add_argument("--out", type=Path, metavar="DIR",
                   help="folder for signing.key and signing.pub (not inside the repository; not trusted automatically)")
    q.add_argument("--json", action="store_true", help="print the paths and key id as JSON")
    q.set_defaults(func=cmd_keys)
    q = ksub.add_parser("list", help="the trusted public keys verify and pull use (exit 8 when there are none)")
    q.add_argument("--key", type=Path, action="append", metavar="FILE", help="list these files' keys instead")
    q.add_argument("--json", action="store_true", help="print the key ids and their files as JSON (a list under \"keys\")")
    q.set_defaults(func=cmd_keys)

    p = sub.add_parser("publish", help="push a gated image by digest, store its signed attestation, move its tags")
    p.add_argument("sku", help="SKU name (skus/<name>.yaml) or manifest path")
    p.add_argument("--registry", metavar="URL", help="host[:port][/namespace] (default: the local registry)")
    p.add_argument("--addr", default=DEFAULT_ADDR, help=argparse.SUPPRESS)
    p.add_argument(
        "--verdict",
        type=Path,
        metavar="FILE",
        help="the gate verdict (default: the newest under .skupin/gates/SKU/ for this image and lock)",
    )
    p.add_argument("--image", metavar="REF", help="the image to publish (default: the SKU's content-addressed tag)")
    p.add_argument("--signing-key", type=Path, metavar="FILE",
                   help="ECDSA P-256 private key (PEM) that signs the attestation (default: $SKUPIN_SIGNING_KEY, else "
                        ".skupin/keys/signing.key; make one with `skupin keys generate`); its public key must be trusted")
    p.add_argument("--json", action="store_true", help="print the published image as JSON")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("verify", help="operators: does REF resolve to a digest with a signed attestation that passes "
                                      "publish's policy (trusted key, this digest, this SKU, required checks, committed "
                                      "bundle and tolerance, current lock), and a signed SBOM about that digest when one "
                                      "is stored? exit 8 when not, 15 when the registry has no such tag, 9 when it cannot "
                                      "be reached, 2 when REF is not an image reference. A catalog found by walking up from "
                                      "here counts only when you (or root) own it and no one else can write it (--root names one "
                                      "you trust); the answer lists the trust anchors it used")
    p.add_argument("ref", help="host/repo:tag or host/repo@sha256:..., e.g. 127.0.0.1:5000/cpu-x86_64:verified")
    p.add_argument("--sku", help="the SKU the image must be attested for, by name or manifest path (default: the "
                                 "repository's last path part)")
    p.add_argument("--key", type=Path, action="append", metavar="FILE",
                   help="trusted public key (PEM); repeatable; replaces the default keys/trusted/*.pub and "
                        ".skupin/keys/trusted/*.pub")
    p.add_argument("--require-sbom", action="store_true",
                   help="refuse an image with no SBOM attestation (default: verified, and the line says 'no SBOM')")
    p.add_argument("--sbom-out", type=Path, metavar="FILE",
                   help="write the verified CycloneDX SBOM (JSON) to FILE; implies --require-sbom")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.add_argument("--rebuild", action="store_true",
                   help="after verifying, build the image again here from the lock the signed record names (no "
                        "BuildKit cache, a fresh context; needs the catalog at that lock and a Docker engine) and compare "
                        "manifest digests: exit 0 when equal, 8 naming the first differing layer and file when not. "
                        "Checks a published image without trusting the machine that built it (docs/REPRODUCIBLE.md)")
    add_keyless_flags(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="operators: print the signed records (attestations) stored for REF's digest: SKU, "
                                       "gate decision and checks, lock, reference bundle, tolerance, dates, and the "
                                       "SBOM's package counts; only what a "
                                       "trusted key signed is shown; exit 8 when nothing is, 15 when the registry has no "
                                       "such tag, 9 when it cannot be reached")
    p.add_argument("ref", help="host/repo:tag or host/repo@sha256:..., e.g. 127.0.0.1:5000/cpu-x86_64:verified")
    p.add_argument("--key", type=Path, action="append", metavar="FILE",
                   help="trusted public key (PEM); repeatable; replaces the default keys/trusted/*.pub and "
                        ".skupin/keys/trusted/*.pub")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("pull", help="pull the verified digest of a SKU (not a tag); prints name@sha256:... last")
    p.add_argument("sku", help="SKU name, or a manifest path (its name is used)")
    p.add_argument("--registry", metavar="URL", help="host[:port][/namespace] (default: the local registry)")
    p.add_argument("--addr", default=DEFAULT_ADDR, help=argparse.SUPPRESS)
    p.add_argument("--key", type=Path, action="append", metavar="FILE",
                   help="trusted public key (PEM); repeatable; replaces the default keys/trusted/*.pub and "
                        ".skupin/keys/trusted/*.pub")
    p.add_argument("--require-sbom", action="store_true", help="refuse an image with no SBOM attestation")
    p.add_argument("--json", action="store_true", help="print the verification and the local image id as JSON")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("run", help="the whole pipeline: check, lock, docker, base, build, gate, registry, publish, verify "
                                   "(signs with $SKUPIN_SIGNING_KEY or .skupin/keys/signing.key; on a fresh machine it "
                                   "generates that key and trusts it on this machine, and says so)")
    p.add_argument("sku", nargs="?", default="cpu-x86_64", help="SKU name (default cpu-x86_64)")
    p.add_argument("--registry", metavar="URL", help="host[:port][/namespace] (default: the local registry, started if needed)")
    p.add_argument("--addr", default=DEFAULT_ADDR, help=argparse.SUPPRESS)
    p.add_argument("--wheelhouse", type=Path, metavar="DIR", default=env_wheelhouse(),
                   help="local wheels (default $SKUPIN_WHEELHOUSE, else /opt/wheels when present)")
    p.add_argument("--ca-bundle", type=Path, metavar="FILE",
                   help="extra CA bundle for pip (default: the host's, when TLS is intercepted)")
    p.add_argument("--no-cache", action="store_true", help="build every layer again")
    p.add_argument("--json", action="store_true", help="print the stages' results and the verified reference as JSON")
    install_missing_flag(p)
    p.set_defaults(func=cmd_run)

