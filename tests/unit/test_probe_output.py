"""The probe's output frame and what the host does with it, without Docker: strict parsing, host-only files, the spec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from skupin.builder.catalog.manifest import load_manifest
from skupin.common.errors import BundleError
from skupin.dockerd import RunResult
from skupin.gates.gate import MODEL_MOUNT, PROBE_DIR_MOUNT, PROBE_MOUNT, _host_folder, _probe_run, probe_spec
from skupin.gates.refdata.probe_output import decode_outputs, read_output_folder, split_frame
from skupin.gates.refdata.tensorio import encode_safetensors
from skupin.gates.sandbox import sandbox_cpus
from skupin.imagetools.probe import ADAPTERS, FORMAT, FRAME_MAGIC

REPO = Path(__file__).resolve().parents[2]
PROBE_DIR = REPO / "skupin" / "imagetools" / "probe"
FIXTURE = REPO / "gates" / "fixtures" / "tiny-llama"
REPORT = {"format": FORMAT, "status": "ok", "checks": {"env": {"status": "ok"}}, "env": {"python": "3.11.2"}}
TENSORS = {"kernels.x": np.arange(6, dtype=np.float32).reshape(2, 3)}


def frame(report: bytes | None = None, tensors: bytes | None = None) -> bytes:
    report = json.dumps(REPORT).encode() if report is None else report
    tensors = encode_safetensors(TENSORS) if tensors is None else tensors
    return FRAME_MAGIC + len(report).to_bytes(8, "little") + report + len(tensors).to_bytes(8, "little") + tensors


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def decode(data: bytes, **limits):
    report, tensors = split_frame(data, **limits)
    return decode_outputs(report, tensors, source="test")


# ---------------------------------------------------------------- the frame


def test_a_well_formed_frame_decodes() -> None:
    report, tensors = decode(frame())
    assert report == REPORT and np.array_equal(tensors["kernels.x"], TENSORS["kernels.x"])


def test_no_tensor_bytes_means_no_tensors() -> None:
    assert decode(frame(tensors=b""))[1] == {}


@pytest.mark.parametrize("data, why", [
    (b"", "empty"),
    (b"hello " + frame(), "6 bytes before the output frame"),
    (b"plain text only\n", "no output frame at its start"),
    (frame() + b"junk", "4 bytes after the end"),
    (frame()[:10], "no output frame at its start"),
    (frame()[: len(FRAME_MAGIC) + 3], "truncated before the length of probe.json"),
    (frame()[: len(FRAME_MAGIC) + 8 + 5], "truncated: probe.json claims"),
    (frame()[:-1], "truncated: tensors.safetensors claims"),
    (FRAME_MAGIC + (2**63).to_bytes(8, "little"), "more than the limit"),
])
def test_a_malformed_frame_is_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(BundleError, match=why):
        decode(data)


def test_lengths_are_checked_against_their_limits_before_anything_is_read() -> None:
    with pytest.raises(BundleError, match="probe.json claims .* more than the limit of 10"):
        decode(frame(), max_report_bytes=10)
    with pytest.raises(BundleError, match="tensors.safetensors claims .* more than the limit of 100"):
        decode(frame(), max_tensor_bytes=100)


@pytest.mark.parametrize("report, why", [
    (b'{"format": "skupin-probe/1", "deep": ' + nested(100_000) + b"}", "nested"),
    (nested(5), "not a skupin-probe/1 report"),
    (b"[1]", "not a skupin-probe/1 report"),
    (b"{nope", "not valid JSON"),
    (b'{"format": "skupin-probe/1", "v": NaN}', "not valid JSON"),
    (json.dumps({"format": FORMAT, "checks": [1]}).encode(), "checks is a list, not a dict"),
    (json.dumps({"format": FORMAT, "checks": {"env": 1}}).encode(), "checks.env is not an object"),
    (json.dumps({"format": FORMAT, "env": {"distributions": {"torch": 2}}}).encode(), "version strings"),
    (json.dumps({"format": FORMAT, "env": {"driver": "x"}}).encode(), "driver is a str"),
])
def test_a_hostile_probe_json_is_refused(report: bytes, why: str) -> None:
    with pytest.raises(BundleError, match=why):
        decode(frame(report=report))


def test_a_deeply_nested_safetensors_header_is_refused_not_a_recursion_error() -> None:
    header = b'{"t": ' + nested(100_000) + b"}"
    header += b" " * (-len(header) % 8)
    with pytest.raises(BundleError, match="nested"):
        decode(frame(tensors=len(header).to_bytes(8, "little") + header))


def test_the_output_folder_is_read_without_following_links(tmp_path: Path) -> None:
    (tmp_path / "probe.json").write_text(json.dumps(REPORT))
    (tmp_path / "tensors.safetensors").write_bytes(encode_safetensors(TENSORS))
    assert read_output_folder(tmp_path)[0] == REPORT
    (tmp_path / "tensors.safetensors").unlink()
    assert read_output_folder(tmp_path)[1] == {}  # no tensors file: no tensors
    (tmp_path / "elsewhere.json").write_text(json.dumps(REPORT))
    (tmp_path / "probe.json").unlink()
    (tmp_path / "probe.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(BundleError, match="regular file"):
        read_output_folder(tmp_path)


# ---------------------------------------------------------------- the probe's side (a real probe on this host)


def test_the_probe_prints_exactly_one_frame_and_whatever_else_is_printed_goes_to_stderr() -> None:
    pytest.importorskip("torch")
    code = ("import sys; sys.argv = ['skupin_probe.py', '--out', '-', '--checks', 'env']; "
            "import skupin.imagetools.probe.skupin_probe as p; "
            "real = p.pick_device; p.pick_device = lambda n: (print('noise from a library'), real(n))[1]; "
            "sys.exit(p.main())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=600, cwd=REPO, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert b"noise from a library" in done.stderr and b"noise" not in done.stdout
    report, tensors = decode(done.stdout)
    assert report["checks"]["env"]["status"] == "ok" and report["args"]["out"] == "-" and tensors == {}


# ---------------------------------------------------------------- the host's side


def result(stdout: bytes = b"", **kw) -> RunResult:
    fields = dict(exit_code=0, stdout_bytes=stdout, stdout_excerpt="", stderr="probe stderr", timed_out=False,
                  seconds=1.0)
    return RunResult(**{**fields, **kw})


def run(tmp_path: Path, res: RunResult):
    fd = _host_folder(tmp_path / "probe")
    try:
        return _probe_run(res, deadline=60, out_fd=fd)
    finally:
        os.close(fd)


def test_a_good_frame_is_decoded_and_its_raw_parts_written(tmp_path: Path) -> None:
    probe = run(tmp_path, result(frame()))
    assert not probe.error and probe.report == REPORT and set(probe.tensors) == {"kernels.x"}
    out = tmp_path / "probe"
    assert json.loads((out / "probe.json").read_text()) == REPORT
    assert (out / "tensors.safetensors").read_bytes() == encode_safetensors(TENSORS)
    assert "one output frame" in (out / "container.log").read_text()


@pytest.mark.parametrize("res, why", [
    (result(b"junk"), "without usable outputs"),
    (result(frame(report=nested(1000))), "nested"),
    (result(b"", exit_code=None, timed_out=True), "deadline of 60 s"),
    (result(b"", exit_code=137, overflow="stdout passed its cap of 9 bytes (the container was killed)"),
     "printed too much: stdout passed its cap"),
])
def test_every_unusable_output_is_an_error_not_a_traceback(tmp_path: Path, res: RunResult, why: str) -> None:
    probe = run(tmp_path, res)
    assert why in probe.error and probe.report == {} and probe.tensors == {}
    assert not (tmp_path / "probe" / "probe.json").exists()
    assert "probe stderr" in (tmp_path / "probe" / "container.log").read_text()


def test_the_host_never_writes_through_a_planted_link_or_fifo(tmp_path: Path) -> None:
    out = tmp_path / "probe"
    out.mkdir()
    target = tmp_path / "host-file"
    (out / "container.log").symlink_to(target)
    os.mkfifo(out / "probe.json")
    probe = run(tmp_path, result(frame()))
    assert not probe.error and not target.exists()
    assert not (out / "container.log").is_symlink() and (out / "probe.json").is_file()


def test_the_output_folder_may_not_be_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "probe").symlink_to(tmp_path / "real")
    with pytest.raises(BundleError, match="not a folder"):
        _host_folder(tmp_path / "probe")


# ---------------------------------------------------------------- the sandbox spec


def manifest(name: str):
    return load_manifest(REPO / "skus" / f"{name}.yaml")


def test_the_probe_container_gets_no_writable_mount_and_prints_its_outputs(tmp_path: Path) -> None:
    m = manifest("cpu-x86_64")
    spec = probe_spec(manifest=m, image="img", out=tmp_path / "probe", model_dir=FIXTURE)
    assert all(mount.read_only for mount in spec.mounts)
    assert {mount.target for mount in spec.mounts} == {PROBE_DIR_MOUNT, MODEL_MOUNT}
    assert spec.command[0] == PROBE_MOUNT == f"{PROBE_DIR_MOUNT}/skupin_probe.py"
    assert spec.entrypoint == ("/opt/skupin/venv/bin/python3",)  # by absolute path, never through the image's PATH
    assert spec.command[spec.command.index("--out") + 1] == "-"
    assert spec.read_only and spec.network == "none" and spec.deadline_s == m.gate.deadline_s
    assert spec.max_stdout_bytes == 256 * 1024**2 and spec.cpus is not None and spec.cpus >= 1


def test_the_probe_container_gets_the_probes_whole_folder(tmp_path: Path) -> None:
    """The probe is several modules: the folder is mounted (read-only) and holds the entry script and every adapter."""
    spec = probe_spec(manifest=manifest("cpu-x86_64"), image="img", out=tmp_path / "probe", model_dir=FIXTURE)
    (mount,) = (m for m in spec.mounts if m.target == PROBE_DIR_MOUNT)
    assert Path(mount.source) == PROBE_DIR.resolve()
    assert {p.name for p in Path(mount.source).glob("*.py")} >= {"skupin_probe.py", *(f"{m}.py" for m in ADAPTERS.values())}


def test_the_probe_runs_the_kernel_battery_only_where_the_gate_checks_kernels(tmp_path: Path) -> None:
    m = manifest("cpu-x86_64")
    spec = probe_spec(manifest=m, image="img", out=tmp_path / "probe", model_dir=FIXTURE)
    assert spec.command[spec.command.index("--checks") + 1] == "env,kernels,model,ops"
    no_kernels = m.model_copy(update={"gate": m.gate.model_copy(update={"checks": ("boot", "model", "serve")})})
    spec = probe_spec(manifest=no_kernels, image="img", out=tmp_path / "probe", model_dir=FIXTURE)
    assert spec.command[spec.command.index("--checks") + 1] == "env,model,ops"
    # the float32 pass's probe runs the model check alone: the op battery ran at both dtypes in the boot's probe
    spec = probe_spec(manifest=no_kernels, image="img", out=tmp_path / "probe", model_dir=FIXTURE, ops=False)
    assert spec.command[spec.command.index("--checks") + 1] == "env,model"


def test_ipc_is_private_even_where_the_runtime_wants_the_hosts() -> None:
    m = manifest("nvidia-h200-vllm")
    assert m.runtime.ipc == "host"
    spec = probe_spec(manifest=m, image="img", out=Path("/tmp/x"), model_dir=FIXTURE)
    assert spec.ipc == "private" and spec.shm_size == m.runtime.shm_size


def test_cpus_default_to_all_but_half_a_cpu_and_never_exceed_the_host() -> None:
    m = manifest("cpu-x86_64")
    assert m.gate.cpus is None
    assert sandbox_cpus(m, host_cpus=2) == 1.5 and sandbox_cpus(m, host_cpus=1) == 1.0
    assert sandbox_cpus(m, host_cpus=64) == 63.5
    pinned = m.model_copy(update={"gate": m.gate.model_copy(update={"cpus": 4.0})})
    assert sandbox_cpus(pinned, host_cpus=16) == 4.0 and sandbox_cpus(pinned, host_cpus=2) == 2.0


def test_a_host_that_cannot_write_the_outputs_gets_a_boot_error_not_a_traceback(tmp_path: Path, monkeypatch) -> None:
    import errno

    import skupin.gates.gate as gate

    def full_disk(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gate, "write_new_file", full_disk)
    probe = run(tmp_path, result(frame()))
    assert "could not write" in probe.error and os.strerror(errno.ENOSPC) in probe.error
    assert probe.report == {} and probe.tensors == {}
