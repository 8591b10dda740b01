"""The CI matrix planner (builder/matrix.py): who builds where, and never a SKU that cannot build on its runner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from skupin.builder.catalog.lockfile import lock_path, read_lock
from skupin.builder.catalog.pylock import write_pylock
from skupin.builder.check import check_paths
from skupin.builder.matrix import plan_matrix, runner_labels, summary_markdown
from skupin.cli import main
from tests.paths import SKUS


def _stacks(folder: Path = SKUS):
    return [r.stack for r in check_paths([folder]) if r.stack is not None]


def test_the_committed_catalog_plans_exactly_this():
    plan = plan_matrix(_stacks())
    runners = {e["sku"]: (e["build_runner"], e["gate_runner"]) for e in plan.include}
    hopper = (["self-hosted", "linux", "x64", "build"], ["self-hosted", "linux", "x64", "gpu", "nvidia-hopper"])
    assert runners == {
        "cpu-x86_64": (["ubuntu-latest"], ["ubuntu-latest"]),
        "cpu-x86_64-bf16": (["ubuntu-latest"], ["ubuntu-latest"]),
        "cpu-x86_64-llamacpp": (["ubuntu-latest"], ["ubuntu-latest"]),
        "cpu-x86_64-llamacpp-bf16": (["ubuntu-latest"], ["ubuntu-latest"]),
        "nvidia-h100-vllm": hopper,
        "nvidia-h200-sglang": hopper,
        "nvidia-h200-vllm": hopper,
        "nvidia-h200-vllm-debian": hopper,
    }
    reasons = {e.sku: e.reason for e in plan.excluded}
    assert set(reasons) == {"amd-mi300x-vllm", "amd-mi355x-vllm", "intel-max1550-vllm", "cpu-x86_64-vllm",
                            "cpu-x86_64-vllm-bf16"}
    for sku in ("amd-mi300x-vllm", "amd-mi355x-vllm", "intel-max1550-vllm"):
        assert reasons[sku].startswith(f"no lock (no {sku}.lock.json")
    # its torch is locked from a wheelhouse without the wheel's home URL: a hosted runner has no source for it
    for sku in ("cpu-x86_64-vllm", "cpu-x86_64-vllm-bf16"):
        assert reasons[sku].startswith("no wheel source reachable: torch-2.13.0+cpu-cp311")
    assert plan.current == ()


def test_no_planned_sku_lacks_a_current_lock_or_a_wheel_source_on_its_runner():
    """Over every committed SKU: what the matrix lists has a current lock and a reachable source for every wheel."""
    stacks = {s.manifest.name: s for s in _stacks()}
    plan = plan_matrix(stacks.values())
    assert {e["sku"] for e in plan.include} | {e.sku for e in plan.excluded} == set(stacks)
    for entry in plan.include:
        stack = stacks[entry["sku"]]
        assert stack.lock_state == "ok" and stack.lock is not None
        assert entry["lock_sha256"] == stack.lock.content_hash()
        for pkg in (*stack.lock.packages().values(), *stack.lock.build):
            assert pkg.url and pkg.url.startswith("https://"), (entry["sku"], pkg.filename)
        if stack.manifest.accelerator.vendor != "cpu":  # a GPU gate only on a runner of its hardware class
            assert entry["gate_runner"][:4] == ["self-hosted", "linux", "x64", "gpu"]
            assert entry["gate_runner"][4] == stack.manifest.accelerator.hardware_class
        else:
            assert "gpu" not in entry["gate_runner"]


def test_a_wheelhouse_on_the_runner_brings_a_url_less_wheel_back(tmp_path):
    stacks = _stacks()
    vllm = next(s for s in stacks if s.manifest.name == "cpu-x86_64-vllm")
    torch = next(p for p in vllm.lock.packages().values() if p.source == "wheelhouse")
    (tmp_path / torch.filename).write_bytes(b"")  # the planner asks only whether the runner has the file
    plan = plan_matrix([vllm], wheelhouse=tmp_path)
    assert [e["sku"] for e in plan.include] == ["cpu-x86_64-vllm"] and plan.excluded == ()
    assert plan_matrix([vllm], wheelhouse=tmp_path / "empty").excluded[0].reason.endswith(
        "not in the wheelhouse " + str(tmp_path / "empty") + "; fix: give its wheelhouse source a `url` and relock "
        "(docs/guide-ci-point-releases.md)")


def _cpu_catalog_with_lock(tmp_path: Path, edit) -> Path:
    """A catalog holding the CPU SKU, its lock's JSON changed by `edit` (in place) and the pylock of the changed lock."""
    skus = tmp_path / "skus"
    skus.mkdir()
    for name in ("cpu-x86_64.yaml", "cpu-x86_64.lock.json"):
        shutil.copy(SKUS / name, skus / name)
    lock = skus / "cpu-x86_64.lock.json"
    data = json.loads(lock.read_text())
    edit(data)
    lock.write_text(json.dumps(data))
    write_pylock(read_lock(lock), lock)
    return skus


