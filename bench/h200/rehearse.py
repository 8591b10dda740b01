"""Rehearse the GPU half of a gate on the lent H200: the gate's own probe command, judged by the gate's own checks.

No Docker runs on the H200, so no image is gated there. What can run is everything the image would do: the
probe script the gate mounts, with exactly the arguments `gates.gate.probe_spec` gives the SKU's container (the
boot probe at the serving dtype, with the kernel battery, the engine op battery and the model check; the float32
pass's probe, model check only), on the GPU, with the fixture where the container would find it and the sandbox's
environment (its home and caches in a fresh folder). Its output frames come back, and on the development machine
the gate's own check functions (`_check_kernels`, `_check_ops`, `_check_model`, `_check_float32`) judge them
against the committed bundles with the committed tolerance entries, as a Hopper Docker host's gate would after
`pins` and `boot` (the judge refuses when the gate would ask the float32 probe for other arguments than ran).
The committed nvidia-hopper entries were calibrated on the same machine and stack, so a pass shows that the gate's
probe command and its host-side judging run end to end on a GPU and agree with the calibration; it does not show
that an image of the SKU's own engine would pass.

    # on the H200 (pydantic from .whl; the engine: what is installed there, transformers)
    PYTHONPATH=/tmp/site:$PWD python3 bench/h200/rehearse.py run --sku nvidia-h200-vllm --engine transformers \\
        --model peaked-moe --out $OUT/rehearse
    # here
    PYTHONPATH=$PWD .venv/bin/python bench/h200/rehearse.py judge --sku nvidia-h200-vllm --engine transformers \\
        --model peaked-moe --frames DIR

What only a Hopper Docker host can show: `pins` (the image's files against its lock), the sandbox (no network,
read-only root, limits), the image's own Python and libraries (here: the H200 machine's torch 2.11 and
transformers 5.17), the serve check, and every engine not installed there (vLLM, SGLang).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from skupin.builder.catalog.manifest import SkuManifest, load_manifest  # noqa: E402
from skupin.builder.catalog.stack import ResolvedStack  # noqa: E402
from skupin.engines import MODEL_MOUNT  # noqa: E402
from skupin.gates import gate  # noqa: E402
from skupin.gates.refdata.bundle import PROBE, fixture_folder, float32_manifest  # noqa: E402
from skupin.gates.refdata.probe_output import decode_outputs, split_frame  # noqa: E402
from skupin.gates.sandbox import SANDBOX_ENV  # noqa: E402

FRAMES = {"boot": "boot.frame", "float32": "float32.frame"}


def manifest_for(sku: str, *, engine: str, model: str | None, version: str | None = None) -> SkuManifest:
    """The SKU's manifest with its engine (what the H200 has installed: its name and, when known, the version that
    ran, which the engine rule of an accelerated class's entry compares) and, optionally, its gate model replaced."""
    manifest = load_manifest(ROOT / "skus" / f"{sku}.yaml")
    pin = {"name": engine, **({"version": version} if version else {})}
    stack = manifest.stack.model_copy(update={"engine": manifest.stack.engine.model_copy(update=pin)})
    gate_ = manifest.gate
    if model:
        gate_ = gate_.model_copy(update={"model": model, "reference": f"gates/references/{model}/h200-{gate_.dtype}"})
    return manifest.model_copy(update={"stack": stack, "gate": gate_})


def float32_probe_manifest(manifest: SkuManifest) -> SkuManifest:
    """The manifest the gate's float32 pass probes with (gates/gate.py _check_float32): float32 against the float32
    bundle, the model check only (the kernel battery ran in the boot's probe; no op battery)."""
    m32 = float32_manifest(manifest)
    return m32.model_copy(update={"gate": m32.gate.model_copy(
        update={"checks": tuple(c for c in m32.gate.checks if c != "kernels")})})


def host_command(manifest: SkuManifest, model_dir: Path, *, ops: bool) -> list[str]:
    """The gate container's probe command on this host: the same script and arguments, the fixture's folder where
    the container has MODEL_MOUNT."""
    spec = gate.probe_spec(manifest=manifest, image="rehearsal", out=Path("/tmp/rehearsal"), model_dir=model_dir,
                           ops=ops)
    args = [str(model_dir) if a == MODEL_MOUNT else a.replace(MODEL_MOUNT + "/", f"{model_dir}/")
            for a in spec.command[1:]]
    return [sys.executable, str(PROBE), *args]


