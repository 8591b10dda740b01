"""Write a verdict for people: verdict.json, a Markdown report and a PNG plot of each statistic per prompt vs its threshold."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from skupin.gates.judge.compare import DECISION_STATS
from skupin.gates.judge.verdict import CheckResult, GateVerdict

STAT_TITLES = {
    "kl": "mean KL(ref || cand), top-k + tail",
    "one_minus_cos": "1 - cos(final hidden states)",
    "logprob_l2": "logprob L2 (top-k ids + next token)",
    "max_abs": "max |logprob delta|",
    "top1_agree": "top-1 agreement",
    "kl_full": "mean KL, full vocabulary",
}
ICON = {"pass": "PASS", "fail": "FAIL", "error": "COULD NOT RUN", "skipped": "skipped",
        "uncalibrated": "UNCALIBRATED"}


def _g(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3g}"


def write_report(*, verdict: GateVerdict, out: Path) -> dict[str, Path]:
    """Write verdict.json, report.md and (when there are per-prompt statistics) plot.png into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"verdict": out / "verdict.json", "report": out / "report.md"}
    paths["verdict"].write_text(verdict.model_dump_json(indent=1) + "\n", encoding="utf-8")
    if verdict.prompts or any(row.get("tolerance") for row in _kernel_rows(verdict).values()):
        paths["plot"] = out / "plot.png"
        plot(verdict=verdict, path=paths["plot"])
    text = markdown(verdict=verdict, plot_name="plot.png" if "plot" in paths else None)
    serve = verdict.check("serve")
    # the serve check's section and its A/B plot (gates/serving/ab.py); an uncalibrated serve check did not run
    if serve and serve.details and serve.status != "uncalibrated":
        from skupin.gates.serving.ab import plot_serve, serve_markdown

        paths["serve_plot"] = out / "serve.png"
        drew = plot_serve(serve.details, paths["serve_plot"])
        if not drew:
            paths.pop("serve_plot")
        marker = "\nHow to read this report"
        extra = "\n".join(serve_markdown(serve.details, plot_name="serve.png" if drew else None)) + "\n"
        text = text.replace(marker, extra + marker, 1) if marker in text else text + extra
    paths["report"].write_text(text, encoding="utf-8")
    return paths


def _pins_section(pins: CheckResult | None) -> list[str]:
    """What the static check accounted for, and each file that is not the lock (docs/GATE.md, Static integrity)."""
    if pins is None or not pins.details.get("counts"):
        return []
    d = pins.details
    c = d["counts"]
    lines = ["", "## Image files against the lock", "",
             f"{c.get('wheel_files_verified', 0)} files of locked wheels, {c.get('debian_files_verified', 0)} Debian files "
             f"({c.get('debian_packages_host_records', 0)} packages checked against this host's dpkg records, "
             f"{c.get('debian_packages_base_records', 0)} against the base's, "
             f"{c.get('debian_packages_image_records', 0)} against the image's own), {c.get('bytecode_verified', 0)} "
             f"bytecode files (recompiled with {d.get('interpreter') or 'no interpreter'}), {c.get('base_files', 0)} files "
             f"of the locked base; {c.get('unowned_data', 0)} unowned data files; {c.get('requirements_met', 0)} "
             f"requirements of the locked wheels met by the lock, {c.get('requirements_omitted', 0)} left out by "
             "stack.omit."]
    if d.get("omitted"):
        lines += ["", "Requirements the lock leaves out (stack.omit), accepted with their reasons:", ""]
        lines += [f"- {line}" for line in d["omitted"]]
    if d.get("findings"):
        more = sum(d.get("finding_kinds", {}).values()) - len(d["findings"])
        lines += ["", "Not the lock:", ""] + [f"- {line}" for line in d["findings"]]
        lines += [f"- ... and {more} more"] if more > 0 else []
    if d.get("unverifiable"):
        lines += ["", "Could not be checked here:", ""] + [f"- {line}" for line in d["unverifiable"]]
    return lines