def test_a_stale_lock_is_left_out_with_its_reason(tmp_path):
    def drop_transformers(data: dict) -> None:
        data["layers"]["engine"] = [p for p in data["layers"]["engine"] if p["name"] != "transformers"]

    plan = plan_matrix(_stacks(_cpu_catalog_with_lock(tmp_path, drop_transformers)))
    assert plan.include == ()
    assert plan.excluded[0].sku == "cpu-x86_64"
    assert plan.excluded[0].reason.startswith("stale lock (")
    assert "engine pin transformers==5.24.0 but the lock has none" in plan.excluded[0].reason


def test_a_lock_without_its_bootstrapped_base_identity_is_left_out(tmp_path):
    """A lock made with `--apt manifest` has no base.diff_id: the build would refuse it, so the matrix does."""
    def drop_diff_id(data: dict) -> None:
        assert data["base"].pop("diff_id").startswith("sha256:")

    plan = plan_matrix(_stacks(_cpu_catalog_with_lock(tmp_path, drop_diff_id)))
    assert plan.include == () and [e.sku for e in plan.excluded] == ["cpu-x86_64"]
    assert plan.excluded[0].reason.startswith("the lock records no identity of its bootstrapped base (base.diff_id)")


def test_published_version_tags_are_current_not_rebuilt():
    stacks = [s for s in _stacks() if s.manifest.name in ("cpu-x86_64", "cpu-x86_64-llamacpp")]
    asked: list[tuple[str, str]] = []

    def published(sku: str, tag: str) -> bool:
        asked.append((sku, tag))
        return sku == "cpu-x86_64"

    plan = plan_matrix(stacks, version_tag=lambda s: f"{s.manifest.name}-tag", published=published)
    assert [e["sku"] for e in plan.include] == ["cpu-x86_64-llamacpp"]
    assert [(c.sku, c.tag) for c in plan.current] == [("cpu-x86_64", "cpu-x86_64-tag")]
    assert asked == [("cpu-x86_64", "cpu-x86_64-tag"), ("cpu-x86_64-llamacpp", "cpu-x86_64-llamacpp-tag")]
    text = summary_markdown(plan)
    assert "| `cpu-x86_64-llamacpp` | `ubuntu-latest` | `ubuntu-latest` |" in text
    assert "Already published (not rebuilt): `cpu-x86_64:cpu-x86_64-tag`" in text


def test_runner_labels_by_platform_and_vendor():
    stacks = {s.manifest.name: s.manifest for s in _stacks()}
    assert runner_labels(stacks["cpu-x86_64"]) == {"build": ["ubuntu-latest"], "gate": ["ubuntu-latest"]}
    arm = stacks["cpu-x86_64"].model_copy(update={"base": stacks["cpu-x86_64"].base.model_copy(
        update={"platform": "linux/arm64"})})
    assert runner_labels(arm) == {"build": ["ubuntu-24.04-arm"], "gate": ["ubuntu-24.04-arm"]}
    assert runner_labels(stacks["amd-mi300x-vllm"])["gate"] == ["self-hosted", "linux", "x64", "gpu", "amd-cdna3"]


def test_cli_writes_github_output_and_summary(tmp_path, capsys):
    output, summary = tmp_path / "output", tmp_path / "summary"
    assert main(["matrix", "--compact", "--github-output", str(output), "--summary", str(summary),
                 str(SKUS / "cpu-x86_64.yaml"), str(SKUS / "amd-mi300x-vllm.yaml")]) == 0
    printed = json.loads(capsys.readouterr().out)
    lines = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert json.loads(lines["matrix"]) == printed["matrix"] == {"include": printed["matrix"]["include"]}
    assert lines["count"] == "1" and printed["matrix"]["include"][0]["sku"] == "cpu-x86_64"
    lock = read_lock(lock_path(SKUS / "cpu-x86_64.yaml"))
    assert printed["matrix"]["include"][0]["lock_sha256"] == lock.content_hash()
    assert "| `amd-mi300x-vllm` | no lock (" in summary.read_text()


