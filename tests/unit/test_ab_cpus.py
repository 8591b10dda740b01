"""skupin ab --server-cpus: the plan (which CPUs the servers and the client get) and the client's pinning."""

from __future__ import annotations

import os
import threading

import pytest

from skupin.ab.cpus import CpuPlan, allowed_cpus, client_pinned, parse_cpu_list, plan_cpus
from skupin.builder.catalog.manifest import load_manifest
from skupin.common.errors import ManifestError
from skupin.dockerd.specs import ContainerSpec
from skupin.gates.sandbox import sandbox_spec
from tests.unit.test_serve import REPO


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("1") == (1,)
    assert parse_cpu_list("0-3") == (0, 1, 2, 3)
    assert parse_cpu_list("5,2-3,2") == (2, 3, 5)


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "1;2", "1,,2", "0x1"])
def test_a_bad_cpu_list_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(ManifestError, match="--server-cpus"):
        parse_cpu_list(text)


def test_auto_gives_the_servers_the_upper_half_and_the_client_the_rest() -> None:
    assert plan_cpus("auto", (0, 1)) == CpuPlan(server=(1,), client=(0,))
    assert plan_cpus("auto", (4, 0, 2, 6)) == CpuPlan(server=(4, 6), client=(0, 2))
    assert plan_cpus("auto", (0, 1, 2)) == CpuPlan(server=(2,), client=(0, 1))
    assert plan_cpus("auto", (3,)) is None  # one CPU: nothing to split
    assert plan_cpus("shared", (0, 1, 2, 3)) is None


def test_a_named_list_leaves_the_rest_to_the_client_and_must_leave_some() -> None:
    assert plan_cpus("2-3", (0, 1, 2, 3)) == CpuPlan(server=(2, 3), client=(0, 1))
    with pytest.raises(ManifestError, match="leaves no CPU for the measuring client"):
        plan_cpus("0-1", (0, 1))
    with pytest.raises(ManifestError, match="CPUs 7 are not among those this process may use"):
        plan_cpus("1,7", (0, 1))


def test_a_plan_is_a_cpuset_docker_takes() -> None:
    plan = CpuPlan(server=(2, 5), client=(0,))
    assert plan.cpuset() == "2,5"
    assert ContainerSpec(image="i", cpuset=plan.cpuset()).cpuset == "2,5"
    assert "CPUs 2,5" in plan.describe() and "client to CPU 0" in plan.describe()
    with pytest.raises(ValueError):
        ContainerSpec(image="i", cpuset="1;2")


def test_a_server_on_a_cpuset_has_no_quota() -> None:
    m = load_manifest(REPO / "skus" / "cpu-x86_64.yaml")
    plain = sandbox_spec(manifest=m, image="i", entrypoint=("x",), command=(), mounts=(), labels={})
    pinned = sandbox_spec(manifest=m, image="i", entrypoint=("x",), command=(), mounts=(), labels={}, cpuset="1")
    assert plain.cpus is not None and plain.cpuset is None
    assert pinned.cpus is None and pinned.cpuset == "1"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_every_thread_is_pinned_for_the_block_and_gets_its_mask_back() -> None:
    allowed = set(allowed_cpus())
    target = min(allowed)
    seen: dict[str, set[int]] = {}
    ready, go, read, done = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:  # a thread that already runs when the block starts (a client's worker)
        ready.set()
        go.wait(10)
        seen["old thread"] = os.sched_getaffinity(0)
        read.set()
        done.wait(10)
        seen["old thread after"] = os.sched_getaffinity(0)

    old = threading.Thread(target=worker)
    old.start()
    ready.wait(10)
    with client_pinned((target,)):
        seen["main"] = os.sched_getaffinity(0)
        go.set()
        read.wait(10)
        new = threading.Thread(target=lambda: seen.__setitem__("new thread", os.sched_getaffinity(0)))
        new.start()
        new.join(10)
    done.set()
    old.join(10)
    assert seen == {"main": {target}, "old thread": {target}, "new thread": {target}, "old thread after": allowed}
    assert os.sched_getaffinity(0) == allowed and seen["old thread after"] == allowed


def test_no_plan_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    with client_pinned(None):
        assert os.sched_getaffinity(0) == before


