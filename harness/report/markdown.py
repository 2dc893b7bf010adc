"""Renderers for `harness compare`: pure functions of a `CompareResult` returning a rich renderable (for the
terminal) or markdown text (for the report file). Every +/- says what it is."""

from __future__ import annotations

import io
import math
from pathlib import Path

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from harness.core.project import project_root
from harness.core.sizes import format_bytes
from harness.orchestration.compare import FULL, STOCK, ComparePlan, CompareResult, EstimateRow, QualityRow, SpeedRow
from harness.orchestration.study import StudyResult
from harness.orchestration.sweep import SweepResult, SweepRow
from harness.orchestration.topics import TopicResult
from harness.stats.intervals import DeltaPPL


def _num(x: float | None, fmt: str = ".2f") -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return format(x, fmt)


def _label(config: str) -> str:
    return {STOCK: "stock llama.cpp", FULL: "full model (cache off)"}.get(config, config)


def speed_unit(result: CompareResult) -> str:
    return "tokens/s (CPU build)" if result.gpu == "none" else "tokens/s"


def plan_lines(plan: ComparePlan) -> list[str]:
    i = plan.info
    s = plan.slots
    lines = [
        f"model: {i.name} ({i.arch}), {i.n_moe_layers} MoE layers x {i.n_expert} experts, top-{i.n_expert_used}; "
        f"non-expert weights {format_bytes(i.non_expert_bytes)}, experts {format_bytes(i.expert_bytes)}",
        f"budget: {format_bytes(plan.budget_bytes)}",
        f"stock: non-expert weights + {plan.stock_gpu_moe_layers} of {i.n_moe_layers} MoE layers' experts on the "
        f"device (--n-cpu-moe {plan.stock.n_cpu_moe}); {format_bytes(plan.host_expert_bytes_stock)} of experts "
        "in host memory",
        f"patched: non-expert weights + {s.slots_per_layer} cache slots per layer ({s.resident_fraction:.1%} of the "
        f"experts, {format_bytes(s.cache_bytes)}); all {format_bytes(plan.host_expert_bytes_patched)} of experts "
        "in host memory" if plan.patched.n_cpu_moe else "patched: the whole model on the device, as stock",
    ]
    return lines


def _speed_cells(r: SpeedRow) -> tuple[str, str, str, str]:
    ci = r.tokens_per_s
    mean = _num(ci.mean)
    pm = f"± {_num(ci.half_width)}" if math.isfinite(ci.half_width) else "(n=1, no CI)"
    vs = "-"
    if r.vs_stock is not None:
        vs = f"{r.vs_stock.ratio:.2f}x"
        if math.isfinite(r.vs_stock.low):
            vs += f" [{r.vs_stock.low:.2f}, {r.vs_stock.high:.2f}]"
    return mean, pm, str(ci.n), vs


def _estimate_cells(e: EstimateRow) -> tuple[str, str, str, str]:
    return (_label(e.config), f"{e.ms_per_token:.2f}", f"{1000 / e.ms_per_token:.1f}",
            f"{e.vs_stock:.2f}x" if e.vs_stock is not None else "-")


def _quality_cells(r: QualityRow) -> tuple[str, str, str, str, str, str]:
    ppl = f"{r.ppl:.4f} ± {r.ppl_se:.4f}"
    if r.delta is not None:
        d = f"{r.delta.delta_pct:+.2f}% [{r.delta.low:+.2f}, {r.delta.high:+.2f}]"
    elif r.config in (FULL, STOCK):
        d = "(reference)" if r.config == FULL else "-"
    else:
        d = r.note or "-"
    c = r.cache
    sub = _num(c.substitution_rate * 100, ".2f") + "%" if c and c.substitution_rate is not None else "-"
    mass = _num(c.substituted_mass, ".4f") if c else "-"
    fetch = _num(c.fetches_per_token, ".2f") if c else "-"
    return _label(r.config), ppl, d, sub, mass, fetch