def run(args: argparse.Namespace) -> int:
    manifest = manifest_for(args.sku, engine=args.engine, model=args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="skupin-rehearse-") as tmp:
        model_dir = fixture_folder(name=manifest.gate.model, model_dir=None, scratch=Path(tmp))
        # the sandbox's environment, its home and caches in a fresh folder (the host's /tmp caches stay out)
        env = {**os.environ, **{k: v.replace("/tmp", tmp) for k, v in SANDBOX_ENV.items()}, **manifest.runtime.env}
        summary = {}
        for name, m, ops in (("boot", manifest, True), ("float32", float32_probe_manifest(manifest), False)):
            command = host_command(m, model_dir, ops=ops)
            t0 = time.monotonic()
            done = subprocess.run(command, env=env, capture_output=True, check=False, timeout=args.timeout)
            (args.out / FRAMES[name]).write_bytes(done.stdout)
            summary[name] = {"command": command[1:], "exit": done.returncode, "seconds": round(time.monotonic() - t0, 1),
                             "stderr_tail": done.stderr.decode("utf-8", "replace")[-1500:]}
            print(f"{name}: exit {done.returncode} in {summary[name]['seconds']} s", flush=True)
        (args.out / "rehearsal.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return 0


def probe_run(frame: Path) -> gate.ProbeRun:
    report_raw, tensors_raw = split_frame(frame.read_bytes(), source=str(frame))
    report, tensors = decode_outputs(report_raw, tensors_raw, source=str(frame))
    return gate.ProbeRun(report=report, tensors=tensors, exit_code=0)


def judge(args: argparse.Namespace) -> int:
    boot_probe, float32_probe = probe_run(args.frames / FRAMES["boot"]), probe_run(args.frames / FRAMES["float32"])
    ran = ((boot_probe.report.get("env") or {}).get("engines") or {}).get(args.engine)  # the version the H200 has
    manifest = manifest_for(args.sku, engine=args.engine, model=args.model, version=ran)
    expected = host_command(float32_probe_manifest(manifest), Path(MODEL_MOUNT), ops=False)[2:]
    recorded = json.loads((args.frames / "rehearsal.json").read_text(encoding="utf-8"))["float32"]["command"][1:]

    def float32_frame(*, manifest: SkuManifest, ops: bool = True, **_: object) -> gate.ProbeRun:
        """The float32 pass's probe: the frame recorded on the H200, once the gate asks for what was recorded."""
        asked = host_command(manifest, Path(MODEL_MOUNT), ops=ops)[2:]
        model_args = {"--model", "--prompts"}
        same = [a for i, a in enumerate(asked) if i == 0 or asked[i - 1] not in model_args]
        if same != [a for i, a in enumerate(recorded) if i == 0 or recorded[i - 1] not in model_args] or asked != expected:
            raise SystemExit(f"the gate asks the float32 probe for {asked}, the H200 ran {recorded}")
        return float32_probe

    gate.probe_in_container = float32_frame
    with tempfile.TemporaryDirectory(prefix="skupin-rehearse-") as tmp:
        inputs = gate.GateInputs(stack=ResolvedStack(manifest=manifest, manifest_path=ROOT / "skus" / f"{args.sku}.yaml"),
                                 image="rehearsal", docker=None, out=Path(tmp), on_event=lambda _: None,  # type: ignore[arg-type]
                                 tolerances_path=args.tolerances, reference=None, baseline=None, serve_perf=None,
                                 scratch=Path(tmp))
        reference = gate._check_reference(inputs)
        tolerance = gate._find_tolerance(inputs, reference)
        ok = gate.CheckResult(name="boot", status="pass", reason="the probe ran on the H200 (no container)")
        boot = gate.BootResult(ok, probe=boot_probe, summary={})
        pins = gate.PinsResult(gate.CheckResult(name="pins", status="skipped", reason="no image"),
                               image_id="sha256:" + "0" * 64)
        checks = [reference.check, gate._check_kernels(inputs, reference, tolerance, boot).check,
                  gate._check_ops(inputs, tolerance, boot).check, gate._check_model(inputs, reference, tolerance, boot).check,
                  gate._check_float32(inputs, pins, tolerance, boot).check]
    rows = {c.name: {"status": c.status, "reason": c.reason} for c in checks if c is not None}
    for name, row in rows.items():
        print(f"{name:9s} {row['status']:12s} {row['reason'][:160]}")
    if args.json:
        args.json.write_text(json.dumps({"sku": args.sku, "engine": args.engine, "model": manifest.gate.model,
                                         "tolerance_key": tolerance.info.key, "checks": rows}, indent=1) + "\n",
                             encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="action", required=True)
    for action in ("run", "judge"):
        q = sub.add_parser(action)
        q.add_argument("--sku", default="nvidia-h200-vllm")
        q.add_argument("--engine", default="transformers")
        q.add_argument("--model", help="replace the SKU's gate model (and its H200 reference)")
        if action == "run":
            q.add_argument("--out", type=Path, required=True)
            q.add_argument("--timeout", type=float, default=300.0)
        else:
            from skupin.gates.judge.tolerance import DEFAULT_PATH

            q.add_argument("--frames", type=Path, required=True)
            q.add_argument("--tolerances", type=Path, default=DEFAULT_PATH)
            q.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    return run(args) if args.action == "run" else judge(args)


if __name__ == "__main__":
    sys.exit(main())
