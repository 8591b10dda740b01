"""Reference bundles and the safetensors reader: untrusted headers refused, tampering refused, SKU fit checked."""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from skupin.builder.catalog.manifest import load_manifest
from skupin.common.errors import BundleError
from skupin.gates.refdata import bundle, fixture
from skupin.gates.refdata.tensorio import (
    bf16_round,
    decode_safetensors,
    encode_safetensors,
    read_dtypes,
    read_safetensors,
    write_safetensors,
)

REPO = Path(__file__).resolve().parents[2]
REFS = REPO / "gates" / "references" / "tiny-llama"


# ---------------------------------------------------------------- tensorio


def _file(header: dict, data: bytes = b"", *, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def test_tensorio_round_trip_with_bf16_narrowing(tmp_path):
    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4) / 3, "ids": np.array([[1, -2]], dtype=np.int32),
               "h": np.array([0.5, -2.25], dtype=np.float16), "w": np.array([1 + 2**-8, 1 + 3 * 2**-8, -0.1], np.float32)}
    write_safetensors(tmp_path / "x.safetensors", tensors, metadata={"k": "v"}, bf16=["w"])
    back, meta = read_safetensors(tmp_path / "x.safetensors")
    assert meta == {"k": "v"} and read_dtypes(tmp_path / "x.safetensors")["w"] == "BF16"
    for name in ("a", "ids", "h"):
        assert back[name].dtype == tensors[name].dtype and np.array_equal(back[name], tensors[name])
    # ties go to even: 1 + 2^-8 -> 1.0, 1 + 3*2^-8 -> 1 + 2^-6
    assert back["w"][0] == 1.0 and back["w"][1] == np.float32(1 + 2**-6)
    assert np.array_equal(back["w"], bf16_round(tensors["w"]))