def render_compare(result: CompareResult) -> Group:
    """The terminal view: plan, quality table, speed table, budget verdict, warnings."""
    parts: list[Table | Text] = [Text("\n".join(plan_lines(result.plan) + list(result.notes)))]
    if result.quality:
        t = Table(title="quality (same tokens; PPL ± one SE; delta vs the full model, 95% CI by block bootstrap)",
                  title_justify="left")
        for col in ("configuration", "PPL ± SE", "delta PPL [95% CI]", "substituted", "mass", "fetches/token"):
            t.add_column(col, justify="left" if col in ("configuration",) else "right")
        for q in result.quality:
            t.add_row(*_quality_cells(q))
        parts.append(t)
    if result.speed:
        t = Table(title=f"speed ({speed_unit(result)}; mean ± 95% CI over repetitions, stock and patched "
                  "interleaved; ratio to stock with a bootstrap 95% CI)", title_justify="left")
        for col in ("configuration", "test", "mean", "± 95% CI", "n", "vs stock"):
            t.add_column(col, justify="left" if col in ("configuration", "test") else "right")
        for r in result.speed:
            t.add_row(_label(r.config), r.test, *_speed_cells(r))
        parts.append(t)
    if result.estimates:
        t = Table(title=f"ESTIMATED decode speed on a {result.estimate_profile} (cost model from the emulate runs' "
                  "fetches per token; an estimate, not a measurement)", title_justify="left")
        for col in ("configuration", "est. ms/token", "est. tokens/s", "est. vs stock"):
            t.add_column(col, justify="left" if col == "configuration" else "right")
        for e in result.estimates:
            t.add_row(*_estimate_cells(e))
        parts.append(t)
    parts.append(Text("budget: " + result.budget.message,
                      style="bold red" if result.budget.over else ("yellow" if not result.budget.ok else "green")))
    warnings = [w for r in result.speed for w in r.warnings] + list(result.warnings)
    if warnings:
        parts.append(Text("\n".join("warning: " + w for w in warnings), style="yellow"))
    parts.append(Text(f"results: {result.results_path} ({result.n_run} runs now, {result.n_resumed} resumed)"))
    return Group(*parts)


def render_compare_text(result: CompareResult, width: int = 120) -> str:
    """The terminal view as plain text (for logs and tests)."""
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(render_compare(result))
    out = console.file
    assert isinstance(out, io.StringIO)
    return out.getvalue()


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def render_compare_markdown(result: CompareResult) -> str:
    o = result.options
    lines = ["# harness compare", ""]
    lines += [f"- {ln}" for ln in plan_lines(result.plan) + list(result.notes)]
    lines += [f"- GPU: {result.gpu}; backend: {result.backend}", ""]
    if result.quality:
        lines += ["## Quality", "",
                  f"Text `{o.text}`, context {o.n_ctx}. PPL ± one standard error (as llama-perplexity prints it). "
                  "Delta PPL is paired against the full model (patched build, cache off) on the same tokens, "
                  "with a 95% CI from a block bootstrap over chunks "
                  f"({o.n_boot} replicates, seed {o.seed}). Policies run in emulate mode.", ""]
        lines.append(_md_table(["configuration", "PPL ± SE", "delta PPL [95% CI]", "substituted", "mass",
                                "fetches/token"], [list(_quality_cells(q)) for q in result.quality]))
        lines.append("")
    if result.speed:
        lines += ["## Speed", "",
                  f"llama-bench, {speed_unit(result)}: mean ± 95% CI (Student t) over {o.runs} interleaved "
                  "repetitions; ratio to stock with a bootstrap 95% CI.", ""]
        lines.append(_md_table(["configuration", "test", "mean", "± 95% CI", "n", "vs stock"],
                               [[_label(r.config), r.test, *_speed_cells(r)] for r in result.speed]))
        lines.append("")
    if result.estimates:
        lines += ["## Estimated decode speed (not measured)", "",
                  f"Cost model (harness.costmodel) with the `{result.estimate_profile}` hardware profile, fed with "
                  "the fetches and admissions per token counted in the emulate runs and stock's planned "
                  "--n-cpu-moe. These are estimates, labelled as such; no GPU was measured.", ""]
        lines.append(_md_table(["configuration", "est. ms/token", "est. tokens/s", "est. vs stock"],
                               [list(_estimate_cells(e)) for e in result.estimates]))
        lines.append("")
    lines += ["## Budget", "", result.budget.message, ""]
    warnings = [w for r in result.speed for w in r.warnings] + list(result.warnings)
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    lines += ["## Provenance", "", f"Raw records (JSON Lines, schema with provenance and samples): "
              f"`{result.results_path}`; command: `{' '.join(o.argv) or 'harness compare'}`.", ""]
    return "\n".join(lines)


