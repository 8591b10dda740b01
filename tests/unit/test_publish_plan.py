"""The publish planner, the record format, verify's judgement and the run summary: no Docker, no network."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from typing import Any

import pytest

from skupin.builder.catalog.lockfile import Lock, LockedBase
from skupin.clients.oci import Manifest
from skupin.common.errors import DockerError, NetworkError, PublishError
from skupin.common.revision import SourcePin
from skupin.pipeline import STAGES, RunSummary, StageResult
from skupin.publishing.attest import BOM_PREDICATE_TYPE, DSSE_MEDIA_TYPE, PREDICATE_TYPE, tolerance_sha256
from skupin.publishing.local_registry import LocalRegistry, render_config
from skupin.publishing.policy import Expected, signed_predicate
from skupin.publishing.publish import (
    OCI_MANIFEST,
    VERIFIED_TAG,
    attestation_artifact,
    attestation_tag,
    find_verdict,
    parse_target,
    plan_publish,
    publish_image,
    read_attestation_layers,
    read_attestations,
    refusals,
    verdict_facts,
)
from skupin.publishing.sbom import BomSummary, DebianPackage, ImageInventory, PythonDistribution
from skupin.publishing.verify import Verification
from tests.data.threads import finishes
from tests.unit.test_attest import SIGNER, TRUSTED

IMAGE = "sha256:" + "1" * 64
OTHER = "sha256:" + "2" * 64
TOL_ENTRY = {"key": {"hardware_class": "cpu-x86_64", "dtype": "float32", "model": "tiny-llama"},
             "kernels": {"silu": 1e-3}, "provenance": {"runs": 3}}
TOLERANCE = {"key": "cpu-x86_64/float32/tiny-llama", "source": "gates/data/tolerances.yaml", "entry": TOL_ENTRY,
             "hard_bounds": {"max_mean_kl": 0.5}}


def lock(salt: str = "a", sku: str = "cpu-x86_64") -> Lock:
    return Lock(sku=sku, manifest_sha256=salt * 64, python="3.11", platform="linux/amd64",
                base=LockedBase(kind="bootstrap", reference="skupin-base/x:1", recipe_sha256="b" * 64),
                layers={"framework": (), "compiler": (), "engine": (), "extras": ()}, dockerfile_sha256="c" * 64,
                resolver="none", tool_version="0.1.0", created="2026-11-29T00:00:00Z")


def verdict(*, image_id: str = IMAGE, lk: Lock | None = None, decision: str = "pass", model: str = "pass",
            sku: str = "cpu-x86_64") -> dict:
    lk = lk or lock()
    checks = [{"name": n, "status": "pass", "reason": ""} for n in ("reference", "boot", "pins", "kernels")]
    checks.append({"name": "model", "status": model, "reason": ""})
    return {"sku": sku, "image_id": image_id, "lock_hash": lk.content_hash(), "decision": decision, "reason": "r",
            "reference": {"path": "x", "sha256": "d" * 64}, "tolerance": TOLERANCE, "checks": checks,
            "created": "2026-11-29T21:00:00+00:00"}


def expected(lk: Lock | None = None) -> Expected:
    return Expected(sku="cpu-x86_64", lock_sha256=(lk or lock()).content_hash(), bundle_sha256="d" * 64,
                    tolerance_key=TOLERANCE["key"], tolerance_sha256=tolerance_sha256(TOL_ENTRY), catalog="test")


def plan(v: dict, *, lk: Lock | None = None, image_id: str = IMAGE, exp: Expected | None = None):
    return plan_publish(sku="cpu-x86_64", engine_version="5.24.0+local", lock=lk or lock(), dockerfile_sha256="c" * 64,
                        image_id=image_id,
                        verdict=verdict_facts(v), target=parse_target("127.0.0.1:5000"), push_tag="skupin-push-test",
                        expected=exp or expected(lk))


# ---------------------------------------------------------------- targets and tags


@pytest.mark.parametrize("text, host, url, ns", [
    ("127.0.0.1:5000", "127.0.0.1:5000", "http://127.0.0.1:5000", ""),
    ("http://localhost:5000/", "localhost:5000", "http://localhost:5000", ""),
    ("ghcr.io/Org/team", "ghcr.io", "https://ghcr.io", "org/team"),
    ("https://reg.example:8443/x", "reg.example:8443", "https://reg.example:8443", "x"),
])
def test_parse_target(text, host, url, ns):
    t = parse_target(text)
    assert (t.host, t.url, t.namespace) == (host, url, ns)
    assert t.reference("cpu-x86_64", digest=IMAGE) == f"{host}/{ns + '/' if ns else ''}cpu-x86_64@{IMAGE}"


@pytest.mark.parametrize("bad", ["", "user@host:5000", "ftp://host", "host//x"])
def test_parse_target_rejects(bad):
    with pytest.raises(PublishError):
        parse_target(bad)


def test_attestation_tag():
    assert attestation_tag("sha256:" + "ab" * 32) == "sha256-" + "ab" * 32 + ".att"
    with pytest.raises(PublishError):
        attestation_tag("sha512:abc")


# ---------------------------------------------------------------- refusals


def test_plan_for_a_passing_verdict_names_the_tags():
    import hashlib

    p = plan(verdict())
    both = hashlib.sha256(f"{lock().content_hash()}\n{'c' * 64}".encode()).hexdigest()  # the lock and the Dockerfile
    assert p.tags == (f"5.24.0_local-{both[:12]}", VERIFIED_TAG)  # verified moves last
    assert p.push_reference == "127.0.0.1:5000/cpu-x86_64:skupin-push-test"


@pytest.mark.parametrize("v, lk, image_id, why", [
    (verdict(decision="fail", model="fail"), None, IMAGE, "the gate did not pass"),
    (verdict(image_id=OTHER), None, IMAGE, f"is for image {OTHER}"),
    (verdict(), lock("e"), IMAGE, "current lock is"),
    (verdict(sku="other"), None, IMAGE, "is for SKU other"),
    (verdict(model="skipped"), None, IMAGE, "required checks did not pass: model (skipped)"),
    (verdict(model="fail"), None, IMAGE, "checks did not pass: model fail"),  # decision says pass, a check failed
    ({**verdict(), "reference": None}, None, IMAGE, "names no reference bundle"),
    ({**verdict(), "reference": {"path": "x", "sha256": "e" * 64}}, None, IMAGE, "is not the committed bundle"),
    ({**verdict(), "tolerance": None}, None, IMAGE, "names no tolerance entry"),
    ({**verdict(), "tolerance": {**TOLERANCE, "entry": {**TOL_ENTRY, "kernels": {"silu": float("inf")}}}}, None, IMAGE,
     "is not the committed entry"),
])
def test_plan_refuses(v, lk, image_id, why):
    with pytest.raises(PublishError, match="refusing to publish") as err:
        plan(v, lk=lk, image_id=image_id, exp=expected())
    assert why in str(err.value)


def test_refusals_lists_every_reason():
    facts = verdict_facts(verdict(image_id=OTHER, decision="fail", model="fail"))
    assert len(refusals(sku="cpu-x86_64", image_id=IMAGE, lock_sha256="0" * 64, verdict=facts)) == 5


def test_verdict_facts_rejects_non_verdicts():
    for bad in ({}, {"sku": "x"}, []):
        with pytest.raises(PublishError):
            verdict_facts(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the attestation artifact


def _image_manifest(image_id: str = IMAGE) -> Manifest:
    body = json.dumps({"schemaVersion": 2, "config": {"digest": image_id}}).encode()
    return Manifest(media_type="application/vnd.docker.distribution.manifest.v2+json",
                    digest="sha256:" + hashlib.sha256(body).hexdigest(), body=body)


def test_attestation_artifact_is_laid_out_as_cosign_lays_out_att():
    image = _image_manifest()
    envelope = b'{"payloadType":"application/vnd.in-toto+json"}'
    art = attestation_artifact(envelope=envelope, subject=image)
    m = json.loads(art.manifest)
    assert m["mediaType"] == OCI_MANIFEST and m["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert m["subject"] == {"mediaType": image.media_type, "digest": image.digest, "size": len(image.body)}
    (layer,) = m["layers"]
    assert layer["mediaType"] == DSSE_MEDIA_TYPE and art.layer == envelope
    assert layer["annotations"] == {"dev.cosignproject.cosign/signature": "", "predicateType": PREDICATE_TYPE}
    assert layer["digest"] == "sha256:" + hashlib.sha256(envelope).hexdigest() and layer["size"] == len(envelope)
    assert json.loads(art.config)["rootfs"]["diff_ids"] == [layer["digest"]]
    assert "subject" not in json.loads(attestation_artifact(envelope=envelope, subject=None).manifest)
    # a second attestation (the SBOM) is a second layer of the same manifest, as `cosign attest` appends one
    both = attestation_artifact(envelope=envelope, subject=image, more=((b'{"sbom":1}', BOM_PREDICATE_TYPE),))
    m2 = json.loads(both.manifest)
    assert [la["annotations"]["predicateType"] for la in m2["layers"]] == [PREDICATE_TYPE, BOM_PREDICATE_TYPE]
    assert both.layers == (envelope, b'{"sbom":1}') and both.layer == envelope
    assert json.loads(both.config)["rootfs"]["diff_ids"] == [la["digest"] for la in m2["layers"]]
    assert m2["subject"] == m["subject"]


# ---------------------------------------------------------------- executing with fakes: order and failure


def fake_push(*, docker, client, repository, image_id, tag, on_event):
    """publishing/imagepush.push_image as the fakes do it: the engine's push stands for the image's bytes."""
    return docker.push(f"{repository}:{tag}")


@pytest.fixture(autouse=True)
def _pushes_through_the_fake_engine(monkeypatch):
    import skupin.publishing.publish as publishing

    monkeypatch.setattr(publishing, "push_image", fake_push)


class FakeEngine:
    def __init__(self, *, push_error: bool = False) -> None:
        self.push_error, self.calls = push_error, []

    def tag(self, image, ref):
        self.calls.append(("tag", ref))

    def push(self, ref, on_event=None):
        self.calls.append(("push", ref))
        if self.push_error:
            raise DockerError("pushing failed: denied")
        return IMAGE_MANIFEST.digest

    def remove_image(self, ref, force=False):
        self.calls.append(("untag-local", ref))
        return True


IMAGE_MANIFEST = _image_manifest()
INVENTORY = ImageInventory(
    python=(PythonDistribution(name="torch", version="2.13.0", path="venv/site-packages/torch-2.13.0.dist-info",
                               vendored=False),),
    debian=(DebianPackage(name="libc6", version="2.36-9", arch="amd64"),), os_version="12")


class FakeRegistry:
    def __init__(self, *, down: bool = False) -> None:
        self.down, self.manifests, self.blobs, self.log = down, {}, {}, []

    def ping(self):
        if self.down:
            raise NetworkError("connection refused")

    def get_manifest(self, repo, ref, accept=()):
        if ref == IMAGE_MANIFEST.digest:
            return IMAGE_MANIFEST
        if ref not in self.manifests:
            raise NetworkError("404")
        body, media = self.manifests[ref]
        return Manifest(media_type=media, digest="sha256:" + hashlib.sha256(body).hexdigest(), body=body)

    def find_manifest(self, repo, ref, accept=(), push=False):
        if self.down:
            raise NetworkError("connection refused")
        try:
            return self.get_manifest(repo, ref, accept)
        except NetworkError:
            return None

    def get_blob(self, repo, digest, *, max_bytes=None):
        data = self.blobs[digest]
        if max_bytes is not None and len(data) > max_bytes:
            raise NetworkError(f"sent more than {max_bytes} bytes")
        return data

    def push_blob(self, repo, data):
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        return digest

    def list_tags(self, repo):
        if not self.manifests:
            raise NetworkError("404 NAME_UNKNOWN")
        return tuple(self.manifests)

    def put_manifest(self, repo, ref, body, media_type):
        self.manifests[ref] = (body, media_type)
        self.log.append(ref)
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def delete_tag(self, repo, tag):
        self.log.append(f"delete {tag}")
        return True


def test_attestation_goes_in_before_the_human_tags_and_verified_last(tmp_path):
    reg, eng = FakeRegistry(), FakeEngine()
    p = plan(verdict())
    out = publish_image(plan=p, docker=eng, client=reg, signer=SIGNER, trusted=TRUSTED, lock_folder=tmp_path,  # type: ignore[arg-type]
                        inventory=INVENTORY)
    assert reg.log == [attestation_tag(IMAGE_MANIFEST.digest), p.version_tag, VERIFIED_TAG, "delete skupin-push-test"]
    # one manifest put holds both: the verification attestation, then the SBOM (cosign's one layer per attestation)
    layers = read_attestation_layers(client=reg, repository="cpu-x86_64", digest=IMAGE_MANIFEST.digest)  # type: ignore[arg-type]
    assert [kind for kind, _env in layers] == [PREDICATE_TYPE, BOM_PREDICATE_TYPE]
    assert out.sbom is not None and (out.sbom.python, out.sbom.debian, out.sbom.image) == (1, 1, IMAGE_MANIFEST.digest)
    assert reg.manifests[VERIFIED_TAG][0] == IMAGE_MANIFEST.body  # the tag names exactly the pushed manifest
    assert eng.calls == [("push", f"cpu-x86_64:{p.push_tag}")] and out.leftover_tags == ()  # no local tag is made


def test_the_catalogs_source_is_signed_and_an_older_predicates_shape_is_kept(tmp_path):
    """OCI's image.source and image.revision travel signed, in the predicate; without a git source the field is
    left out, so the predicate has exactly the shape records had before it existed."""
    source = SourcePin(url="https://github.com/acme/catalog", revision="a" * 40, dirty=False)
    for pinned in (source, None):
        reg = FakeRegistry()
        p = plan_publish(sku="cpu-x86_64", engine_version="5.24.0+local", lock=lock(), dockerfile_sha256="c" * 64,
                         image_id=IMAGE, verdict=verdict_facts(verdict()), target=parse_target("127.0.0.1:5000"),
                         push_tag="skupin-push-test", expected=expected(), source=pinned)
        publish_image(plan=p, docker=FakeEngine(), client=reg, signer=SIGNER, trusted=TRUSTED,  # type: ignore[arg-type]
                      lock_folder=tmp_path, inventory=INVENTORY)
        (kind, envelope), _sbom = read_attestation_layers(client=reg, repository="cpu-x86_64",  # type: ignore[arg-type]
                                                          digest=IMAGE_MANIFEST.digest)
        statement = json.loads(base64.b64decode(json.loads(envelope)["payload"]))
        assert ("source" in statement["predicate"]) is (pinned is not None)
        predicate, _keyid = signed_predicate(envelope, trusted=TRUSTED, digest=IMAGE_MANIFEST.digest)
        assert predicate.source == pinned


@pytest.mark.parametrize("fault", ["push", "registry down"])
def test_a_failure_tags_nothing(fault, tmp_path):
    reg, eng = FakeRegistry(down=fault == "registry down"), FakeEngine(push_error=fault == "push")
    with pytest.raises(PublishError, match="nothing was"):
        publish_image(plan=plan(verdict()), docker=eng, client=reg, signer=SIGNER, trusted=TRUSTED, lock_folder=tmp_path,  # type: ignore[arg-type]
                      inventory=INVENTORY)
    assert not [r for r in reg.manifests if not r.startswith("skupin-push-")]
    if fault == "push":
        assert eng.calls == [("push", "cpu-x86_64:skupin-push-test")]


def test_a_pushed_manifest_of_another_image_is_not_tagged(tmp_path):
    class Wrong(FakeEngine):
        pass

    reg = FakeRegistry()
    other = _image_manifest(OTHER)
    plain = reg.get_manifest
    # the pushed digest reads back as another image's manifest (tags still read as they are)
    reg.get_manifest = lambda repo, ref, accept=(): other if ref.startswith("sha256:") else plain(repo, ref, accept)  # type: ignore[method-assign]
    with pytest.raises(PublishError, match="not the gated image"):
        publish_image(plan=plan(verdict()), docker=Wrong(), client=reg, signer=SIGNER, trusted=TRUSTED,  # type: ignore[arg-type]
                      lock_folder=tmp_path, inventory=INVENTORY)
    assert reg.log == ["delete skupin-push-test"]


# ---------------------------------------------------------------- registry config, verify line, run summary


def test_registry_config_is_loopback_with_its_own_storage(tmp_path):
    reg = LocalRegistry(addr="127.0.0.1:5000", folder=tmp_path)
    text = render_config(reg)
    assert "addr: 127.0.0.1:5000" in text and f"rootdirectory: {(tmp_path / 'data').resolve()}" in text
    with pytest.raises(ValueError):
        LocalRegistry(addr="0.0.0.0:5000", folder=tmp_path)


def test_verification_lines():
    ok = Verification(ok=True, ref="r:verified", reference=f"r@{IMAGE}", sku="s", lock_sha256="f" * 64, gate_date="D",
                      catalog="/c")
    ok = ok.model_copy(update={"signer": "a" * 64})
    assert ok.line() == (f"verified: r:verified -> r@{IMAGE} (s, lock ffffffffffff, gate passed D, signed by "
                         "aaaaaaaaaaaa); no SBOM")
    assert ok.model_copy(update={"catalog": None}).line().endswith(
        "aaaaaaaaaaaa; no catalog: not compared with a current lock, bundle or tolerance); no SBOM")
    summary = BomSummary(spec_version="1.6", serial_number="urn:uuid:x", timestamp="t", image=IMAGE, python=47,
                         python_vendored=12, debian=98, components=157)
    assert ok.model_copy(update={"sbom": summary, "sbom_signer": "b" * 64}).line().endswith(
        "signed by aaaaaaaaaaaa); SBOM: 47 Python distributions (+12 vendored), 98 Debian packages (CycloneDX 1.6, "
        "signed by bbbbbbbbbbbb)")
    assert Verification(ok=False, ref="r:x", reason="why").line() == "NOT verified: r:x: why"


def test_find_verdict_returns_the_parsed_data(tmp_path, monkeypatch):
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path))
    assert find_verdict(sku="s", image_id=IMAGE, lock_sha256="f" * 64) is None
    gates = tmp_path / "gates" / "s"

    def put(name: str, text: str, mtime: int):
        (gates / name).mkdir(parents=True)
        path = gates / name / "verdict.json"
        path.write_text(text, encoding="utf-8")
        os.utime(path, (mtime, mtime))
        return path

    match = {"image_id": IMAGE, "lock_hash": "f" * 64, "decision": "pass"}
    older = put("a", json.dumps(match), 100)
    other = {"image_id": IMAGE, "lock_hash": "e" * 64, "decision": "fail"}
    newer = put("b", json.dumps(other), 200)
    assert find_verdict(sku="s", image_id=IMAGE, lock_sha256="f" * 64) == (older, match)
    assert find_verdict(sku="s", image_id=IMAGE, lock_sha256="d" * 64) == (newer, other)  # none matches: the newest
    broken = put("c", "{not json", 300)
    assert find_verdict(sku="s", image_id=IMAGE, lock_sha256="d" * 64) == (broken, None)  # publish_sku reports it


def test_find_verdict_skips_fifos_links_and_nested_json_and_returns_quickly(tmp_path, monkeypatch):
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path))
    gates = tmp_path / "gates" / "s"
    (gates / "good").mkdir(parents=True)
    match = {"image_id": IMAGE, "lock_hash": "f" * 64, "decision": "pass"}
    good = gates / "good" / "verdict.json"
    good.write_text(json.dumps(match))
    os.utime(good, (100, 100))
    future = 4_000_000_000  # year 2096: each of these would be "the newest"
    (gates / "fifo").mkdir()
    os.mkfifo(gates / "fifo" / "verdict.json")
    os.utime(gates / "fifo" / "verdict.json", (future, future))
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({**match, "decision": "forged"}))
    (gates / "link").mkdir()
    (gates / "link" / "verdict.json").symlink_to(outside)
    os.utime(gates / "link" / "verdict.json", (future, future), follow_symlinks=False)
    (gates / "linked-folder").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "verdict.json").write_text(json.dumps({**match, "decision": "forged"}))
    (gates / "deep").mkdir()
    deep = gates / "deep" / "verdict.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    os.utime(deep, (future, future))
    (gates / "folder" / "verdict.json").mkdir(parents=True)
    (gates / "old-run" / "probe").mkdir(parents=True)  # a probe folder of an old run, once container-writable
    planted = gates / "old-run" / "probe" / "verdict.json"
    planted.write_text(json.dumps({**match, "decision": "forged"}))
    os.utime(planted, (future, future))
    found = finishes(lambda: find_verdict(sku="s", image_id=IMAGE, lock_sha256="f" * 64), within=10)
    assert found == (good, match)
    newest = finishes(lambda: find_verdict(sku="s", image_id=IMAGE, lock_sha256="d" * 64), within=10)
    assert newest == (deep, None)  # the newest regular file, unreadable: publish_sku refuses it with the reason


def test_an_unreadable_verdict_is_refused_with_the_reason(tmp_path):
    from skupin.common.errors import PublishError
    from skupin.publishing.publish import _read_verdict

    deep = tmp_path / "verdict.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(PublishError, match="nested"):
        _read_verdict(deep, "s")
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(PublishError, match="not a regular file"):
        finishes(lambda: _read_verdict(tmp_path / "fifo.json", "s"), within=10)
    with pytest.raises(PublishError, match="no gate verdict"):
        _read_verdict(tmp_path / "missing.json", "s")


def test_verification_json_leaves_out_image_id():
    """`verify --json` prints model_dump(mode="json"); the carried image id is not part of it."""
    fields = dict(ok=True, ref="r:verified", reference=f"r@{IMAGE}", sku="s", lock_sha256="f" * 64, gate_date="D")
    carried = Verification(**fields, image_id=IMAGE)
    assert carried.image_id == IMAGE
    assert json.dumps(carried.model_dump(mode="json")) == json.dumps(Verification(**fields).model_dump(mode="json"))


def test_run_summary_table():
    rows = tuple(StageResult(stage=s, result="ok", seconds=1.0) for s in STAGES)
    table = RunSummary(sku="cpu-x86_64", stages=rows, reference=f"r@{IMAGE}").table()
    assert len(table) == len(STAGES) + 2 and table[-1].split()[:3] == ["total", "VERIFIED", "9.0"]
    failed = RunSummary(sku="x", stages=rows[:2], error=PublishError("no")).table()
    assert "FAILED" in failed[-1]


def built_cpu_image() -> tuple[Any, Any]:
    """(BuiltImage, GateVerdict) of the CPU SKU at `lock()`, image IMAGE, Dockerfile "c" * 64: what publish() takes."""
    from skupin.builder.build import BuiltImage
    from skupin.builder.catalog.manifest import load_manifest
    from skupin.builder.catalog.stack import ResolvedStack
    from skupin.gates.judge.verdict import GateVerdict
    from tests.paths import SKUS

    stack = ResolvedStack(manifest=load_manifest(SKUS / "cpu-x86_64.yaml"), manifest_path=SKUS / "cpu-x86_64.yaml",
                          lock=lock(), lock_state="ok")
    built = BuiltImage(sku="cpu-x86_64", image="skupin/cpu-x86_64:x", image_id=IMAGE, tags=(), labels={}, base_id="b",
                       lock_sha256=lock().content_hash(), dockerfile_sha256="c" * 64, layers=(), steps=(), cache_hits=0,
                       total_s=1.0, size_bytes=1, installed={}, created="now", stack=stack)
    gated = GateVerdict.model_validate({**verdict(), "hardware_class": "cpu-x86_64", "image": built.image,
                                        "timings": {"total_s": 1.0}, "tool_version": "0.1.0"})
    return built, gated


def test_the_publish_stage_reads_the_verdict_once_and_attests_what_the_gate_wrote(monkeypatch, tmp_path):
    """publish(built, verdict, target): the verdict object is turned into facts once; the attestation pins its JSON."""
    import skupin.publishing.publish as publishing
    from skupin.dockerd import ImageInfo

    class Engine(FakeEngine):
        def inspect_image(self, ref):  # built by skupin: its labels name the lock and the Dockerfile
            return ImageInfo(id=IMAGE, tags=(), repo_digests=(), size=1, layers=(), created="now",
                             labels={publishing.LOCK_LABEL: lock().content_hash(), "io.skupin.dockerfile-sha256": "c" * 64})

        def layer_dirs(self, ref):  # an image of no layers: its SBOM lists nothing
            return ()

    class Registry(FakeRegistry):
        def __enter__(self):
            return self

        def __exit__(self, *_exc):
            return None

    built, gated = built_cpu_image()
    reg, reads = Registry(), []
    monkeypatch.setattr(publishing, "RegistryClient", lambda _url: reg)
    real = publishing.verdict_facts
    monkeypatch.setattr(publishing, "verdict_facts", lambda data: reads.append(data) or real(data))
    monkeypatch.setattr(publishing, "expected_for", lambda _sku: expected())
    monkeypatch.setenv("SKUPIN_STATE", str(tmp_path))
    out = publishing.publish(built, gated, parse_target("127.0.0.1:5000"), docker=Engine(),  # type: ignore[arg-type]
                             signer=SIGNER, trusted=TRUSTED, verdict_envelope=publishing.sign_verdict(gated, SIGNER))
    assert len(reads) == 1 and out.image_id == IMAGE and out.tags[-1] == VERIFIED_TAG and out.keyid == SIGNER.keyid
    envelope, _sbom = read_attestations(client=reg, repository="cpu-x86_64", digest=IMAGE_MANIFEST.digest)  # type: ignore[arg-type]
    assert out.sbom is not None and (out.sbom.python, out.sbom.debian) == (0, 0)
    from skupin.publishing.policy import evaluate, verdict_sha256

    result = evaluate(envelope, trusted=TRUSTED, digest=IMAGE_MANIFEST.digest, expected=expected(), image_id=IMAGE)
    assert result.ok, result.reasons
    assert result.predicate is not None and result.predicate.verdict_sha256 == verdict_sha256(json.loads(gated.model_dump_json()))


def test_the_signed_record_says_how_the_image_was_built_and_pushed_when_this_host_built_it():
    from skupin.builder.reproducible import LAYER_FORMAT, NormalisedImage
    from skupin.publishing.attest import BuildPin, statement
    from skupin.publishing.imagepush import push_format
    from skupin.publishing.publish import build_pin

    built, _gated = built_cpu_image()
    assert build_pin(built) is None  # an image no rewrite made (built before images were reproducible)
    made = NormalisedImage(image_id=built.image_id, source_id="sha256:" + "9" * 64, epoch=1, kept_layers=1,
                           rewritten_layers=6, seconds=1.0)
    pin = build_pin(built.model_copy(update={"reproducible": made, "builder": "docker 20.10.24+dfsg1"}))
    assert pin == BuildPin(layers=LAYER_FORMAT, push=push_format(), builder="docker 20.10.24+dfsg1")
    assert push_format().startswith("gzip zlib-6 mtime-0, zlib 1.")
    p = plan_publish(sku="cpu-x86_64", engine_version="5.24.0+local", lock=lock(), dockerfile_sha256="c" * 64,
                     image_id=IMAGE, verdict=verdict_facts(verdict()), target=parse_target("127.0.0.1:5000"),
                     expected=expected(), build=pin)
    signed = statement(repository="cpu-x86_64", digest=IMAGE_MANIFEST.digest, predicate=p.predicate)
    assert signed["predicate"]["build"] == {"layers": LAYER_FORMAT, "push": push_format(), "builder": "docker 20.10.24+dfsg1"}
    unpinned = statement(repository="cpu-x86_64", digest=IMAGE_MANIFEST.digest, predicate=plan(verdict()).predicate)
    assert "build" not in unpinned["predicate"]  # an older record's shape
