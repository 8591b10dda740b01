"""Capture, verify and match reference bundles: probe outputs on reference hardware plus meta.json and SHA256SUMS.

A bundle is one flat folder: ``tensors.safetensors`` and ``probe.json`` exactly as the probe wrote
them, ``meta.json`` (where, with what and on which inputs they were made) and ``SHA256SUMS`` over
the other three. ``verify`` refuses a bundle with a missing, extra or changed file; ``check_fits``
refuses one made for another model, prompt set or dtype than a SKU's gate asks for.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from skupin import imagetools
from skupin.builder.catalog.manifest import SkuManifest
from skupin.common import __version__
from skupin.common.errors import BundleError
from skupin.common.paths import state_dir
from skupin.common.untrusted import load_json, read_regular_file
from skupin.engines import model_file
from skupin.gates.refdata import fixture, gguf
from skupin.gates.refdata.probe_output import MAX_REPORT_BYTES, decode_report
from skupin.gates.refdata.tensorio import read_safetensors

BUNDLE_FORMAT = "skupin-bundle/1"
# The probe is a folder of modules (skupin/imagetools/probe/: the entry point skupin_probe.py and one adapter per
# engine); PROBE is its entry script, the one a capture runs and the gate's container starts.
PROBE = Path(imagetools.__file__).with_name("probe") / "skupin_probe.py"
PROBE_PATH = "skupin/imagetools/probe/skupin_probe.py"  # PROBE as meta.json's probe_command names it
FIXTURES = Path(__file__).parents[1] / "fixtures"  # gates/fixtures/
SUMS = "SHA256SUMS"
FILES = ("meta.json", "probe.json", "tensors.safetensors")
DEFAULT_TIMEOUT_S = 1800
MAX_META_BYTES = 16 * 1024**2


MAX_SUMS_BYTES = 1024**2  # a bundle's SHA256SUMS names a handful of files


def bundle_sha256(folder: Path) -> str:
    """The bundle's identity: sha256 of its SHA256SUMS (which names the sha256 of every file), read bounded and never
    through a link or from a FIFO (UntrustedInputError, a BundleError: a catalog's bundle is a trust input)."""
    return hashlib.sha256(read_regular_file(Path(folder) / "SHA256SUMS", max_bytes=MAX_SUMS_BYTES)).hexdigest()


def probe_sha256(folder: Path | None = None) -> str:
    """The probe's identity: sha256 of the SHA256SUMS-format listing (``<sha256>  <name>``, sorted by name) of every
    ``*.py`` file of its folder (PROBE's, by default): ``cd skupin/imagetools/probe && LC_ALL=C sha256sum *.py |
    sha256sum`` prints it. Provenance only: the gate compares a probe's outputs with a bundle's, never its bytes
    (docs/REFERENCES.md, "The probe's hash")."""
    folder = Path(folder) if folder is not None else PROBE.parent
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.py")) if p.is_file()}
    return hashlib.sha256(fixture.sums_text(files).encode()).hexdigest()


def fixture_folder(*, name: str, model_dir: Path | None, scratch: Path) -> Path:
    """The checked fixture folder: `model_dir`, the committed one, or a fresh generation in `scratch`."""
    if model_dir is None:
        committed = FIXTURES / name
        model_dir = committed if committed.is_dir() else scratch / name
        if not model_dir.is_dir():
            fixture.generate_fixture(name=name, out=model_dir)
            if fixture.EXPECTED.get(name):  # generate_fixture compared every file's sha256 with EXPECTED already
                return Path(model_dir)
    fixture.check_fixture(name=name, folder=model_dir)
    return Path(model_dir)


def model_folder(*, manifest: SkuManifest, scratch: Path, fixture_dir: Path | None = None) -> Path:
    """The folder the SKU's engine gets at engines.MODEL_MOUNT: its checked fixture folder, or for an engine that loads
    a GGUF (engines.model_file) a new folder in `scratch` holding the fixture's files and the checked GGUF under the
    name the engine's server launch loads (gates/refdata/gguf.py). The probe and the serve check mount the same folder."""
    try:
        wanted = model_file(manifest)
    except ValueError as exc:
        raise BundleError(f"{manifest.name}: gate.weights: {exc}") from exc
    folder = fixture_dir if fixture_dir is not None else fixture_folder(name=manifest.gate.model, model_dir=None,
                                                                        scratch=scratch)
    if wanted is None:
        return folder
    file_type = gguf.file_type_of(wanted)
    path = gguf.gguf_model(folder=folder, name=manifest.gate.model, file_type=file_type, cache=state_dir() / "gguf")
    out = Path(tempfile.mkdtemp(prefix=f"model-{file_type}-", dir=scratch))
    out.rmdir()
    return gguf.model_folder(fixture_dir=folder, gguf_path=path, file_type=file_type, out=out)


def probe_args(*, model_dir: str | Path, out: str | Path, dtype: str, batch_size: int, engine: str,
               checks: str = "env,kernels,model", full_logprobs: int | None = None, threads: int = 0) -> list[str]:
    """The probe's arguments (after the script path), for a host capture and the gate's container alike."""
    args = ["--model", str(model_dir), "--prompts", str(PurePosixPath(model_dir) / "prompts.json"), "--out", str(out),
            "--dtype", dtype, "--batch-size", str(batch_size), "--device", "auto", "--engine", engine,
            "--checks", checks]
    if full_logprobs is not None:
        args += ["--full-logprobs", str(full_logprobs)]
    return args + (["--threads", str(threads)] if threads else [])


def probe_command(*, model_dir: Path, out: Path, dtype: str, batch_size: int, engine: str, full_logprobs: int,
                  threads: int = 0) -> list[str]:
    """The probe's argv for a capture on this host (the current Python, device auto)."""
    return [sys.executable, str(PROBE), *probe_args(model_dir=model_dir, out=out, dtype=dtype, batch_size=batch_size,
                                                    engine=engine, full_logprobs=full_logprobs, threads=threads)]


def run_probe(*, cmd: list[str], timeout_s: int = DEFAULT_TIMEOUT_S) -> dict:
    """Run the probe in a subprocess; return its probe.json, or BundleError with its output tail."""
    out = Path(cmd[cmd.index("--out") + 1])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                              env=probe_environment())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BundleError(f"the probe could not run: {exc}") from exc
    report_path = out / "probe.json"
    if not report_path.is_file():
        raise BundleError(f"the probe exited {done.returncode} without probe.json: {(done.stderr or done.stdout)[-3000:]}")
    report = decode_report(read_regular_file(report_path, max_bytes=MAX_REPORT_BYTES), source=str(report_path))
    if done.returncode != 0:
        failed = {k: v.get("error", "") for k, v in report.get("checks", {}).items() if v.get("status") != "ok"}
        raise BundleError(f"the probe failed on this host (exit {done.returncode}): {failed}")
    return report


