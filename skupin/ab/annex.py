"""The one-page acceptance annex of a runtime A/B (`skupin ab`): annex.md, annex.png and nothing from the images.

The annex answers the checklist of a runtime swap: the same hardware and weights, a named
baseline, decode and prefill KPIs kept apart, quality gates on both sides, and a decision that
promotes only when the uplift clears the gates and the noise. Every value shown comes from the
RuntimeAB record (skupin/ab/runtime.py); text that originated in an image (the probe's
engine path) was made short and printable by the gate before it got there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from skupin.ab.decision import SPEED_KPIS, ABSide, RuntimeAB

ANNEX = "annex.md"
PLOT = "annex.png"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{1000 * x:.1f}"


def _md(text: str, limit: int = 300) -> str:
    """Text that came from an image (the probe's words, a gate reason quoting it), made inert in Markdown."""
    out = text[:limit].replace("\\", "\\\\")
    for ch in "|[]!<>`*_#":  # with [ and ] escaped, ( and ) make no link
        out = out.replace(ch, "\\" + ch)
    return " ".join(out.split())


def _short(argv: tuple[str, ...], limit: int = 90) -> str:
    text = " ".join(argv)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _engine(side: ABSide) -> str:
    path = side.engine_path
    dist, version = path.get("engine_distribution"), path.get("engine_version")
    return f"{side.engine} ({_md(dist, 60)} {_md(version, 40)})" if dist and version else side.engine


def _gate(side: ABSide) -> str:
    where = f" (`{side.verdict_path}`)" if side.verdict_path and side.verdict_path != "(given)" else ""
    reused = ", verdict reused" if side.verdict_reused else ""
    if side.gate == "pass":
        return f"pass{reused}{where}"
    return f"**{side.gate.upper()}** at `{side.failing_check or '-'}`{reused}{where}"


def _cost(side: ABSide) -> str:
    if side.hourly_usd is None:
        return "no cost block"
    return f"${side.hourly_usd:g}/h at {side.utilisation or 0.6:.0%} utilisation"


def _usd(side: ABSide) -> float | None:
    costs = [c.usd_per_1m_output_tokens for c in side.cost if c is not None]
    return costs[0] if costs else None


def annex_markdown(ab: RuntimeAB, *, plot: str | None = PLOT) -> str:
    """The annex as Markdown (one page: headline, the two sides, KPIs, the per-level table, the checklist)."""
    b, c = ab.baseline, ab.candidate
    s = ab.settings
    lines = [f"# Runtime A/B acceptance annex: `{b.sku}` (baseline) vs `{c.sku}` (candidate)", "",
             f"**Decision: {ab.decision_line}** — {_md(ab.reason, 900)}", "",
             "| | baseline | candidate |", "|---|---|---|",
             f"| SKU | `{b.sku}` | `{c.sku}` |",
             f"| engine (what ran the model check) | {_engine(b)} | {_engine(c)} |",
             f"| server (the image's CMD) | `{_short(b.launch)}` | `{_short(c.launch)}` |",
             f"| image | `{b.image[:60]}` | `{c.image[:60]}` |",
             f"| image id | `{b.image_id[:19]}` | `{c.image_id[:19]}` |",
             f"| numbers measured on containers of | {', '.join(f'`{i[:19]}`' for i in b.served_by) or '-'} | "
             f"{', '.join(f'`{i[:19]}`' for i in c.served_by) or '-'} |",
             f"| weights | {b.weights} | {c.weights} |",
             f"| quality gate vs the NVIDIA reference | {_gate(b)} | {_gate(c)} |",
             f"| cost block | {_cost(b)} | {_cost(c)} |", ""]
    for side in (b, c):
        if side.gate != "pass":
            lines += [f"{side.role.capitalize()} gate: {_md(side.gate_reason, 600)}", ""]
        if not side.measured:
            lines += [f"{side.role.capitalize()} speed: {side.not_measured}", ""]
    lines += [f"Same hardware and weights: hardware class `{ab.same.get('hardware_class')}`, model "
              f"`{ab.same.get('model')}`, dtype `{ab.same.get('dtype')}`, reference `{ab.same.get('reference')}`. "
              f"Host: {ab.host}.", "",
              f"Method: {len(ab.order)} interleaved rounds measured on both sides (order {' '.join(ab.order) or '-'})"
              f"{_adaptive(ab)}{f'; {ab.rounds_stopped}' if ab.rounds_stopped else ''}{_boots(ab)}; per "
              "round each image "
              f"serves prompts of {' and '.join(str(n) for n in s.prompt_lengths)} tokens at concurrency levels "
              f"{' and '.join(str(x) for x in s.concurrency)}: per level {s.requests} streamed greedy requests of "
              f"{s.max_tokens} output tokens, after {s.warmup} warm-up requests per image. Both servers run side by side "
              f"in the gate's sandbox (no network); {ab.isolation or 'nothing was measured'}.", ""]
    if ab.rounds_note:
        lines += [f"**Fewer rounds than asked decided this**: {_md(ab.rounds_note, 1200)}. The KPIs and tables are of the "
                  "rounds measured on both sides, paired by the round they ran in; the request counts include every "
                  "round run.", ""]
    if ab.requests:
        agree = "-" if ab.output_agreement is None else f"{100 * ab.output_agreement:.0f}%"
        lines += [f"Serving in the rounds: {ab.requests.get('baseline', 0)} / {ab.requests.get('candidate', 0)} requests "
                  f"(baseline / candidate), {ab.failed_requests.get('baseline', 0)} / "
                  f"{ab.failed_requests.get('candidate', 0)} streamed nothing; the candidate's greedy completions equal "
                  f"the baseline's on the same prompts in {agree} of requests.", ""]
        if ab.output_tokens:
            lines += ["Output tokens counted on the host from the streamed text with the model's tokenizer (asked / "
                      "counted / claimed in the server's usage): " + "; ".join(
                          f"{role} {t.get('asked', 0)} / {t.get('host', 0)} / {t.get('claimed', 0)}, "
                          f"{ab.short_completions.get(role, 0)} completions short"
                          for role, t in ab.output_tokens.items()) + ".", ""]
    for role, error in ab.errors.items():
        lines += [f"The {role}'s server failed during the A/B: {_md(error, 600)}", ""]
    lines += [_fixture_line(ab), ""]
    lines += _kpi_lines(ab) + _slice_lines(ab) + _capacity_lines(ab) + _level_lines(ab)
    if ab.decision_rule:
        lines += ["## Decision rule", "", ab.decision_rule, ""]
    both_pass = b.gate == "pass" and c.gate == "pass"
    lines += ["## Checklist", "",
              f"- [x] same hardware and weights ({ab.same.get('hardware_class')}, {ab.same.get('model')} "
              f"{ab.same.get('dtype')}; the quality gate judges what each runtime made of them)",
              f"- [x] named baseline: `{b.sku}` at `{b.image_id[:19]}`",
              f"- [{'x' if ab.kpis else ' '}] decode and prefill KPIs kept apart (and TTFT p50/p99, aggregate, cost)",
              f"- [{'x' if both_pass else ' '}] quality gates: baseline {b.gate}, candidate {c.gate}",
              f"- [{'x' if ab.decision == 'promote' else ' '}] uplift clears the gates and the noise floor: "
              f"{ab.decision_line}", ""]
    if plot:
        lines += [f"![decode and prefill per concurrency, baseline and candidate]({plot})", ""]
    lines += [f"skupin {ab.tool_version}, {ab.created}, {ab.wall_s:.0f} s; the record: ab.json."]
    return "\n".join(lines) + "\n"


def _adaptive(ab: RuntimeAB) -> str:
    s = ab.settings
    if s.target_ci is None:
        return ""
    budget = f", {s.budget_s:g} s budget" if s.budget_s is not None else ""
    return (f", at least {s.runs}, then more until the decode ratio's 95% interval was within +-{100 * s.target_ci:g}% "
            f"(at most {s.max_runs}{budget})")


def _boots(ab: RuntimeAB) -> str:
    """How the rounds were spread over boots of the two servers ('' with one boot and no --restart-every)."""
    if ab.settings.restart_every is None:
        return ""
    boots = len(set(ab.boots))
    return (f"; measured over {boots} boot{'s' if boots != 1 else ''} of both servers, started again after every "
            f"{ab.settings.restart_every} rounds (--restart-every), odd boots baseline first, even ones candidate first")


def _interval_unit(ab: RuntimeAB) -> str:
    """What a KPI's interval is over: boots when the rounds came from several, else rounds (and what that misses)."""
    boots = len(set(ab.boots))
    if boots > 1:
        return (f"paired t on the log ratio over {boots} boots, each boot's mean over its rounds: it holds what differs "
                "from one start of a server to the next")
    return ("paired t over rounds on the log ratio; all rounds ran on one boot of each server, so the interval does not "
            "hold what differs from one start of a server to the next (--restart-every over two boots or more samples "
            "it)")


def _fixture_line(ab: RuntimeAB) -> str:
    """The plain line a buyer needs first: what model these numbers are of."""
    size = f"{ab.model_parameters / 1e6:.1f}M parameters" if ab.model_parameters else "size unknown"
    return (f"**Model: the `{ab.same.get('model')}` test fixture ({size}, random weights), not a customer model.** Its "
            "numbers illustrate the method; throughput, the ratios and the cost must be re-measured on the customer's "
            "model and card before anyone signs on them.")


def _ci(low: float | None, high: float | None) -> str:
    return "-" if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)) else (
        f"{low:.3f}-{high:.3f}")


