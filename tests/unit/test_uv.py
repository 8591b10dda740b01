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


FAKE_UV = """#!{python}
import json, pathlib, sys
args = sys.argv[1:]
log = pathlib.Path({log!r})
with log.open("a") as f:
    f.write(json.dumps(args) + "\\n")
offline_runs = sum("--offline" in line for line in log.read_text().splitlines())
if "--offline" in args and {cache!r} == "cold":
    print("error: Network connectivity is disabled, but the requested data wasn't found in the cache"); sys.exit(2)
out = pathlib.Path(args[args.index("-o") + 1])
if "pylock.toml" in args:
    out.write_text({pylock!r})
elif "--offline" in args and (offline_runs == 1 and {cache!r} == "stale" or {cache!r} == "stuck"):  # older releases
    out.write_text({annotated!r}.replace("aiohttp==3.14.5", "aiohttp==3.14.4"))
else:
    out.write_text({annotated!r})
"""


@pytest.mark.parametrize("cache, after", [
    ("warm", []),  # the cache answers what the index answers: the graph made beside the resolution is used
    ("stale", [("graph", True)]),  # it answered older releases: made again from the cache the first run filled
    ("cold", [("graph", True), ("graph", False)]),  # it cannot answer offline: from the index
    # it keeps answering older releases even after the first run (pages it holds as fresh: seen in CI): from the index
    ("stuck", [("graph", True), ("graph", False)]),
])
def test_one_resolution_against_the_index_and_the_graph_from_the_cache(tmp_path, cache, after):
    """uv resolves against the index once (pylock.toml); the dependency graph comes from uv's cache (`--offline`),
    beside that run when the cache already resolves the same versions, else after it: two runs against the index side
    by side competed for it and for the cores (docs/BENCHMARKS.md, "Locking")."""
    import json
    import sys

    from skupin.builder.lock import PipRequest
    from skupin.builder.uv import run_uv

    log = tmp_path / "calls.jsonl"
    uv = tmp_path / "uv"
    uv.write_text(FAKE_UV.format(python=sys.executable, log=str(log), cache=cache, pylock=PYLOCK, annotated=ANNOTATED))
    uv.chmod(0o755)
    request = PipRequest(layer="all", requirements=("torch==2.13.0",), index_url="https://pypi.org/simple",
                         python="3.11", abis=("cp311", "abi3", "none"), platforms=PLATFORMS)
    report = run_uv(request, uv=str(uv), environ={"PATH": "/usr/bin:/bin"})
    assert {p["metadata"]["name"]: p["metadata"]["version"] for p in report["install"]}["aiohttp"] == "3.14.5"
    assert sorted(p["metadata"]["name"] for p in report["install"]) == ["aiohttp", "filelock", "nvidia-nvtx", "torch"]
    calls = [("pylock" if "pylock.toml" in c else "graph", "--offline" in c)
             for c in (json.loads(line) for line in log.read_text().splitlines())]
    assert sorted(calls[:2]) == [("graph", True), ("pylock", False)]  # side by side
    assert calls[2:] == after
