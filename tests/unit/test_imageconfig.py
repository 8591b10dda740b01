"""The image config a rendered Dockerfile gives (builder/imageconfig.py): what the gate's `pins` check compares with."""

from __future__ import annotations

import pytest

from skupin.builder.check import resolve
from skupin.builder.imageconfig import (
    DEFAULT_PATH,
    DockerfileConfigError,
    ImageConfig,
    apt_installs,
    config_of,
    instructions,
    labels_of,
)
from skupin.builder.render import VENV, render, render_manifest
from tests.paths import SKUS

# The CPU image's config as the engine reported it after a real build (docker inspect .Config, less its labels).
CPU_ENGINE_CONFIG = {
    "ExposedPorts": {"8000/tcp": {}},
    "Env": [f"PATH={VENV}/bin:{DEFAULT_PATH}", "DEBIAN_FRONTEND=noninteractive", "LANG=C.UTF-8",
            "PIP_DISABLE_PIP_VERSION_CHECK=1", "PIP_NO_CACHE_DIR=1", "PYTHONDONTWRITEBYTECODE=1", f"VIRTUAL_ENV={VENV}",
            "CXX=g++-12", "OMP_NUM_THREADS=1"],
    "Cmd": ["transformers", "serve", "/model", "--host", "0.0.0.0", "--port", "8000", "--dtype", "float32", "--device",
            "cpu", "--log-level", "info"],
    "ArgsEscaped": True, "Shell": ["/bin/bash", "-o", "pipefail", "-c"], "Entrypoint": None, "WorkingDir": "",
    "Volumes": None, "OnBuild": None,
}


def test_the_cpu_render_gives_the_config_its_real_image_has() -> None:
    rendered = render(resolve(SKUS / "cpu-x86_64.yaml", require_lock=True))
    assert config_of(rendered.text, ImageConfig()) == ImageConfig.from_engine(CPU_ENGINE_CONFIG)
    names = apt_installs(rendered.text)  # each layer's named packages, then the rest of its locked apt closure
    assert names[:3] == ("ca-certificates", "python3.11", "python3.11-venv") and "libssl3" in names
    assert names.index("libssl3") < names.index("g++-12") < names.index("libc6-dev") < names.index("binutils")
    assert len(names) == 61  # the closure (29 + 32 packages), as the image's 61 .deb files were


@pytest.mark.parametrize("sku", ["nvidia-h200-vllm", "amd-mi300x-vllm", "intel-max1550-vllm", "nvidia-h200-sglang"])
def test_every_family_renders_a_config_with_the_venv_first_on_path(sku: str) -> None:
    stack = resolve(SKUS / f"{sku}.yaml")
    config = config_of(render_manifest(manifest=stack.manifest, lock=stack.current_lock).text, ImageConfig())
    assert config.env_dict()["PATH"] == f"{VENV}/bin:{DEFAULT_PATH}" and config.env_dict()["VIRTUAL_ENV"] == VENV
    assert config.path_dirs()[0] == f"{VENV.strip('/')}/bin" and config.cmd and not config.entrypoint and not config.working_dir


def test_the_base_config_is_kept_and_extended_as_buildkit_does() -> None:
    base = ImageConfig.from_engine({"Env": ["PATH=/usr/bin:/bin", "CUDA_VERSION=12.8"],
                                    "Entrypoint": ["/opt/nvidia/nvidia_entrypoint.sh"], "Cmd": ["/bin/bash"],
                                    "WorkingDir": "/work"})
    text = ('ARG X=1\nFROM ${X}\n# a comment\nENV A=1 \\\n    B="two words" \\\n    PATH=/v/bin:$PATH C=${CUDA_VERSION:-none}\n'
            'ENV D=$A E=${MISSING:+set}\nWORKDIR sub\nUSER 1000\nEXPOSE 8000 9000/udp\nCMD ["serve"]\n'
            'RUN echo $PATH\nLABEL a="b"\n')
    config = config_of(text, base)
    assert config.env == (("PATH", "/v/bin:/usr/bin:/bin"), ("CUDA_VERSION", "12.8"), ("A", "1"), ("B", "two words"),
                          ("C", "12.8"), ("D", "1"), ("E", ""))
    assert config.entrypoint == ("/opt/nvidia/nvidia_entrypoint.sh",) and config.cmd == ("serve",)
    assert config.working_dir == "/work/sub" and config.user == "1000"
    assert config.exposed_ports == ("8000/tcp", "9000/udp")