def _slice_lines(ab: RuntimeAB) -> list[str]:
    """The primary KPI per prompt length and concurrency, with its interval and whether it is worse there."""
    if not ab.slices:
        return []
    name = SPEED_KPIS.get(ab.primary_kpi, ab.primary_kpi)
    lines = [f"## Per slice: {name} (the primary KPI)", "",
             "A slice is worse (or better) when its 95% interval lies wholly on that side of 1; a promote needs no worse "
             "slice.", "", "| prompt tokens | concurrency | ratio | 95% CI | rounds | slice |", "|---|---|---|---|---|---|"]
    for sl in ab.slices:
        rounds = " ".join(f"{r:.3f}" for r in sl.rounds if math.isfinite(r)) or "-"
        move = f"**{sl.move}**" if sl.move == "worse" else sl.move
        lines.append(f"| {sl.prompt_tokens} | {sl.concurrency} | {_num(sl.ratio, '.3f')} | {_ci(sl.ci_low, sl.ci_high)} "
                     f"| {rounds} | {move} |")
    return [*lines, ""]


def _capacity_lines(ab: RuntimeAB) -> list[str]:
    """Seed 001's cost model at the asked volume: servers, devices, monthly cost and the candidate's saving."""
    cap = ab.capacity
    if cap is None:
        return []
    lines = [f"## Capacity and cost at {cap.volume_tokens_per_day:,.0f} output tokens per day", ""]
    if cap.baseline is None or cap.candidate is None:
        return [*lines, f"Not computed: {cap.missing}.", ""]
    b, c = cap.baseline, cap.candidate
    lines += ["| | baseline | candidate |", "|---|---|---|",
              f"| output tok/s per server (best level, median over prompt lengths) | {b.tok_s_per_server:.1f} | "
              f"{c.tok_s_per_server:.1f} |",
              f"| rate, utilisation | ${b.hourly_usd:g}/device-h x {b.devices_per_server}, {b.utilisation:.0%} | "
              f"${c.hourly_usd:g}/device-h x {c.devices_per_server}, {c.utilisation:.0%} |",
              f"| servers (devices) needed | {b.servers} ({b.devices}) | {c.servers} ({c.devices}) |",
              f"| monthly compute | ${b.monthly_usd:,.0f} | ${c.monthly_usd:,.0f} |",
              f"| $ per 1M output tokens | {b.usd_per_1m_output_tokens:.3g} | {c.usd_per_1m_output_tokens:.3g} |", ""]
    saving = cap.monthly_saving_usd or 0.0
    cost = ab.kpi("cost")
    interval = (f" (the cost ratio's 95% interval {_ci(cost.ci_low, cost.ci_high)}: the saving is uncertain by that "
                "much)") if cost is not None and cost.ci_low is not None else ""
    lines += [f"Monthly saving of the candidate: **${saving:,.0f}**{interval}. {cap.formula}.", ""]
    if ab.cpu:
        lines += ["CPU cost from each container's cgroup accounting (CPU-seconds per 1M output tokens, counted on the "
                  "host; other load on the host does not add to it): " + "; ".join(
                      f"{role} {c.cpu_s_per_1m_output_tokens:,.0f} ({c.cpu_s:.1f} CPU-s for {c.output_tokens} tokens)"
                      for role, c in ab.cpu.items()) + ".", ""]
    return lines