def test_the_ab_boots_each_server_on_the_plans_cpus_with_a_lifetime_past_the_gates_deadline(monkeypatch) -> None:
    """The servers of an A/B live through its rounds: their in-container deadline is the SKU's gate.deadline_s (a gate's
    serve check) plus SERVER_EXTRA_LIFETIME_S, so a long --target-ci A/B is not cut off; with a plan they run on its CPUs."""
    import skupin.ab.runtime as runtime
    from skupin.ab.decision import ABSettings
    from skupin.builder.check import resolve
    from skupin.common.errors import DockerError
    from skupin.common.paths import sku_path

    booted: list[dict] = []

    def refuse(**kwargs):
        booted.append(kwargs)
        raise DockerError("no engine in a unit test")

    monkeypatch.setattr(runtime, "running_server", refuse)
    stack = resolve(sku_path("cpu-x86_64"))
    side = runtime.ABInput(stack=stack, image="img")
    for plan, cpuset in ((None, None), (CpuPlan(server=(1,), client=(0,)), "1")):
        with pytest.raises(runtime._SideFailed, match="its server failed before the rounds"):
            runtime._rounds(baseline=side, candidate=side, ids={"baseline": "a", "candidate": "b"}, docker=None,
                            settings=ABSettings(cpu_plan=plan), on_event=lambda _: None, measured=runtime._Measured())
        assert booted[-1]["cpuset"] == cpuset
        assert booted[-1]["lifetime_s"] == stack.manifest.gate.deadline_s + runtime.SERVER_EXTRA_LIFETIME_S
        assert booted[-1]["deadline_s"] == stack.manifest.gate.deadline_s  # to be ready: the gate's
    m = stack.manifest
    spec = sandbox_spec(manifest=m, image="i", entrypoint=("x",), command=(), mounts=(), labels={})
    assert spec.deadline_s == m.gate.deadline_s
    assert sandbox_spec(manifest=m, image="i", entrypoint=("x",), command=(), mounts=(), labels={},
                        lifetime_s=7200).deadline_s == 7200


def test_superscript_digits_and_keywords_in_the_wrong_case_are_refused_with_the_keywords_named() -> None:
    for text in ("\u00b2", "Auto"):
        with pytest.raises(ManifestError, match="or give shared or auto"):
            plan_cpus(text, (0, 1))


def test_a_server_whose_process_does_not_run_on_the_plans_cpus_stops_the_ab_naming_the_flag() -> None:
    """A daemon without the cpuset controller drops the cpuset with a warning: the server's process then shows every
    CPU, and the A/B must not report pinned numbers for it."""
    import skupin.ab.runtime as runtime
    from skupin.common.errors import DockerError

    class Container:
        def pid(self) -> int:
            return os.getpid()  # a process whose CPUs this test knows

    class Server:
        container = Container()

    allowed = allowed_cpus()
    assert runtime.cpus_of(os.getpid()) == allowed
    runtime._check_placement(Server(), "baseline", CpuPlan(server=allowed, client=(4095,)))  # as planned: passes
    with pytest.raises(DockerError, match="--server-cpus: the candidate's server runs on CPUs"):
        runtime._check_placement(Server(), "candidate", CpuPlan(server=(4095,), client=allowed))


def test_server_spec_carries_the_cpuset_and_the_lifetime_into_the_container() -> None:
    from skupin.gates.serving.serve import launch_command, server_spec

    m = load_manifest(REPO / "skus" / "cpu-x86_64.yaml")
    spec = server_spec(manifest=m, image="i", model_dir=REPO, launch=launch_command(manifest=m), cpuset="1",
                       lifetime_s=5000.0)
    assert (spec.cpuset, spec.cpus, spec.deadline_s) == ("1", None, 5000.0)
    plain = server_spec(manifest=m, image="i", model_dir=REPO, launch=launch_command(manifest=m))
    assert plain.cpuset is None and plain.cpus is not None and plain.deadline_s == m.gate.deadline_s


def test_no_round_starts_past_max_rounds_s_whatever_the_settings_ask() -> None:
    from skupin.ab.decision import MAX_ROUNDS_S, ABSettings, rounds_stop

    settings = ABSettings(runs=50)
    assert rounds_stop(settings=settings, ratios=[1.0] * 3, elapsed_s=MAX_ROUNDS_S - 1) is None
    assert rounds_stop(settings=settings, ratios=[1.0] * 3, elapsed_s=MAX_ROUNDS_S) == "cap"