def _listed(title: str, items: list[Any], total: int) -> list[str]:
    """A titled bullet list of `items`, with how many of `total` it leaves out."""
    if not items:
        return []
    more = total - len(items)
    return ["", title, "", *(f"- {item}" for item in items), *([f"- ... and {more} more"] if more > 0 else [])]


def _binaries_section(check: CheckResult | None) -> list[str]:
    """Every binary the binaries check named (the checks table shows the first), and what it could not read."""
    if check is None or not (check.details.get("findings") or check.details.get("unverifiable")):
        return []
    d = check.details
    lines = ["", "## Native binaries", ""]
    lines += [f"{d.get('checked', 0)} ELF files above the base, {d.get('needed_resolved', 0)} NEEDED resolved."]
    lines += _listed("Would not load or run here:", list(d.get("findings") or []),
                     sum((d.get("finding_kinds") or {}).values()))
    unverifiable = list(d.get("unverifiable") or [])
    return lines + _listed("Could not be checked here:", unverifiable, len(unverifiable))


def _smoke_section(check: CheckResult | None) -> list[str]:
    """Every item the import smoke test found broken (the checks table shows the first)."""
    if check is None or not check.details.get("broken"):
        return []
    broken = list(check.details["broken"])
    return ["", "## Import smoke test (no accelerator attached)",
            *_listed("Did not load:", broken, int(check.details.get("broken_count") or len(broken)))]


def _engine_path_lines(model: CheckResult | None) -> list[str]:
    """Which engine computed the model check's numbers, as the probe reported it."""
    path = (model.details.get("engine_path") or {}) if model is not None else {}
    if not path:
        return []
    what = f"{path.get('engine', '?')} ({path.get('engine_distribution', '?')} {path.get('engine_version', '?')})"
    lines = [f"Engine path: **{what}**."]
    lines += [f"- {label}: {path[key]}" for key, label in (("logprobs", "logprobs"), ("hidden_states", "hidden states"),
                                                             ("greedy", "greedy tokens")) if key in path]
    return [*lines, ""]


def _uncalibrated_section(v: GateVerdict) -> list[str]:
    """Which checks ran calibration-free, and what of them, when the tolerance key had no entry for the bundle."""
    if not v.calibration_free:
        return []
    lines = ["", "## Without calibration", "",
             f"{v.tolerance.key if v.tolerance else 'The tolerance key'} has no calibrated entry for this reference "
             "bundle, so the gate ran every check it could without one and the decision is **uncalibrated**, never "
             "pass (exit 14; `skupin publish` refuses it). The reference, pins and boot checks need no calibration. "
             "What the others did:", ""]
    return lines + [f"- **{name}**: {what}" for name, what in v.calibration_free.items()]


def _kernel_rows(verdict: GateVerdict) -> dict:
    check = verdict.check("kernels")
    return (check.details.get("ops") or {}) if check else {}


def _ops_section(check: CheckResult | None) -> list[str]:
    """The engine op battery: every op checked with its errors and bounds (units of its dtype's rounding), and what
    of the engine's path it did not reach."""
    if check is None or not isinstance(check.details.get("ops"), dict):
        return []
    lines = ["", "## Engine op battery", "", f"Against float64 on the host; {check.details.get('measures', '')}.", "",
             "| op | rms | max | bias | hard bound (rms/max/bias) | calibrated bound | worst ratio | note |",
             "|---|---|---|---|---|---|---|---|"]
    for op, row in sorted(check.details["ops"].items()):
        hard = row.get("hard") or {}
        cal = row.get("calibrated") or {}
        bounds = "/".join(_g(hard.get(m)) for m in ("rms", "max", "bias"))
        cal_text = "/".join(_g(cal.get(m)) for m in ("rms", "max", "bias")) if cal else "none"
        note = row.get("problem") or row.get("note") or ""
        lines.append(f"| {op} | {_g(row.get('rms_units'))} | {_g(row.get('max_units'))} | {_g(row.get('bias_units'))} | "
                     f"{bounds} | {cal_text} | {_g(row.get('ratio'))} | {note} |")
    uncovered = check.details.get("uncovered") or {}
    if uncovered:
        lines += ["", "Not reached on the engine's path (uncovered): " +
                  "; ".join(f"{op}: {why}" for op, why in sorted(uncovered.items()))]
    return lines