def test_values_in_one_env_instruction_see_the_values_before_it() -> None:
    config = config_of("FROM x\nENV A=1\nENV A=2 B=$A\n", ImageConfig())
    assert config.env_dict() == {"PATH": DEFAULT_PATH, "A": "2", "B": "1"}


def test_an_entrypoint_resets_an_inherited_command_and_a_shell_form_uses_the_shell() -> None:
    base = ImageConfig(cmd=("/bin/bash",))
    config = config_of('FROM x\nSHELL ["/bin/bash", "-c"]\nENTRYPOINT run me\n', base)
    assert config.entrypoint == ("/bin/bash", "-c", "run me") and config.cmd == ()


@pytest.mark.parametrize("text, words", [
    ("FROM x\nHEALTHCHECK CMD true\n", "HEALTHCHECK: its effect"),
    ("FROM x\nFROM y\n", "is not named"),
    ("FROM x AS build\nFROM build\n", "not from the base"),
    ("ARG V\nFROM x\nARG V\nENV A=$V\n", "build argument"),
    ("FROM x\nENV A=${B%%x}\n", "cannot expand"),
    ("FROM x\nENV A=\"open\n", "unbalanced"),
    ("ENV A=1\n", "before FROM"),
])
def test_what_is_not_computed_here_is_refused(text: str, words: str) -> None:
    with pytest.raises(DockerfileConfigError, match=words):
        config_of(text, ImageConfig())


def test_instructions_join_continuations_and_drop_comments() -> None:
    assert instructions("FROM x\nRUN a \\\n# inside\n  && b\n\nCMD [\"c\"]\n") == [
        ("FROM", "x"), ("RUN", "a   && b"), ("CMD", '["c"]')]


def test_the_engine_config_reads_nulls_as_unset() -> None:
    assert ImageConfig.from_engine({"Env": None, "Cmd": None, "Volumes": None, "Healthcheck": None}) == ImageConfig()
    assert ImageConfig.from_engine({"Env": ["NO_EQUALS"]}).env == ()


def test_labels_are_the_last_stages_with_build_arguments_and_env_expanded() -> None:
    text = ('ARG TOP=t\nFROM base AS build\nLABEL early="no"\nFROM base\nENV WHO=env\nARG WHAT=default\nARG HASH\n'
            'LABEL a="x y" b=${WHAT} \\\n      c="${HASH}" d="say \\"hi\\"" e="${WHO}"\nARG WHO=arg\nLABEL f=$WHO')
    assert labels_of(text, {"HASH": "abc"}) == {"a": "x y", "b": "default", "c": "abc", "d": 'say "hi"', "e": "env",
                                                "f": "env"}  # ENV wins over an ARG of the same name
    assert labels_of(text, {"HASH": "abc", "WHAT": "given"})["b"] == "given"
    with pytest.raises(DockerfileConfigError, match="not key=value"):
        labels_of("FROM base\nLABEL lonely", {})
    scoped = "ARG TOP=t\nFROM base\nLABEL before=${TOP}\nARG TOP\nLABEL after=${TOP}"
    assert labels_of(scoped, {}) == {"before": "", "after": "t"}  # a global ARG is seen only once declared again
    assert labels_of(scoped, {"TOP": "given"}) == {"before": "", "after": "given"}


def test_the_cpu_render_labels_name_its_lock_and_dockerfile() -> None:
    rendered = render(resolve(SKUS / "cpu-x86_64.yaml", require_lock=True))
    lock = rendered.stack.lock  # type: ignore[union-attr]
    labels = labels_of(rendered.text, {"SKUPIN_LOCK_HASH": "L", "SKUPIN_DOCKERFILE_SHA256": "D"})
    assert labels["io.skupin.lock-sha256"] == "L" and labels["io.skupin.dockerfile-sha256"] == "D"
    assert labels["org.opencontainers.image.created"] == lock.created and labels["io.skupin.sku"] == "cpu-x86_64"
    assert labels_of(rendered.text, {})["io.skupin.lock-sha256"] == "unlocked"  # the ARG's default