# ---- sweep ------------------------------------------------------------------------------------------------

def _sweep_cells(r: SweepRow, front: tuple[str, ...]) -> list[str]:
    d = r.delta
    delta = f"{d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}]" if d is not None else "-"
    return [r.point.name, f"{r.ppl:.4f}", delta,
            _num(r.substitution_rate * 100, ".2f") + "%" if r.substitution_rate is not None else "-",
            _num(r.substituted_mass, ".4f"), _num(r.fetches_per_token, ".2f"), _num(r.est_ms_per_token, ".3f"),
            "*" if r.point.name in front else ""]


_SWEEP_HEADER = ["policy", "PPL", "delta PPL [95% CI]", "substituted", "mass", "fetches/token", "est. ms/token",
                 "frontier"]


def mass_line(result: SweepResult) -> str:
    m = result.mass
    if m.correlation is None:
        return f"mass hypothesis: not tested ({m.note})"
    c = m.correlation
    return (f"mass hypothesis: Pearson r = {c.r:.3f}, 95% CI [{c.low:.3f}, {c.high:.3f}] (Fisher z), over {c.n} "
            "policies that always fetch the first choice (substituted mass vs delta PPL%)")


def render_sweep(result: SweepResult) -> Group:
    t = Table(title=f"sweep on the same tokens (full model PPL {_num(result.full_ppl, '.4f')}; delta vs the full "
              "model, 95% CI by block bootstrap; est. = cost model estimate on "
              f"{result.options.profile}, not measured; * = on the quality/speed frontier)", title_justify="left")
    for col in _SWEEP_HEADER:
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in result.rows:
        t.add_row(*_sweep_cells(r, result.frontier))
    parts: list[Table | Text] = [t, Text(mass_line(result))]
    if result.warnings:
        parts.append(Text("\n".join("warning: " + w for w in result.warnings), style="yellow"))
    parts.append(Text(f"results: {result.results_path} ({result.n_run} runs now, {result.n_resumed} resumed)"))
    return Group(*parts)


def _shown(path: object) -> str:
    """A path as a report shows it: relative to the checkout when inside it, so reports do not name one machine."""
    p = Path(str(path))
    try:
        return str(p.resolve().relative_to(project_root()))
    except (ValueError, OSError):
        return str(p)


def render_sweep_markdown(result: SweepResult) -> str:
    o = result.options
    lines = ["# harness sweep", "",
             f"Model `{_shown(o.model)}`, text `{_shown(o.text)}`, context {o.n_ctx}. Every policy runs in emulate "
             "mode on the same tokens; delta PPL is paired against the full model (cache off), with a 95% CI from a "
             "block bootstrap "
             f"over chunks ({o.n_boot} replicates, seed {o.seed}). `est. ms/token` is the cost model's estimate on "
             f"the `{o.profile}` profile from the counted fetches and admissions: an estimate, not a measurement. "
             "`*` marks the quality/speed Pareto frontier (lower delta, lower estimated time).", "",
             _md_table(_SWEEP_HEADER, [_sweep_cells(r, result.frontier) for r in result.rows]), "",
             "## Mass hypothesis", "", mass_line(result), ""]
    if result.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in result.warnings] + [""]
    lines += [f"Raw records: `{result.results_path}`; command: `{' '.join(o.argv) or 'harness sweep'}`.", ""]
    return "\n".join(lines)