def capture(*, manifest: SkuManifest, out: Path, dtype: str | None = None, batch_size: int | None = None,
            model_dir: Path | None = None, engine: str = "transformers", full_logprobs: int | None = None,
            threads: int = 0, model: str | None = None, command: list[str] | None = None) -> Path:
    """Run the probe on this host for the SKU's gate model (or `model`) and write a verified bundle into `out`
    (`full_logprobs`: prompts with full-vocabulary logprobs, by default the fixture's own count, which the gate's
    probe stores too)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise BundleError(f"{out}: already exists and is not empty; choose a new folder")
    gate = manifest.gate
    dtype = dtype or gate.dtype
    batch_size = batch_size or gate.batch_size
    model = model or gate.model
    if full_logprobs is None:
        full_logprobs = fixture.spec_for(model).full_logprobs
    with tempfile.TemporaryDirectory(prefix="skupin-capture-") as scratch:
        folder = fixture_folder(name=model, model_dir=model_dir, scratch=Path(scratch))
        probe_out = Path(scratch) / "probe-out"
        cmd = probe_command(model_dir=folder, out=probe_out, dtype=dtype, batch_size=batch_size, engine=engine,
                            full_logprobs=full_logprobs, threads=threads)
        report = run_probe(cmd=cmd)
        read_safetensors(probe_out / "tensors.safetensors")  # refuse to bundle what the gate could not read
        out.mkdir(parents=True, exist_ok=True)
        for name in ("probe.json", "tensors.safetensors"):
            shutil.copyfile(probe_out / name, out / name)
        meta = make_meta(manifest=manifest, model=model, report=report, folder=folder, dtype=dtype, batch_size=batch_size,
                         engine=engine, probe_cmd=cmd, command=command)
    (out / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    write_sums(folder=out)
    verify(folder=out)
    return out


def make_meta(*, manifest: SkuManifest, model: str, report: dict, folder: Path, dtype: str, batch_size: int, engine: str,
              probe_cmd: list[str], command: list[str] | None) -> dict[str, Any]:
    """meta.json of a bundle: hardware, versions, model and prompt hashes, settings, provenance."""
    env = report.get("env", {})
    device = env.get("device", {})
    model_check = report.get("checks", {}).get("model", {})
    spec = fixture.spec_for(model)
    hashes = fixture.file_hashes(folder)
    return {
        "format": BUNDLE_FORMAT,
        "tool": {"name": "skupin", "version": __version__},
        "created": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "sku": manifest.name,
        "command": command or [],
        "probe_command": [Path(probe_cmd[0]).name, PROBE_PATH, *_relative_args(probe_cmd[2:], folder)],
        "probe_sha256": probe_sha256(),
        "gpu": {"name": device.get("name"), "count": device.get("count"), "type": device.get("type"),
                "capability": device.get("capability"), "arch": device.get("arch"),
                "total_memory": device.get("total_memory")},
        "driver": env.get("driver", {}).get("version"),
        "driver_source": env.get("driver", {}).get("source"),
        "cuda": env.get("cuda"),
        "hip": env.get("hip"),
        "cudnn": env.get("cudnn"),
        "torch": env.get("torch"),
        "triton": env.get("triton"),
        "python": env.get("python"),
        "engine": {"name": engine, "version": model_check.get("engine_version")},
        "cpu": {"model": env.get("cpu_model"), "capability": env.get("cpu_capability"), "threads": env.get("threads")},
        "settings": env.get("settings", {}),
        "model": {"name": spec.name, "sha256": fixture.digest_of(hashes), "files": hashes},
        "prompts": {"sha256": hashes["prompts.json"], "count": model_check.get("num_prompts"),
                    "seq_len": model_check.get("seq_len"), "new_tokens": model_check.get("new_tokens")},
        "seeds": {"weights": spec.weight_seed, "corpus": spec.corpus_seed, "prompts": spec.prompt_seed, "torch": 0},
        "dtype": dtype,
        "batch_size": batch_size,
        "attn_implementation": model_check.get("attn_implementation"),
        "top_k": model_check.get("top_k"),
        "full_logprobs_prompts": model_check.get("full_logprobs_prompts"),
        "tensors": report.get("tensors", {}),
    }


def _relative_args(args: list[str], folder: Path) -> list[str]:
    """Probe arguments with host-specific paths replaced by placeholders (MODEL, OUT)."""
    out, skip = [], None
    for arg in args:
        if skip:
            out.append(skip)
            skip = None
            continue
        out.append(arg)
        skip = {"--model": "MODEL", "--prompts": "MODEL/prompts.json", "--out": "OUT"}.get(arg)
    return out


def write_sums(*, folder: Path) -> dict[str, str]:
    """Write SHA256SUMS over every other file of the flat `folder`; return the hashes."""
    hashes = fixture.file_hashes(folder)
    (Path(folder) / SUMS).write_text(fixture.sums_text(hashes))
    return hashes


def verify(*, folder: Path) -> dict[str, Any]:
    """Check every hash of bundle `folder` (missing, extra, changed files refused); return its meta."""
    folder = Path(folder)
    sums_path = folder / SUMS
    if not sums_path.is_file():
        raise BundleError(f"{sums_path}: missing; the bundle cannot be verified")
    listed = fixture.parse_sums(sums_path.read_text(), source=str(sums_path))
    for entry in sorted(folder.iterdir()):
        if entry.name == SUMS:
            continue
        if not entry.is_file() or entry.is_symlink():
            raise BundleError(f"{entry}: not a regular file; a bundle is a flat folder of files")
        if entry.name not in listed:
            raise BundleError(f"{entry}: extra file not listed in {SUMS}")
    for name in FILES:
        if name not in listed:
            raise BundleError(f"{folder / name}: required bundle file is not listed in {SUMS}")
    for name, digest in sorted(listed.items()):
        path = folder / name
        if not path.is_file():
            raise BundleError(f"{path}: listed in {SUMS} but missing")
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != digest:
            raise BundleError(f"{path}: sha256 {actual} does not match {SUMS} ({digest}); the file was changed")
    meta = load_json(read_regular_file(folder / "meta.json", max_bytes=MAX_META_BYTES), source=str(folder / "meta.json"))
    if not isinstance(meta, dict) or meta.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{folder / 'meta.json'}: format {meta.get('format') if isinstance(meta, dict) else None!r} "
                          f"is not {BUNDLE_FORMAT}")
    return meta


def check_fits(*, meta: dict[str, Any], manifest: SkuManifest) -> None:
    """Refuse a bundle made for another model, model bytes, prompt set or dtype than the SKU's gate."""
    gate = manifest.gate
    problems = []
    model = meta.get("model", {})
    if model.get("name") != gate.model:
        problems.append(f"model {model.get('name')!r}, the SKU gates with {gate.model!r}")
    else:
        expected = fixture.EXPECTED.get(gate.model) or {}
        if model.get("sha256") != fixture.fixture_digest(gate.model):
            problems.append(f"model sha256 {model.get('sha256')} differs from the recorded fixture digest")
        if meta.get("prompts", {}).get("sha256") != expected.get("prompts.json"):
            problems.append("prompt-set sha256 differs from the fixture's prompts.json")
        stored, wanted = meta.get("full_logprobs_prompts"), fixture.spec_for(gate.model).full_logprobs
        if not isinstance(stored, int) or isinstance(stored, bool) or stored < wanted:
            problems.append(f"it stores full-vocabulary logprobs for {stored!r} prompts and the gate's probe stores "
                            f"{wanted} (the fixture's full_logprobs); fix: capture it again with --full-logprobs "
                            f"{wanted}")
    if meta.get("dtype") != gate.dtype:
        problems.append(f"dtype {meta.get('dtype')!r}, the SKU gates in {gate.dtype!r}")
    if problems:
        raise BundleError(f"reference bundle does not fit SKU {manifest.name}: " + "; ".join(problems))


