"""Markdown renderers for the report.md of compare, check, sweep, topics and study: pure functions of a result
returning text. Every +/- says what it is."""

from __future__ import annotations

from collections.abc import Sequence

from harness.domain.catalogue import FRONTIER_FAMILIES, FULL, STOCK
from harness.domain.costmodel import load_profile
from harness.domain.results import (
    CheckResult,
    CompareResult,
    FrontierResult,
    StudyResult,
    SweepResult,
    TopicResult,
)
from harness.domain.verdicts import DomainRow, MatchedResult
from harness.report.tables import (
    FRONTIER_HEADER,
    RAM_COLUMNS,
    SWEEP_HEADER,
    bound_table_rows,
    config_label,
    delta_cell,
    estimate_cells,
    frontier_cells,
    mass_line,
    md_table,
    plan_lines,
    preset_line,
    quality_cells,
    ram_rows,
    shown,
    speed_cells,
    speed_unit,
    sweep_cells,
    topic_cells,
)

# ---- compare ------------------------------------------------------------------------------------------------


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
        lines.append(md_table(["configuration", "PPL ± SE", "delta PPL [95% CI]", "substituted", "mass",
                               "fetches/token"], [list(quality_cells(q)) for q in result.quality]))
        lines.append("")
    if result.speed:
        lines += ["## Speed", "",
                  f"llama-bench, {speed_unit(result)}: mean ± 95% CI (Student t) over {o.runs} interleaved "
                  "repetitions; ratio to stock with a bootstrap 95% CI.", ""]
        lines.append(md_table(["configuration", "test", "mean", "± 95% CI", "n", "vs stock"],
                              [[config_label(r.config), r.test, *speed_cells(r)] for r in result.speed]))
        lines.append("")
    if result.estimates:
        lines += ["## Estimated decode speed (not measured)", "",
                  f"Cost model (harness.costmodel) with the `{result.estimate_profile}` hardware profile, fed with "
                  "the fetches and admissions per token counted in the emulate runs and stock's planned "
                  "--n-cpu-moe. These are estimates, labelled as such; no GPU was measured.", ""]
        lines.append(md_table(["configuration", "est. ms/token", "est. tokens/s", "est. vs stock"],
                              [list(estimate_cells(e)) for e in result.estimates]))
        lines.append("")
    lines += ["## Budget", "", result.budget.message, ""]
    if result.budget.memory == "RAM" and result.budget.checks:
        lines.append(md_table(list(RAM_COLUMNS), [list(row) for row in ram_rows(result.budget)]))
        lines += ["", "Every run's peak: " + ", ".join(
            f"{c.key} {c.peak_mib:.1f} MiB" if c.peak_mib is not None else f"{c.key} -" for c in result.budget.checks)
            + f" ({result.budget.checks[0].source or 'not measured'}).", ""]
    warnings = [w for r in result.speed for w in r.warnings] + list(result.warnings)
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    lines += ["## Provenance", "", f"Raw records (JSON Lines, schema with provenance and samples): "
              f"`{result.results_path}`; command: `{' '.join(o.argv) or 'harness compare'}`.", ""]
    return "\n".join(lines)


# ---- check ------------------------------------------------------------------------------------------------


def check_verdict(result: CheckResult) -> str:
    """PASS, or FAIL with the gates that failed (and an interrupted run)."""
    failed = [ln.policy for ln in result.lines if not ln.ok]
    if result.passed:
        return f"**PASS**: all {len(result.lines)} gates passed"
    why = [f"{len(failed)} of {len(result.lines)} gates failed ({', '.join(failed)})"] if failed else []
    if result.compare.interrupted:
        why.append("the run was interrupted")
    return "**FAIL**: " + "; ".join(why)