def markdown(*, verdict: GateVerdict, plot_name: str | None) -> str:
    """The human report."""
    v = verdict
    lines = [f"# Gate report: {v.sku}", "",
             f"**Decision: {v.decision.upper().replace('_', ' ')}** ({v.reason})", "",
             "| | |", "|---|---|",
             f"| image | `{v.image}` |", f"| image id | `{v.image_id or '-'}` |",
             f"| hardware class | {v.hardware_class} |",
             f"| lock | `{v.lock_hash or 'none (checked against the manifest pins)'}` |"]
    if v.reference:
        r = v.reference
        lines += [f"| reference | `{r.path}` (sha256 `{r.sha256[:16]}...`): {r.model} {r.dtype} on {r.gpu}, "
                  f"driver {r.driver}, torch {r.torch}, {r.engine} |"]
    if v.tolerance:
        t = v.tolerance
        prov = (t.entry or {}).get("provenance") or {}
        src = (f"{prov.get('runs')} honest runs x {prov.get('prompts_per_run')} prompts, margin {prov.get('margin')}, "
               f"{prov.get('date')}" if prov else "no calibrated entry")
        lines += [f"| tolerance | {t.key} ({src}) |"]
    lines += [
        f"| tool | skupin {v.tool_version}, {v.created} |",
        f"| wall time | {v.timings.get('total_s', 0):.1f} s (probe container {v.timings.get('probe_container_s', 0):.1f} s) |",
        "",
        "## Checks (in order; the first failure stops the rest)",
        "",
        "| check | result | reason |",
        "|---|---|---|",
    ]
    lines += [f"| {c.name} | {ICON[c.status]} | {c.reason.replace('|', '/')} |" for c in v.checks]
    lines += _uncalibrated_section(v)
    lines += _pins_section(v.check("pins"))
    lines += _binaries_section(v.check("binaries"))
    lines += _smoke_section(v.check("smoke"))
    kernels = _kernel_rows(v)
    if kernels:
        lines += ["", "## Kernel battery", "", "Error = max |candidate - reference| / max |reference|.", "",
                  "| op | error | tolerance | error / tolerance |", "|---|---|---|---|"]
        for op, row in sorted(kernels.items()):
            ratio = row["rel_err"] / row["tolerance"] if row.get("rel_err") is not None and row.get("tolerance") else None
            note = f" ({row['problem']})" if row.get("problem") else ""
            lines.append(f"| {op} | {_g(row.get('rel_err'))}{note} | {_g(row.get('tolerance'))} | {_g(ratio)} |")
    lines += _ops_section(v.check("ops"))
    if v.model_decision:
        lines += [
            "",
            "## Model check",
            "",
            *_engine_path_lines(v.check("model")),
            "Per statistic: prompts above the per-prompt threshold, the one-sided binomial test against the "
            "calibrated honest exceedance rate, and the mean over prompts against its bound.",
            "",
            "| statistic | per-prompt threshold | exceeding prompts | p-value (alpha) | mean | mean bound | mean / bound "
            "| failed by |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for d in v.model_decision:
            lines.append(f"| {d.stat} | {_g(d.threshold)} | {d.exceedances}/{d.prompts} | {d.p_value:.2g} ({d.alpha:.2g}) | "
                         f"{_g(d.mean)} | {_g(d.mean_threshold)} | "
                         f"{_g(d.mean / d.mean_threshold if d.mean_threshold else None)} | "
                         f"{', '.join(d.failed_by) or '-'} |")
    model = v.check("model")
    if model and model.details.get("means"):
        means = model.details["means"]
        lines += ["", "Means over prompts: " + ", ".join(f"{k} {_g(val)}" for k, val in means.items()) +
                  (f"; greedy continuations identical for {model.details['greedy_same']:.0%} of prompts"
                   if model.details.get("greedy_same") is not None else "")]
        for note in model.details.get("notes") or []:
            lines.append(f"Note: {note}")
    if plot_name:
        lines += ["", "## Plot", "", f"![each statistic per prompt against its threshold]({plot_name})", "",
                  "One panel per statistic: a dot per prompt (red when above the per-prompt threshold), the threshold "
                  "as a dashed line, the mean over prompts as a dotted line. The kernel panel shows each op's error "
                  "as a fraction of its tolerance (above 1 fails)."]
    worst = sorted((p for p in v.prompts if p.exceeds), key=lambda p: -len(p.exceeds))[:10]
    if worst:
        lines += ["", "## Prompts above a threshold (first 10)", "", "| prompt | exceeds | " +
                  " | ".join(DECISION_STATS) + " |", "|---|---|" + "---|" * len(DECISION_STATS)]
        for p in worst:
            cells = " | ".join(_g(p.stats.get(s)) for s in DECISION_STATS)
            lines.append(f"| {p.index} | {', '.join(p.exceeds)} | {cells} |")
    lines += ["", "How to read this report: docs/GATE.md.", ""]
    return "\n".join(lines)


def plot(*, verdict: GateVerdict, path: Path) -> None:
    """One panel per statistic (values per prompt vs threshold) and one for the kernel battery."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thresholds = {d.stat: d for d in verdict.model_decision}
    stats = [s for s in (*DECISION_STATS, "top1_agree") if any(p.stats.get(s) is not None for p in verdict.prompts)]
    kernels = {op: row for op, row in _kernel_rows(verdict).items() if row.get("tolerance")}  # none when uncalibrated
    panels = len(stats) + (1 if kernels else 0)
    cols = 2 if panels > 1 else 1
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.2 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, stat in zip(flat, stats, strict=False):
        xs = [p.index for p in verdict.prompts if p.stats.get(stat) is not None]
        ys = [float(v) for p in verdict.prompts if (v := p.stats.get(stat)) is not None]
        d = thresholds.get(stat)
        # The points go in before the reference lines: a line drawn on an axis with no data yet
        # makes matplotlib autoscale to a single value ("identical low and high ylims").
        if stat == "top1_agree":
            ax.scatter(xs, ys, s=10, c=["tab:blue"] * len(xs))
            bound = verdict.tolerance.hard_bounds.get("min_top1_agree") if verdict.tolerance else None
            ax.set_ylim(-0.02, 1.02)
            if bound is not None:
                ax.axhline(bound, color="tab:red", linestyle="--", label=f"hard bound {bound:.0%} (on the mean)")
        else:
            if any(y > 0 for y in ys):
                ax.set_yscale("log")
            ax.scatter(xs, [max(y, 1e-30) for y in ys], s=10, c=["tab:red" if d and y > d.threshold else "tab:blue" for y in ys])
            if d:
                ax.axhline(d.threshold, color="tab:red", linestyle="--", label=f"per-prompt threshold {d.threshold:.2g}")
                ax.axhline(d.mean_threshold, color="tab:orange", linestyle=":", label=f"mean bound {d.mean_threshold:.2g}")
        if ys:
            mean = sum(ys) / len(ys)
            ax.axhline(mean if mean > 0 or stat == "top1_agree" else min([y for y in ys if y > 0] or [1e-30]),
                       color="tab:gray", linestyle=":", label=f"mean {mean:.2g}")
        ax.set_title(STAT_TITLES.get(stat, stat), fontsize=10)
        ax.set_xlabel("prompt")
        ax.legend(fontsize=7, loc="best")
    if kernels:
        ax = flat[len(stats)]
        ops = sorted(kernels)
        ratios = [(kernels[o]["rel_err"] or 0) / kernels[o]["tolerance"] if kernels[o].get("tolerance") else 0 for o in ops]
        ax.barh(ops, [max(r, 1e-6) for r in ratios], color=["tab:red" if r > 1 else "tab:blue" for r in ratios])
        ax.set_xscale("log")
        ax.axvline(1.0, color="tab:red", linestyle="--", label="tolerance")
        ax.set_title("kernel battery: error / tolerance", fontsize=10)
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7)
    for ax in flat[panels:]:
        ax.axis("off")
    fig.suptitle(f"{verdict.sku}: {verdict.decision.upper()} - {verdict.image[:60]}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