# ---- topic changes ----------------------------------------------------------------------------------------------

def _d(d: DeltaPPL | None) -> str:
    return f"{d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}]" if d is not None else "-"


def render_topics_markdown(result: TopicResult) -> str:
    o = result.options
    lines = ["# Admission after topic changes", "",
             f"Text `{_shown(o.text)}` with {result.n_boundaries} topic changes; policy `{o.policy}` in emulate mode, "
             "with "
             f"its background admission and with `admit=off`, on the same {result.n_scored} scored tokens. "
             f"\"After a change\" = the first {o.window} tokens of each new segment ({result.n_after_change} scored "
             "tokens). Deltas are paired, with 95% CIs from a block bootstrap over chunks.", "",
             _md_table(["comparison", "overall", "after a change", "elsewhere"],
                       [[r.label, _d(r.overall), _d(r.after_change), _d(r.elsewhere)] for r in result.rows]), ""]
    if result.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in result.warnings] + [""]
    lines += [f"Raw records: `{result.results_path}`.", ""]
    return "\n".join(lines)


# ---- study ------------------------------------------------------------------------------------------------------

def render_study_markdown(result: StudyResult) -> str:
    o = result.options
    c = result.compare
    lines = ["# The study's findings, re-tested", "",
             f"Model `{_shown(c.options.model)}`, {o.residency:.0%} of each layer's experts resident "
             f"({c.plan.slots.slots_per_layer} of {c.plan.info.n_expert} slots per layer), "
             f"text `{_shown(c.options.text)}`, "
             f"context {o.n_ctx}. Everything runs in the patched build's emulate mode on the same tokens; every "
             "delta is paired, with a 95% CI from a block bootstrap over chunks. Regenerate with "
             f"`{' '.join(o.argv) or 'harness study'}`.", "", "## Verdicts", ""]
    word = {True: "held", False: "did not hold", None: "not tested"}
    for v in result.verdicts:
        lines += [f"- **{v.finding}: {word[v.held]}.** {v.evidence}."]
    lines += ["", "## Policies against the full model", "",
              _md_table(["configuration", "PPL ± SE", "delta PPL [95% CI]", "substituted", "mass", "fetches/token"],
                        [list(_quality_cells(q)) for q in c.quality]), ""]
    if result.pairs:
        lines += ["## Paired comparisons between policies", "",
                  _md_table(["comparison", "delta PPL [95% CI]"], [[k, _d(v)] for k, v in result.pairs.items()]), ""]
    lines += ["## Mass hypothesis (sweep)", "", mass_line(result.sweep), "",
              _md_table(_SWEEP_HEADER, [_sweep_cells(r, result.sweep.frontier) for r in result.sweep.rows]), ""]
    lines += ["## Admission after topic changes", ""]
    if result.topics is not None:
        t = result.topics
        lines += [_md_table(["comparison", "overall", "after a change", "elsewhere"],
                            [[r.label, _d(r.overall), _d(r.after_change), _d(r.elsewhere)] for r in t.rows]), "",
                  f"{t.n_boundaries} topic changes, {t.n_after_change} of {t.n_scored} scored tokens within "
                  f"{t.options.window} tokens after one.", ""]
    else:
        lines += [result.topics_note, ""]
    notes = list(c.notes) + list(c.warnings) + list(result.sweep.warnings)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    lines += ["Speed findings (3, 6 and the time halves of 5) need the engine and a GPU and are not tested here; "
              "the sweep's `est. ms/token` is a cost-model estimate, not a measurement.", ""]
    return "\n".join(lines)