def render_check_markdown(result: CheckResult) -> str:
    """`harness check`'s report.md: the verdict, what ran, the rule, PASS/FAIL per gate, the quality table."""
    c, b = result.compare, result.baseline
    o = c.options
    policies = [q.config for q in c.quality if q.config not in (FULL, STOCK)]
    refs = ["the full model (patched build, cache off)"] + (
        ["stock llama.cpp"] if any(q.config == STOCK for q in c.quality) else [])
    chunks = f"{o.chunks} chunks" if o.chunks else "all chunks"
    action = (f"Baseline written from this run to `{shown(result.baseline_path)}`, then gated against."
              if result.updated else f"Baseline `{shown(result.baseline_path)}` (schema version {b.schema_version}).")
    lines = ["# harness check", "", check_verdict(result), "",
             "## What ran", "",
             f"Perplexity only (no speed runs, no device budget): {', '.join(refs)} and {len(policies)} policies "
             f"({', '.join(policies) or 'none'}) in emulate mode on the same tokens. Model "
             f"`{shown(o.model)}`, text `{shown(o.text)}`, context {o.n_ctx}, {chunks}. {action} Delta PPL is paired "
             f"against the full model, with a 95% CI from a block bootstrap over chunks ({o.n_boot} replicates, seed "
             f"{o.seed}).", "",
             "## Gates", "", result.rule, ""]
    rows = []
    for ln in result.lines:
        band = f"[{ln.band[0]:+.3f}, {ln.band[1]:+.3f}]" if ln.band is not None else "-"
        rows.append([ln.policy, "PASS" if ln.ok else "FAIL", band, ln.message])
    lines += [md_table(["gate", "verdict", "band (delta PPL %)", "detail"], rows), ""]
    if c.quality:
        lines += ["## Quality", "", "PPL ± one standard error (as llama-perplexity prints it).", "",
                  md_table(["configuration", "PPL ± SE", "delta PPL [95% CI]", "substituted", "mass",
                            "fetches/token"], [list(quality_cells(q)) for q in c.quality]), ""]
    if c.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in c.warnings] + [""]
    lines += ["## Provenance", "", f"Raw records (JSON Lines, schema with provenance and samples): "
              f"`{shown(c.results_path)}`; command: `{' '.join(o.argv) or 'harness check'}`.", ""]
    return "\n".join(lines)


# ---- sweep ------------------------------------------------------------------------------------------------


def render_sweep_markdown(result: SweepResult) -> str:
    o = result.options
    lines = ["# harness sweep", "",
             f"Model `{shown(o.model)}`, text `{shown(o.text)}`, context {o.n_ctx}. Every policy runs in emulate "
             "mode on the same tokens; delta PPL is paired against the full model (cache off), with a 95% CI from a "
             "block bootstrap "
             f"over chunks ({o.n_boot} replicates, seed {o.seed}). `est. ms/token` is the cost model's estimate on "
             f"the `{o.profile}` profile from the counted fetches and admissions: an estimate, not a measurement. "
             "`*` marks the quality/speed Pareto frontier (lower delta, lower estimated time).", "",
             md_table(SWEEP_HEADER, [sweep_cells(r, result.frontier) for r in result.rows]), "",
             "## Mass hypothesis", "", mass_line(result), ""]
    if result.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in result.warnings] + [""]
    lines += [f"Raw records: `{result.results_path}`; command: `{' '.join(o.argv) or 'harness sweep'}`.", ""]
    return "\n".join(lines)


# ---- frontier ---------------------------------------------------------------------------------------------


def _host_term(profile: str) -> str:
    p = load_profile(profile)
    return (f"a host-computed expert (light=host) is charged its bytes at the profile's host memory bandwidth "
            f"({p.cpu_bw_gbs:g} GB/s) plus {p.host_expert_us:g} us (activations to the host and back, CPU op "
            "dispatch), serially: the profile's `sources` say where each figure comes from (estimates, unmeasured).")


def frontier_summary_lines(result: FrontierResult, level: str = "##") -> list[str]:
    """The side-by-side tables (one per residency), and whether the presets are on the frontier."""
    o = result.options
    lines = [f"Bytes moved per token: synchronous fetches and background admissions, each times one expert's "
             f"{result.bytes_per_expert / 1024:g} KiB (host computes move none but cost time). The bound is on "
             "delta PPL's point estimate (its paired 95% CI shown); among the family's points within it, the one "
             "moving the fewest bytes (sync + background), ties by estimated time. `est.` is the cost model on "
             f"the `{o.profile}` profile: an estimate, not a measurement; {_host_term(o.profile)}", ""]
    for f in o.grid.fractions:
        slots = next((r.point.slots for r in result.rows if r.point.fraction == f), None)
        header, rows = bound_table_rows(result.table, f)
        lines += [f"{level} {f:.1%} resident" + (f" ({slots} slots per layer)" if slots is not None else ""), "",
                  md_table(header, rows), ""]
    lines += [f"{level} Presets on the frontier", ""]
    lines += [f"- {preset_line(p)}" for p in result.presets] + [""]
    return lines