def load_bundle(*, folder: Path, manifest: SkuManifest | None = None) -> tuple[dict[str, Any], dict]:
    """Verify a bundle (and its fit to `manifest`), then return (meta, tensors read with tensorio)."""
    meta = verify(folder=folder)
    if manifest is not None:
        check_fits(meta=meta, manifest=manifest)
    tensors, _ = read_safetensors(Path(folder) / "tensors.safetensors")
    return meta, tensors


def probe_environment() -> dict[str, str]:
    """Environment for running the probe on a host: unbuffered, no user site, offline, tokenizers quiet."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONNOUSERSITE": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def float32_manifest(manifest: SkuManifest) -> SkuManifest:
    """The SKU as its float32 pass runs it (the gate's `float32` check, `skupin calibrate --float32`): gate dtype
    float32 and, as its reference, the float32 bundle beside its own."""
    reference = float32_reference(Path(manifest.gate.reference), dtype=manifest.gate.dtype)
    gate = manifest.gate.model_copy(update={"dtype": "float32", "reference": reference.as_posix()})
    return manifest.model_copy(update={"gate": gate})


def float32_reference(reference: Path, *, dtype: str) -> Path:
    """The float32 bundle beside a SKU's reference: the sibling folder named with `float32` in place of the SKU's
    dtype (gates/references/tiny-llama/h200-bfloat16 -> .../h200-float32)."""
    reference = Path(reference)
    if dtype not in reference.name:
        raise BundleError(f"{reference}: the folder name does not contain the SKU's dtype {dtype!r}, so the float32 "
                          f"bundle beside it cannot be named (rule: the same name with 'float32' in place of the dtype)")
    return reference.with_name(reference.name.replace(dtype, "float32"))