def test_tensorio_reads_what_the_reference_safetensors_package_writes(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    arrays = {"x": np.linspace(-1, 1, 10, dtype=np.float32), "y": np.arange(6, dtype=np.int64).reshape(2, 3)}
    st.save_file(arrays, str(tmp_path / "ref.safetensors"))
    back, _ = read_safetensors(tmp_path / "ref.safetensors")
    assert all(np.array_equal(back[k], v) for k, v in arrays.items())
    assert st.load(encode_safetensors(arrays))["y"].tolist() == arrays["y"].tolist()


def _raw(text: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text + data


GOOD = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (b"\x01\x02", "shorter"),
        (_file(GOOD, b"\0" * 8, length=10**9), "header length"),
        (struct.pack("<Q", 5) + b"{nope" + b"\0" * 8, "not valid JSON"),
        (struct.pack("<Q", 4) + b"[1] " + b"\0" * 8, "not a JSON object"),
        (_raw(b'{"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "t": {}}', b"\0"), "duplicate key"),
        (_file({"t": {"dtype": "PICKLE", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "dtype"),
        (_file({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "outside"),
        (_file({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "does not fill"),
        (_file({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8), "invalid shape"),
        (_file({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"\0" * 6), "overlap or hole"),
        (_file({"t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 5), "cover"),
        (_file({"../x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "grammar"),
        (_file({"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "extra": 1}}, b"\0"), "exactly"),
        (_file({"__metadata__": {"a": 1}, **GOOD}, b"\0" * 8), "__metadata__"),
        (_file({"t": {"dtype": "U8", "shape": [1], "data_offsets": [True, 1]}}, b"\0"), "data_offsets"),
    ],
)
def test_tensorio_refuses_malformed_or_malicious_headers(blob, why):
    with pytest.raises(BundleError, match=why):
        decode_safetensors(blob)


def test_tensorio_refuses_files_over_the_size_limit(tmp_path):
    write_safetensors(tmp_path / "big.safetensors", {"x": np.zeros(1000, np.float32)})
    with pytest.raises(BundleError, match="exceed"):
        read_safetensors(tmp_path / "big.safetensors", max_bytes=1000)


# ---------------------------------------------------------------- committed H200 bundles


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe", "deep-llama", "peaked-moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_committed_h200_bundles_verify_and_name_the_h200(model, dtype):
    folder = REFS.parent / model / f"h200-{dtype}"
    meta = bundle.verify(folder=folder)
    assert meta["gpu"]["name"] == "NVIDIA H200" and meta["gpu"]["capability"] == [9, 0]
    assert meta["driver"] and meta["cuda"] and meta["torch"] and meta["triton"] and meta["engine"]["version"]
    assert meta["dtype"] == dtype and meta["model"]["sha256"] == fixture.fixture_digest(model)
    assert meta["prompts"]["sha256"] == fixture.EXPECTED[model]["prompts.json"]
    assert meta["full_logprobs_prompts"] == fixture.spec_for(model).full_logprobs  # what the gate's probe stores
    assert sum(p.stat().st_size for p in folder.iterdir()) < 10 * 1024**2
    _, tensors = bundle.load_bundle(folder=folder)
    assert all(np.isfinite(v).all() for v in tensors.values())


@pytest.fixture()
def copied(tmp_path) -> Path:
    folder = tmp_path / "bundle"
    shutil.copytree(REFS / "h200-bfloat16", folder)
    return folder


def test_tampered_byte_is_refused_naming_the_file(copied):
    path = copied / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="tensors.safetensors.*changed"):
        bundle.verify(folder=copied)


def test_missing_file_is_refused(copied):
    (copied / "probe.json").unlink()
    with pytest.raises(BundleError, match="probe.json.*missing"):
        bundle.verify(folder=copied)


def test_extra_file_is_refused(copied):
    (copied / "evil.py").write_text("print('hi')")
    with pytest.raises(BundleError, match="evil.py.*extra"):
        bundle.verify(folder=copied)


def test_edited_meta_with_rewritten_listing_line_is_refused(copied):
    meta = json.loads((copied / "meta.json").read_text())
    meta["gpu"]["name"] = "Something Else"
    (copied / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(BundleError, match="meta.json"):
        bundle.verify(folder=copied)


def test_missing_or_malformed_sums_are_refused(copied):
    (copied / "SHA256SUMS").write_text("not a sum line\n")
    with pytest.raises(BundleError, match="line 1"):
        bundle.verify(folder=copied)
    (copied / "SHA256SUMS").unlink()
    with pytest.raises(BundleError, match="SHA256SUMS: missing"):
        bundle.verify(folder=copied)


def test_bundle_fit_to_sku():
    cpu = load_manifest(REPO / "skus" / "cpu-x86_64.yaml")
    bundle.check_fits(meta=bundle.verify(folder=REFS / "h200-float32"), manifest=cpu)
    with pytest.raises(BundleError, match="dtype 'bfloat16'"):
        bundle.check_fits(meta=bundle.verify(folder=REFS / "h200-bfloat16"), manifest=cpu)
    meta = bundle.verify(folder=REFS / "h200-float32")
    with pytest.raises(BundleError, match="model sha256"):
        bundle.check_fits(meta={**meta, "model": {**meta["model"], "sha256": "0" * 64}}, manifest=cpu)
    with pytest.raises(BundleError, match="prompt-set"):
        bundle.check_fits(meta={**meta, "prompts": {"sha256": "1" * 64}}, manifest=cpu)
    # fewer full-vocabulary rows than the gate's probe stores: every model check would end in a shape error
    for stored in (1, None, "4", True):
        with pytest.raises(BundleError, match="--full-logprobs 4"):
            bundle.check_fits(meta={**meta, "full_logprobs_prompts": stored}, manifest=cpu)
    bundle.check_fits(meta={**meta, "full_logprobs_prompts": 8}, manifest=cpu)  # more is compared on the common rows


FAKE_PROBE = r'''
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
os.makedirs(out, exist_ok=True)
header = json.dumps({"model.x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
open(os.path.join(out, "tensors.safetensors"), "wb").write(len(header).to_bytes(8, "little") + header + b"\0\0\x80\x3f")
report = {"format": "skupin-probe/1", "status": "ok", "checks": {"env": {"status": "ok"},
          "model": {"status": "ok", "num_prompts": 64, "seq_len": 64, "engine_version": "9.9",
                    "full_logprobs_prompts": int(sys.argv[sys.argv.index("--full-logprobs") + 1])}},
          "env": {"torch": "fake", "device": {"name": "Fake GPU", "count": 1}, "driver": {"version": "1.2"}},
          "tensors": {"model.x": {"dtype": "F32", "shape": [1]}}, "argv": sys.argv[1:]}
json.dump(report, open(os.path.join(out, "probe.json"), "w"))
'''


def test_capture_writes_a_bundle_that_verifies_and_fits(tmp_path, monkeypatch):
    fake = tmp_path / "fake_probe.py"
    fake.write_text(FAKE_PROBE)
    monkeypatch.setattr(bundle, "PROBE", fake)
    cpu = load_manifest(REPO / "skus" / "cpu-x86_64.yaml")
    out = bundle.capture(manifest=cpu, out=tmp_path / "b", batch_size=4, command=["skupin", "x"])
    meta = bundle.verify(folder=out)
    bundle.check_fits(meta=meta, manifest=cpu)
    assert meta["gpu"]["name"] == "Fake GPU" and meta["driver"] == "1.2" and meta["batch_size"] == 4
    assert meta["dtype"] == "float32" and meta["command"] == ["skupin", "x"]
    assert sorted(p.name for p in out.iterdir()) == ["SHA256SUMS", "meta.json", "probe.json", "tensors.safetensors"]
    assert meta["probe_command"][:2] == [Path(sys.executable).name, "skupin/imagetools/probe/skupin_probe.py"]
    assert "OUT" in meta["probe_command"]
    assert meta["probe_command"][meta["probe_command"].index("--full-logprobs") + 1] == "4"  # the fixture's count
    with pytest.raises(BundleError, match="not empty"):
        bundle.capture(manifest=cpu, out=out)
    shaped = load_manifest(REPO / "skus" / "cpu-x86_64-bf16.yaml")  # peaked-moe stores one prompt's full row
    out = bundle.capture(manifest=shaped, out=tmp_path / "shaped", command=["skupin", "x"])
    assert bundle.verify(folder=out)["full_logprobs_prompts"] == 1


def test_the_gates_probe_stores_as_many_full_vocabulary_rows_as_the_fixture_and_its_bundles(tmp_path):
    from skupin.gates.gate import probe_spec

    for sku, rows in (("cpu-x86_64", "4"), ("cpu-x86_64-bf16", "1")):
        spec = probe_spec(manifest=load_manifest(REPO / "skus" / f"{sku}.yaml"), image="img", out=tmp_path / sku,
                          model_dir=tmp_path)
        assert spec.command[spec.command.index("--full-logprobs") + 1] == rows, sku


def test_capture_refuses_when_the_probe_fails(tmp_path, monkeypatch):
    fake = tmp_path / "fail_probe.py"
    fake.write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(bundle, "PROBE", fake)
    with pytest.raises(BundleError, match="without probe.json"):
        bundle.capture(manifest=load_manifest(REPO / "skus" / "cpu-x86_64.yaml"), out=tmp_path / "b")


def test_reference_cli_verify_and_fixture_check(capsys):
    from skupin.cli.reference import main

    assert main(["reference", "verify", str(REFS / "h200-float32"), "--sku", "cpu-x86_64"]) == 0
    assert "NVIDIA H200" in capsys.readouterr().out
    assert main(["reference", "verify", str(REFS / "h200-bfloat16"), "--sku", "cpu-x86_64"]) == BundleError.exit_code
    assert main(["fixture", "generate", "--name", "tiny-llama", "--check"]) == 0