def _kpi_lines(ab: RuntimeAB) -> list[str]:
    """The KPI table (median ratio over rounds, the rounds' range), cost, and the noise floor."""
    b, c = ab.baseline, ab.candidate
    s = ab.settings
    lines: list[str] = []
    if ab.kpis:
        lines += ["## KPIs", "",
                  "Ratio = candidate / baseline, per round the median over prompt lengths and levels; shown: the "
                  f"median over rounds, its 95% interval ({_interval_unit(ab)}) and the range of the rounds.", "",
                  "| KPI | baseline | candidate | ratio | 95% CI | rounds | better |", "|---|---|---|---|---|---|---|"]
        for k in ab.kpis:
            fmt = _ms if k.unit == "s" else _num
            unit = "ms" if k.unit == "s" else k.unit
            finite = [r for r in k.rounds if math.isfinite(r)]
            spread = f"{min(finite):.3f}-{max(finite):.3f}" if finite else "-"
            value = (lambda x: _num(x, ".3g")) if k.name == "cost" else fmt
            lines.append(f"| {k.name.replace('_', ' ')} ({unit}) | {value(k.baseline)} | {value(k.candidate)} | "
                         f"{_num(k.ratio, '.3f')} | {_ci(k.ci_low, k.ci_high)} | {spread} | "
                         f"{'higher' if k.higher_is_better else 'lower'} |")
        bu, cu = _usd(b), _usd(c)
        if bu is not None and cu is not None and ab.kpi("cost") is None:
            lines.append(f"| $ per 1M output tokens ({s.prompt_lengths[0]}-token prompts, best level) | {bu:.3g} | "
                         f"{cu:.3g} | {_num(cu / bu if bu else float('nan'), '.3f')} | - | - | lower |")
        lines += ["", f"Noise floor: **{100 * ab.noise_floor:.1f}%**: {ab.noise_floor_basis}.", ""]
    return lines