@pytest.mark.parametrize("sku", ["cpu-x86_64"])
def test_the_cpu_torch_wheel_is_locked_with_its_home_url_and_hash(sku):
    lock = read_lock(lock_path(SKUS / f"{sku}.yaml"))
    torch = lock.packages()["torch"]
    assert torch.source == "wheelhouse"
    assert torch.url == ("https://download.pytorch.org/whl/cpu/"
                         "torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    assert len(torch.sha256) == 64


def test_a_wheelhouse_wheel_with_a_home_url_is_downloaded_and_must_match_the_lock(tmp_path):
    """No wheelhouse on the runner: the recorded URL is fetched; a file not hashing to the lock refuses the build
    (and leaves nothing in the store); the wheelhouse wins when it holds the file."""
    import hashlib

    from skupin.builder.catalog.lockfile import LockedPackage
    from skupin.builder.wheels import fetch_wheels, store_path
    from skupin.common.errors import BuildError, NetworkError
    from tests.data.index.server import serve_wheels

    name = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    served = tmp_path / "served"
    served.mkdir()
    (served / name).write_bytes(b"the real wheel")
    good = hashlib.sha256(b"the real wheel").hexdigest()
    with serve_wheels({"torch": [(served / name, good)]}) as simple:
        url = simple.removesuffix("/simple") + f"/files/{name}"
        pkg = LockedPackage(name="torch", version="2.13.0+cpu", filename=name, sha256=good, url=url, source="wheelhouse")
        store = tmp_path / "store"
        got = fetch_wheels([pkg], store=store, retries=0)
        assert got[good].read_bytes() == b"the real wheel"
        wrong = pkg.model_copy(update={"sha256": hashlib.sha256(b"another").hexdigest()})
        with pytest.raises(NetworkError, match="but the lock says"):  # the build's exit 9, before anything runs
            fetch_wheels([wrong], store=store, retries=0)
        assert not store_path(store, wrong).exists()
    house = tmp_path / "house"
    house.mkdir()
    (house / name).write_bytes(b"another")  # the server is gone: only the wheelhouse can answer
    assert fetch_wheels([wrong], store=tmp_path / "store2", wheelhouse=house)[wrong.sha256].read_bytes() == b"another"
    no_url = wrong.model_copy(update={"url": None})
    with pytest.raises(BuildError, match="locked from a wheelhouse but not in"):
        fetch_wheels([no_url], store=tmp_path / "store3")


# ---------------------------------------------------------------- SKUs whose gate would end 'uncalibrated' (issue 34)


def test_an_uncalibrated_gpu_sku_is_left_out_with_why_unless_asked():
    stacks = [s for s in _stacks() if s.manifest.name in ("cpu-x86_64", "nvidia-h200-vllm")]
    why = {"nvidia-h200-vllm": "no calibrated tolerance for nvidia-hopper/bfloat16/tiny-llama/vllm",
           "cpu-x86_64": "no calibrated tolerance for cpu-x86_64/float32/tiny-llama"}
    plan = plan_matrix(stacks, uncalibrated=lambda s: why.get(s.manifest.name))
    assert [e["sku"] for e in plan.include] == ["cpu-x86_64"]  # a hosted runner: it still shows it builds and boots
    assert plan.include[0]["calibrated"] is False
    (left,) = plan.excluded
    assert left.sku == "nvidia-h200-vllm"
    assert "would end 'uncalibrated'" in left.reason and why["nvidia-h200-vllm"] in left.reason
    assert "--include-uncalibrated" in left.reason
    assert "| `nvidia-h200-vllm` | its gate would end 'uncalibrated'" in summary_markdown(plan)

    asked = plan_matrix(stacks, uncalibrated=lambda s: why.get(s.manifest.name), include_uncalibrated=True)
    assert [e["sku"] for e in asked.include] == ["cpu-x86_64", "nvidia-h200-vllm"] and asked.excluded == ()
    assert [e["calibrated"] for e in asked.include] == [False, False]
    calibrated = plan_matrix(stacks, uncalibrated=lambda s: None)
    assert [e["calibrated"] for e in calibrated.include] == [True, True]


def test_cli_keeps_the_hopper_engine_skus_off_gpu_runners_until_asked(capsys):
    """The committed nvidia-hopper entries were calibrated with transformers: the vLLM and SGLang SKUs would end
    'uncalibrated', so `skupin matrix` leaves them out, saying why; --include-uncalibrated sends them."""
    hopper = [str(SKUS / f"{name}.yaml") for name in ("nvidia-h100-vllm", "nvidia-h200-sglang", "nvidia-h200-vllm")]
    assert main(["matrix", *hopper, str(SKUS / "cpu-x86_64.yaml")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [e["sku"] for e in printed["matrix"]["include"]] == ["cpu-x86_64"]
    assert printed["matrix"]["include"][0]["calibrated"] is True
    reasons = {e["sku"]: e["reason"] for e in printed["excluded"]}
    assert sorted(reasons) == ["nvidia-h100-vllm", "nvidia-h200-sglang", "nvidia-h200-vllm"]
    assert "calibrated with transformers 5.17.0 only" in reasons["nvidia-h200-sglang"]
    assert "fix: skupin calibrate nvidia-h200-sglang on that hardware" in reasons["nvidia-h200-sglang"]
    assert main(["matrix", "--include-uncalibrated", *hopper]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["matrix"]["include"]) == 3 and printed["excluded"] == []
    assert {e["calibrated"] for e in printed["matrix"]["include"]} == {False}