def study_frontier_lines(frontier: FrontierResult | None, note: str = "") -> list[str]:
    """The study report's section "The frontier, side by side"."""
    lines = ["## The frontier, side by side", ""]
    if frontier is None:
        return lines + [note, ""]
    g = frontier.options.grid
    lines += [f"All families at {', '.join(f'{x:.1%}' for x in g.fractions)} residency on the same tokens "
              "(`frontier/report.md` has every point, `frontier/plots` the figures; `harness frontier`). "
              + " ".join(f"`{f}`: {FRONTIER_FAMILIES[f]}." for f in FRONTIER_FAMILIES if f in g.families), ""]
    return lines + frontier_summary_lines(frontier, "###")


def render_frontier_markdown(result: FrontierResult) -> str:
    o = result.options
    lines = ["# harness frontier: the policies side by side", "",
             f"Model `{shown(o.model)}`, text `{shown(o.text)}`, context {o.n_ctx}"
             + (f", {o.chunks} chunks" if o.chunks else "") + ". Every policy runs in emulate mode on the same "
             "tokens at each residency; delta PPL is paired against the full model (cache off), with a 95% CI from "
             f"a block bootstrap over chunks ({o.n_boot} replicates, seed {o.seed}).", "",
             "Families:", ""]
    lines += [f"- `{f}`: {FRONTIER_FAMILIES[f]}" for f in FRONTIER_FAMILIES if f in o.grid.families] + [""]
    lines += frontier_summary_lines(result)
    lines += ["## Every point", "",
              "`frontier`: `t` on the Pareto frontier of delta PPL against estimated time per token, `b` against "
              "bytes moved per token (both at that residency, on point estimates).", ""]
    for f in o.grid.fractions:
        rows = [r for r in result.rows if r.point.fraction == f]
        lines += [f"### {f:.1%} resident", "",
                  md_table(FRONTIER_HEADER, [frontier_cells(r, result.frontier.get(f, ()),
                                                            result.bytes_frontier.get(f, ())) for r in rows]), ""]
    if result.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in result.warnings] + [""]
    lines += [f"Raw records: `{shown(result.results_path)}`; command: `{' '.join(o.argv) or 'harness frontier'}`. "
              "Plots: `harness report DIR --plots`.", ""]
    return "\n".join(lines)


# ---- topic changes ----------------------------------------------------------------------------------------------


def render_topics_markdown(result: TopicResult) -> str:
    o = result.options
    lines = ["# Admission after topic changes", "",
             f"Text `{shown(o.text)}` with {result.n_boundaries} topic changes; policy `{o.policy}` in emulate mode, "
             "with "
             f"its background admission and with `admit=off`, on the same {result.n_scored} scored tokens. "
             f"\"After a change\" = the first {o.window} tokens of each new segment ({result.n_after_change} scored "
             "tokens). Deltas are paired, with 95% CIs from a block bootstrap over chunks.", "",
             md_table(["comparison", "overall", "after a change", "elsewhere"],
                      [topic_cells(r) for r in result.rows]), ""]
    if result.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in result.warnings] + [""]
    lines += [f"Raw records: `{result.results_path}`.", ""]
    return "\n".join(lines)


# ---- study ------------------------------------------------------------------------------------------------------


def matched_lines(m: MatchedResult | None, note: str) -> list[str]:
    """The matched runs of findings 1 and rank against weight: each arm on the evaluation tokens, and the searches."""
    lines = ["## Matched runs (finding 1 at equal count, rank against weight at equal mass)", ""]
    if m is None:
        return [*lines, note, ""]
    rows = [[x.name, x.spec, delta_cell(x.delta) if x.delta else "-",
             "-" if x.substitution_rate is None else f"{x.substitution_rate:.2%}",
             "-" if x.substituted_mass is None else f"{x.substituted_mass:.4f}",
             "-" if x.subst_first_choice is None else str(x.subst_first_choice)]
            for x in (m.rule, m.lightest, m.heavy_nonfirst, m.light_first) if x is not None]
    lines += [md_table(["run", "spec", "delta PPL vs full [95% CI]", "substituted", "mass", "first choices subst."],
                       rows), "",
              f"Calibration text: {m.calib_text}. Lightest-first's edge, searched on the substitution rate: " +
              (", ".join(f"hi={s.hi:g}: {s.mass:.4f}" for s in m.rate_steps) or "not searched") +
              f" (chosen: {m.lightest_hi if m.lightest_hi is not None else 'none'}). Light first choices' edge, "
              "searched on the mass: " + (", ".join(f"hi={s.hi:g}: {s.mass:.4f}" for s in m.mass_steps) or
                                          "not searched") +
              f" (chosen: {m.light_first_hi if m.light_first_hi is not None else 'none'}).", ""]
    if m.q is not None:
        lines += [f"The 0.15 rule vs lightest-first, paired: {delta_cell(m.q)}.", ""]
    if m.r is not None:
        lines += [f"Heavy non-first vs light first choices, paired: {delta_cell(m.r)}.", ""]
    lines += [f"- {n}" for n in m.notes] + ([""] if m.notes else [])
    return lines


