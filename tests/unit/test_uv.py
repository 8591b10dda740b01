"""builder/uv.py without running uv: its outputs (a pylock.toml and annotated requirements) become pip's report shape,
with the wheel pip would pick and the dependency edges uv reported."""

from __future__ import annotations

import tomllib

import pytest

from skupin.builder.lock import closure, parse_report
from skupin.builder.uv import report_from, target_tags, usable, uv_platform, via_graph
from skupin.common.errors import LockError

PLATFORMS = ("manylinux_2_36_x86_64", "manylinux_2_35_x86_64", "manylinux2014_x86_64", "linux_x86_64")
TAGS = target_tags(python="3.11", abis=("cp311", "abi3", "none"), platforms=PLATFORMS)
H = {c: c * 64 for c in "abcdef"}
F = "https://files.example/"


def _package(name: str, version: str, *wheels: tuple[str, str]) -> str:
    entries = ", ".join(f'{{ {"path" if where.startswith("wheelhouse/") else "url"} = "{where}", '
                        f'hashes = {{ sha256 = "{sha}" }} }}' for where, sha in wheels)
    return f'[[packages]]\nname = "{name}"\nversion = "{version}"\nwheels = [{entries}]\n'


PYLOCK = 'lock-version = "1.0"\ncreated-by = "uv"\n' + "".join((
    _package("Torch", "2.13.0", (F + "torch-2.13.0-cp311-cp311-manylinux_2_28_aarch64.whl", H["a"]),
             (F + "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", H["b"])),
    _package("aiohttp", "3.14.5", (F + "aiohttp-3.14.5-py3-none-any.whl", H["c"]),
             (F + "aiohttp-3.14.5-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", H["d"])),
    _package("nvidia-nvtx", "13.0.85", (F + "nvidia_nvtx-13.0.85-py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl",
                                        H["e"])),
    _package("filelock", "3.20.0", ("wheelhouse/filelock-3.20.0-py3-none-any.whl", H["f"])),
))
ANNOTATED = """\
aiohttp==3.14.5  # via torch
filelock==3.20.0  # via torch, -r requirements.in
nvidia-nvtx==13.0.85  # via torch
torch==2.13.0  # via -r requirements.in
"""


def test_the_report_keeps_the_wheel_pip_would_install_and_uvs_edges(tmp_path):
    graph = via_graph(ANNOTATED)
    assert graph.children["torch"] == ("aiohttp", "filelock", "nvidia-nvtx") and graph.children["aiohttp"] == ()
    assert graph.versions == {"aiohttp": "3.14.5", "filelock": "3.20.0", "nvidia-nvtx": "13.0.85", "torch": "2.13.0"}
    report = report_from(tomllib.loads(PYLOCK), graph, tags=TAGS, base=tmp_path, uv_version="0.13.9", layer="engine")
    assert report["resolver"] == "uv 0.13.9"
    chosen = {i["metadata"]["name"]: i["download_info"]["url"].rsplit("/", 1)[-1] for i in report["install"]}
    assert chosen["torch"].endswith("manylinux_2_28_x86_64.whl")  # not the aarch64 wheel
    assert chosen["aiohttp"].startswith("aiohttp-3.14.5-cp311")  # the platform wheel before py3-none-any, as pip ranks
    assert chosen["nvidia-nvtx"].startswith("nvidia_nvtx-13.0.85-py3-none-manylinux1")  # glibc 2.5 admitted, as pip does
    assert [i["download_info"]["url"] for i in report["install"] if i["metadata"]["name"] == "filelock"] == [
        f"file://{tmp_path}/wheelhouse/filelock-3.20.0-py3-none-any.whl"]


def test_uvs_edges_drive_the_layer_closure(tmp_path):
    report = report_from(tomllib.loads(PYLOCK.replace('path = "wheelhouse/', f'url = "{F}')),
                         via_graph(ANNOTATED), tags=TAGS, base=tmp_path, uv_version="0.13.9", layer="engine")
    resolved = parse_report(report, layer="engine")
    assert set(resolved) == {"torch", "aiohttp", "nvidia-nvtx", "filelock"}
    assert closure(resolved, ["torch==2.13.0"], {"python_version": "3.11"}).needed == set(resolved)
    assert closure(resolved, ["aiohttp==3.14.5"], {"python_version": "3.11"}).needed == {"aiohttp"}


def test_a_package_without_a_wheel_for_the_target_is_named(tmp_path):
    only_arm = PYLOCK.replace("manylinux_2_28_x86_64", "manylinux_2_28_ppc64le")
    with pytest.raises(LockError, match="torch 2.13.0: no wheel for the target"):
        report_from(tomllib.loads(only_arm), via_graph(ANNOTATED), tags=TAGS, base=tmp_path, uv_version="x",
                    layer="framework")


def test_two_runs_that_disagree_or_an_unreadable_line_are_errors_not_dropped_packages(tmp_path):
    moved = via_graph(ANNOTATED.replace("aiohttp==3.14.5", "aiohttp==3.14.6"))
    with pytest.raises(LockError, match="resolved different sets .*aiohttp 3.14.5, aiohttp 3.14.6"):
        report_from(tomllib.loads(PYLOCK), moved, tags=TAGS, base=tmp_path, uv_version="x", layer="engine")
    with pytest.raises(LockError, match="cannot read: vllm @ git"):
        via_graph(ANNOTATED + "vllm @ git+https://example/vllm  # via -r requirements.in\n")


def test_what_uv_is_given():
    assert uv_platform(PLATFORMS) == "x86_64-manylinux_2_36"
    assert uv_platform(("macosx_14_0_arm64",)) is None
    assert usable(("torch==2.13.0", "vllm==0.32.0"), PLATFORMS)
    assert not usable(("vllm @ https://example/vllm.tar.gz",), PLATFORMS)  # direct URLs go to pip
