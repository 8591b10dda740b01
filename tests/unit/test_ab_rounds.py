"""`skupin ab`'s bookkeeping of rounds: a failed round kept, pairs made by round, contradictory flags refused."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError

from skupin.ab.annex import annex_markdown
from skupin.ab.decision import ABRound, ABSettings, decide, rounds_note
from skupin.ab.runtime import _interleave, _Measured, _SideFailed, until_stopped
from skupin.cli import main
from tests.unit.test_runtime_ab import _record, decode_kpi, perf, prefill_kpi, rounds


@dataclass
class _Container:
    cpu: float = 0.0
    pauses: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.pauses.append("pause")
        yield
        self.pauses.append("unpause")

    def cpu_seconds(self) -> float:
        self.cpu += 1.0
        return self.cpu


@dataclass
class _Server:
    container: _Container = field(default_factory=_Container)


def _rounds_with(fail: set[tuple[str, int]], runs: int = 4,
                 **settings: Any) -> tuple[_Measured, BaseException | None]:
    """Rounds over fake servers whose `measure` raises for (role, round number) in `fail`, boot after boot as
    runtime._rounds runs them (the same fakes each boot); (measured, what ended it)."""
    measured = _Measured()
    servers = {"baseline": _Server(), "candidate": _Server()}
    calls = {"baseline": 0, "candidate": 0}

    def measure(role):
        calls[role] += 1
        number = len(measured.order)
        measured.requests[role] += 8
        if (role, number) in fail:
            raise ValueError(f"{role} broke in round {number}")
        return [perf(100.0 if role == "baseline" else 120.0 + number)]

    asked = ABSettings(runs=runs, concurrency=(1, 2), prompt_lengths=(64,), **settings)
    try:
        measured.stopped = until_stopped(lambda boot: _interleave(
            servers=servers, measure=measure, settings=asked, measured=measured, on_event=lambda _: None,
            failures=(ValueError,), boot=boot))
    except _SideFailed as exc:
        measured.errors[exc.role] = exc.reason
        return measured, exc
    return measured, None


def test_a_round_a_side_fails_in_is_kept_with_who_failed_and_why() -> None:
    # round 3 runs B A: the baseline is measured, then the candidate fails
    measured, ended = _rounds_with({("candidate", 3)})
    assert ended is not None and "round 3" in str(ended) and measured.stopped == "failed"
    assert [r.number for r in measured.rounds] == [1, 2, 3] and measured.order == ["BA", "AB", "BA"]
    third = measured.rounds[-1]
    assert (third.baseline, third.candidate, third.paired) == ("ok", "failed", False)
    assert "candidate broke in round 3" in third.reason and third.requests == {"baseline": 8, "candidate": 8}
    assert all(r.paired for r in measured.rounds[:2])
    # the baseline's half of the failed round is kept, but pairs with nothing
    assert 2 in measured.runs["baseline"] and 2 not in measured.runs["candidate"]
    assert measured.paired() == [0, 1] and [len(v) for v in measured.paired_runs().values()] == [2, 2]
    # round 2 runs A B: a candidate failing first leaves the baseline not run
    measured, _ = _rounds_with({("candidate", 2)})
    assert (measured.rounds[-1].baseline, measured.rounds[-1].candidate) == ("not run", "failed")
    assert measured.rounds[-1].requests == {"baseline": 0, "candidate": 8}


def test_rounds_without_failures_are_all_paired_and_every_side_was_paused_while_the_other_ran() -> None:
    measured, ended = _rounds_with(set(), runs=3)
    assert ended is None and measured.paired() == [0, 1, 2] and not rounds_note(rounds=measured.rounds, asked=3)
    assert measured.stopped == "runs"
    assert measured.cpu_rounds() == [0, 1, 2]


def test_restart_every_starts_a_new_boot_after_that_many_rounds_and_each_round_names_its_boot() -> None:
    measured, ended = _rounds_with(set(), runs=6, restart_every=2)
    assert ended is None and measured.stopped == "runs"
    assert [r.boot for r in measured.rounds] == [1, 1, 2, 2, 3, 3] and measured.paired_boots() == [1, 1, 2, 2, 3, 3]
    # each boot gives each image the first turn once, and even boots open with the candidate
    assert measured.order == ["BA", "AB", "AB", "BA", "BA", "AB"]
    # a failure in a later boot names the round it broke in
    measured, ended = _rounds_with({("baseline", 5)}, runs=6, restart_every=2)
    assert ended is not None and "round 5" in str(ended) and measured.rounds[-1].boot == 3


def test_a_spent_budget_ends_the_rounds_between_boots_never_with_an_empty_boot() -> None:
    measured, ended = _rounds_with(set(), runs=4, restart_every=2, target_ci=1e-6, max_runs=8, budget_s=1e-9)
    assert ended is None and measured.stopped == "budget" and measured.boot == [1, 1, 2, 2]
    assert measured.first_round is not None  # the budget counts from the first round, not from the first boot


def test_a_server_that_fails_to_boot_again_is_kept_as_a_failed_round(monkeypatch) -> None:
    from skupin.ab import runtime

    def broken(*, role, **_):
        raise _SideFailed(role, "its server failed when started again after round 2: TimeoutError")

    monkeypatch.setattr(runtime, "_booted", broken)
    measured = _Measured(order=["BA", "AB"], boot=[1, 1])
    with pytest.raises(_SideFailed):
        runtime._boot(number=2, baseline=None, candidate=None, ids=dict.fromkeys(("baseline", "candidate"), ""),
                      docker=None, settings=ABSettings(runs=4, restart_every=2),
                      mounts=dict.fromkeys(("baseline", "candidate"), None), prompt_set={}, tokenizer=None,
                      measured=measured, on_event=lambda _: None, failures=())
    kept = measured.rounds[-1]
    # even boots start the candidate first: it is the side that failed, the baseline never ran
    assert (kept.number, kept.boot, kept.order, kept.candidate, kept.baseline) == (3, 2, "AB", "failed", "not run")
    assert "started again" in kept.reason and not kept.paired
    assert "round 3: baseline not run, candidate failed" in rounds_note(rounds=measured.rounds, asked=4)


def test_target_ci_with_restarts_stops_only_on_a_whole_boot() -> None:
    from skupin.ab.decision import boot_numbers, rounds_stop

    s = ABSettings(runs=8, restart_every=4, target_ci=0.05, max_runs=40, budget_s=100)
    wide = [0.9] * 4 + [1.1] * 4  # two boots that disagree by 20%
    steady = wide + [1.0] * 8
    assert rounds_stop(settings=s, ratios=wide, elapsed_s=0) is None
    # inside a boot nothing stops the rounds, the budget included; after it the interval and the budget are looked at
    assert [rounds_stop(settings=s, ratios=steady[:n], elapsed_s=500) for n in (9, 10, 11)] == [None] * 3
    assert rounds_stop(settings=s, ratios=steady[:12], elapsed_s=500) == "budget"
    assert rounds_stop(settings=s, ratios=[1.0, 1.01, 0.99, 1.0] * 2, elapsed_s=0) == "target_ci"
    assert boot_numbers(s, 9) == [1, 1, 1, 1, 2, 2, 2, 2, 3] and boot_numbers(ABSettings(), 3) == [1, 1, 1]
    with pytest.raises(ValidationError, match="3 is odd"):
        ABSettings(runs=6, restart_every=3)
    with pytest.raises(ValidationError, match="give whole boots, two at least"):
        ABSettings(runs=4, restart_every=4)
    with pytest.raises(ValidationError, match="give whole boots, two at least"):
        ABSettings(runs=10, restart_every=4)
    with pytest.raises(ValidationError, match="max_runs 42 with restart_every 4"):
        ABSettings(runs=8, restart_every=4, target_ci=0.05, max_runs=42)


def test_kpi_rounds_pair_by_the_round_they_ran_in_not_by_list_position() -> None:
    m = _Measured(order=["BA", "AB", "BA"])
    m.runs["baseline"] = {0: [perf(100)], 1: [perf(100)], 2: [perf(200)]}
    m.runs["candidate"] = {0: [perf(110)], 2: [perf(220)]}  # round 2 (index 1) failed on the candidate
    paired = m.paired_runs()
    assert m.paired() == [0, 2]
    # by position the candidate's third-round 220 would sit against the baseline's second-round 100 (2.2x)
    ratios = [c[0].levels[0].decode_tok_s_per_request / b[0].levels[0].decode_tok_s_per_request
              for b, c in zip(paired["baseline"], paired["candidate"], strict=True)]
    assert ratios == pytest.approx([1.1, 1.1])


def test_the_cpu_kpi_pairs_cpu_accounting_by_round_when_a_side_missed_one() -> None:
    from skupin.ab.runtime import _cpu_kpi

    m = _Measured(order=["BA", "AB", "BA"], boot=[1, 1, 1])
    m.cpu["baseline"] = {1: (2.0, 1000), 2: (4.0, 1000)}  # no accounting for round 1
    m.cpu["candidate"] = {0: (3.0, 1000), 2: (2.0, 1000)}  # none for round 2
    k = _cpu_kpi(m)
    # by list position: 3.0/2.0 and 2.0/4.0; by round only round 3 pairs: 2.0/4.0
    assert k is not None and k.rounds == pytest.approx((0.5,)) and k.ratio == pytest.approx(0.5)
    base = m.cpu_cost("baseline")
    assert base is not None and base.round_numbers == (3,) and base.cpu_s_per_1m_output_tokens == pytest.approx(4000)
    m.cpu["candidate"].pop(2)
    assert _cpu_kpi(m) is None  # no round with both sides' accounting


def test_a_decision_on_fewer_rounds_than_asked_says_so_and_never_promotes() -> None:
    cand, base = rounds(130, 128, 131), rounds(100, 101, 99)
    kpis = {"decode": decode_kpi(cand, base), "prefill": prefill_kpi(cand, base)}
    common = {"candidate_gate": "pass", "candidate_failure": "", "baseline_gate": "pass", "baseline_failure": "",
              "floor": 0.02, **kpis}
    assert decide(**common, rounds_asked=3)[0] == "promote"
    log = [ABRound(number=n, order="BA", baseline="ok", candidate="ok") for n in (1, 2, 3)]
    log.append(ABRound(number=4, order="AB", baseline="not run", candidate="failed", reason="ValueError: broke"))
    note = rounds_note(rounds=log, asked=5)
    assert note.startswith("rounds: 5 asked, 4 run, 3 measured on both sides")
    assert "round 4: baseline not run, candidate failed: ValueError: broke" in note
    decision, line, reason = decide(**common, rounds_asked=5, rounds_note=note)
    assert (decision, line) == ("hold", "hold: rounds missing") and "only 3 of the 5 asked rounds" in reason
    assert reason.endswith(f"({note})")
    # a failed side decides first, and its reason still says how many rounds ran
    decision, line, reason = decide(**common, errors={"candidate": "its server failed in round 4"}, rounds_asked=5,
                                    rounds_note=note)
    assert decision == "reject" and "4 run, 3 measured on both sides" in reason
    # rounds measured on both sides but without a decode ratio are named too
    assert "1 of those without a decode ratio" in rounds_note(rounds=log[:3], asked=3, decided=2)


def test_the_record_and_annex_keep_the_failed_round() -> None:
    log = (ABRound(number=1, order="BA", baseline="ok", candidate="ok"),
           ABRound(number=2, order="AB", baseline="not run", candidate="failed", reason="its server failed in round 2"))
    note = rounds_note(rounds=log, asked=3)
    record = _record().model_copy(update={"rounds": log, "rounds_note": note})
    again = type(record).model_validate_json(record.model_dump_json())
    assert again.rounds == log and again.rounds[1].candidate == "failed" and again.rounds_note == note
    text = annex_markdown(record, plot=None)
    assert "Fewer rounds than asked decided this" in text and "round 2: baseline not run, candidate failed" in text


def test_settings_refuse_max_runs_below_runs_and_a_level_given_twice() -> None:
    with pytest.raises(ValidationError, match="max_runs 3 is below runs 5"):
        ABSettings(runs=5, max_runs=3)
    with pytest.raises(ValidationError, match="2 given more than once"):
        ABSettings(concurrency=(1, 2, 2))
    assert ABSettings(runs=5, max_runs=5).max_runs == 5


@pytest.mark.parametrize(("argv", "names"), [
    (["--runs", "5", "--target-ci", "0.05", "--max-runs", "3"], ["--max-runs 3 is smaller than --runs 5"]),
    (["--max-runs", "10"], ["--max-runs without --target-ci"]),
    (["--budget-s", "60", "--max-runs", "10"], ["--max-runs and --budget-s without --target-ci"]),
    (["--concurrency", "1,2,2"], ["--concurrency", "2 given more than once"]),
    (["--prompt-lengths", "64,64"], ["--prompt-lengths", "64 given more than once"]),
    (["--server-cpus", "4095"], ["--server-cpus", "CPUs 4095 are not among those this process may use"]),
    (["--server-cpus", "two"], ["--server-cpus 'two'", "is not a CPU number or range"]),
    (["--restart-every", "3", "--runs", "6"], ["--restart-every", "3 is odd"]),
    (["--restart-every", "4"], ["runs 3 with restart_every 4: give whole boots"]),
])
def test_the_cli_refuses_contradictory_flags_naming_them_before_building_anything(capsys, argv, names) -> None:
    assert main(["ab", "cpu-x86_64", "cpu-x86_64-vllm", *argv]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in names), err


def test_the_cli_refuses_servers_on_every_cpu_when_pinning(capsys) -> None:
    every = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert main(["ab", "cpu-x86_64", "cpu-x86_64-vllm", "--server-cpus", every]) == 2
    assert "leaves no CPU for the measuring client" in capsys.readouterr().err