def _level_lines(ab: RuntimeAB) -> list[str]:
    """One row per prompt length and concurrency level: baseline / candidate."""
    b, c = ab.baseline, ab.candidate
    lines: list[str] = []
    if ab.lengths:
        lines += ["## Per prompt length and concurrency (baseline / candidate)", "",
                  "| prompt tokens | concurrency | decode tok/s per request | decode ratio (rounds) | prefill tok/s | "
                  "TTFT p50 ms | TTFT p99 ms | aggregate tok/s |", "|---|---|---|---|---|---|---|---|"]
        for i, length in enumerate(ab.lengths):
            for lv in length.ab.levels:
                bl = b.perf[i].level(lv.concurrency) if i < len(b.perf) else None
                cl = c.perf[i].level(lv.concurrency) if i < len(c.perf) else None
                if bl is None or cl is None:
                    continue
                lines.append(
                    f"| {length.prompt_tokens} | {lv.concurrency} | {bl.decode_tok_s_per_request:.1f} / "
                    f"{cl.decode_tok_s_per_request:.1f} | {lv.decode_ratio:.3f} ({lv.decode_ratio_min:.3f}-"
                    f"{lv.decode_ratio_max:.3f}) | {bl.prefill_tok_s:.0f} / {cl.prefill_tok_s:.0f} | "
                    f"{_ms(bl.ttft_p50_s)} / {_ms(cl.ttft_p50_s)} | {_ms(bl.ttft_p99_s)} / {_ms(cl.ttft_p99_s)} | "
                    f"{bl.aggregate_tok_s:.1f} / {cl.aggregate_tok_s:.1f} |")
        lines.append("")
    return lines