def domain_lines(rows: Sequence[DomainRow], note: str) -> list[str]:
    """The study's paired comparisons per domain of the text; "differs" names a domain whose CI lies on the other
    side of 0 from the whole text's."""
    lines = ["## Per domain", ""]
    if not rows:
        return [*lines, note or "no comparisons to split", ""]
    domains = [d for d, _ in rows[0].by_domain]
    cells = [[r.comparison, delta_cell(r.whole), *(delta_cell(x) if x else "-" for _, x in r.by_domain),
              ", ".join(r.differs) or "-"] for r in rows]
    return [*lines, md_table(["comparison", "whole text", *domains, "differs by domain"], cells), ""]


def render_study_markdown(result: StudyResult) -> str:
    o = result.options
    c = result.compare
    info = c.plan.info
    lines = ["# The study's findings, re-tested", "",
             f"Model `{shown(c.options.model)}` ({info.n_expert} experts per layer, top-{info.n_expert_used}), "
             f"{o.residency:.0%} of each layer's experts resident "
             f"({c.plan.slots.slots_per_layer} of {info.n_expert} slots per layer), "
             f"text `{shown(c.options.text)}`, "
             f"context {o.n_ctx}. Everything runs in the patched build's emulate mode on the same tokens; every "
             "delta is paired, with a 95% CI from a block bootstrap over chunks. Regenerate with "
             f"`{' '.join(o.argv) or 'harness study'}`.", ""]
    lines += [*result.header, "", "## Verdicts", "",
              "The rules were fixed before the runs (docs/study-verdicts.md); each ends in held, did not hold or "
              "inconclusive (the numbers cannot decide, or a run is missing).", ""]
    word = {True: "held", False: "did not hold", None: "inconclusive"}
    for v in result.verdicts:
        lines += [f"- **{v.finding}: {word[v.held]}.** {v.evidence}."]
    lines += ["", *matched_lines(result.matched, result.matched_note)]
    lines += domain_lines(result.domain_rows, result.domain_note)
    lines += ["", "## Policies against the full model", "",
              md_table(["configuration", "PPL ± SE", "delta PPL [95% CI]", "substituted", "mass", "fetches/token"],
                       [list(quality_cells(q)) for q in c.quality]), ""]
    if result.pairs:
        lines += ["## Paired comparisons between policies", "",
                  md_table(["comparison", "delta PPL [95% CI]"],
                           [[k, delta_cell(v)] for k, v in result.pairs.items()]), ""]
    lines += ["## Mass hypothesis (sweep)", "", mass_line(result.sweep), "",
              md_table(SWEEP_HEADER, [sweep_cells(r, result.sweep.frontier) for r in result.sweep.rows]), ""]
    lines += ["## Admission after topic changes", ""]
    if result.topics is not None:
        t = result.topics
        lines += [md_table(["comparison", "overall", "after a change", "elsewhere"],
                           [topic_cells(r) for r in t.rows]), "",
                  f"{t.n_boundaries} topic changes, {t.n_after_change} of {t.n_scored} scored tokens within "
                  f"{t.options.window} tokens after one.", ""]
    else:
        lines += [result.topics_note, ""]
    lines += study_frontier_lines(result.frontier, result.frontier_note)
    notes = list(c.notes) + list(c.warnings) + list(result.sweep.warnings)
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    lines += ["Speed findings (6 and the time halves of 5) need the engine and a GPU and are not tested here; "
              "the sweep's `est. ms/token` is a cost-model estimate, not a measurement.", ""]
    return "\n".join(lines)