def plot_annex(ab: RuntimeAB, path: Path) -> bool:
    """Decode tok/s per request and prefill tok/s per concurrency, side by side, one line per image and prompt
    length (dots: every request's decode tok/s). False when nothing was measured."""
    if not (ab.baseline.perf and ab.candidate.perf):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, all_axes = plt.subplots(1, 3 if ab.slices else 2, figsize=(16 if ab.slices else 11, 3.8))
    axes = all_axes[:2]
    styles = ("o-", "s--", "^:", "d-.")
    for side, color in ((ab.baseline, "tab:orange"), (ab.candidate, "tab:blue")):
        for i, perf in enumerate(side.perf):
            xs = [lv.concurrency for lv in perf.levels]
            label = f"{side.role} {side.sku}, {ab.settings.prompt_lengths[i]} tok"
            style = styles[i % len(styles)]
            axes[0].plot(xs, [lv.decode_tok_s_per_request for lv in perf.levels], style, color=color, label=label)
            for lv in perf.levels:
                axes[0].scatter([lv.concurrency] * len(lv.decode_tok_s), lv.decode_tok_s, s=5, color=color, alpha=0.3)
            axes[1].plot(xs, [lv.prefill_tok_s for lv in perf.levels], style, color=color, label=label)
    dots = [d for side in (ab.baseline, ab.candidate) for p in side.perf for lv in p.levels for d in lv.decode_tok_s]
    if len(dots) >= 20:  # a robust scale: a few outlier requests do not flatten the lines (they are clipped, not hidden)
        import numpy as np

        lo, hi = np.percentile(dots, [1, 99])
        axes[0].set_ylim(max(0.0, lo - 0.1 * (hi - lo)), hi + 0.1 * (hi - lo))
    axes[0].set_title("decode tok/s per request (dots: requests; scale: 1st-99th percentile)", fontsize=10)
    axes[1].set_title("prefill tok/s (prompt tokens / TTFT)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ab.settings.concurrency), [str(x) for x in ab.settings.concurrency])
        ax.legend(fontsize=7)
    if ab.slices:
        _plot_slices(ab, all_axes[2])
    fig.suptitle(f"{ab.decision_line}: {ab.reason}"[:130], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_slices(ab: RuntimeAB, ax: Any) -> None:  # a matplotlib Axes (imported lazily)
    """The primary KPI's ratio per slice with its 95% interval as an error bar; the line at 1 is parity."""
    shown = [sl for sl in ab.slices if sl.ci_low is not None and sl.ci_high is not None and math.isfinite(sl.ratio)]
    xs = list(range(len(shown)))
    colors = ["tab:red" if sl.move == "worse" else "tab:green" if sl.move == "better" else "tab:gray" for sl in shown]
    for x, sl, color in zip(xs, shown, colors, strict=True):
        low, high = sl.ci_low or sl.ratio, sl.ci_high or sl.ratio
        ax.errorbar([x], [sl.ratio], yerr=[[sl.ratio - low], [high - sl.ratio]], fmt="o", color=color,
                    capsize=3)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(xs, [f"{sl.prompt_tokens}/c{sl.concurrency}" for sl in shown], fontsize=7,
                  rotation=45)
    ax.set_title(f"{SPEED_KPIS.get(ab.primary_kpi, ab.primary_kpi)}: candidate / baseline per slice, "
                 "95% CI", fontsize=9)
    ax.set_xlabel("prompt tokens / concurrency")


def write_annex(ab: RuntimeAB, out: Path) -> Path:
    """annex.md (and annex.png when there is something to plot) in `out`; the annex's path."""
    drawn = plot_annex(ab, out / PLOT)
    path = out / ANNEX
    path.write_text(annex_markdown(ab, plot=PLOT if drawn else None), encoding="utf-8")
    return path
