"""Markdown of Experiment B (`harness composition`, finding 3): the design, the calibration search, the two
compositions per mass level and the verdict. Pure."""

from __future__ import annotations

from harness.domain.composition import Composition, CompositionResult, MassLevel
from harness.report.tables import delta_cell, md_table, shown

WORD = {True: "held", False: "did not hold", None: "inconclusive"}


def _cells(c: Composition | None, lv: MassLevel) -> list[str]:
    if c is None:
        return ["-"] * 7
    return [c.spec, f"{c.ppl:.4f}", delta_cell(c.delta),
            f"{c.substituted_mass:.4f}" if c.substituted_mass is not None else "-",
            f"{c.substitution_rate:.2%}" if c.substitution_rate is not None else "-",
            str(c.subst_first_choice) if c.subst_first_choice is not None else "-",
            f"{c.max_subst_weight:.3f}" if c.max_subst_weight is not None else "-"]


def composition_section(result: CompositionResult, heading: str = "##") -> list[str]:
    """The tables and the verdict, as lines (also the study report's section)."""
    o = result.options
    v = result.verdict
    lines = [f"**Verdict: {WORD[v.held]}.** {v.evidence}.", "",
             f"Evaluation: the first {o.chunks} chunks of `{shown(o.text)}` (context {o.n_ctx}), full model PPL "
             f"{result.full_ppl:.4f}; {result.slots} slots per layer, eviction {o.evict}, no admission. Calibration: "
             f"{o.calib_chunks} chunks of the text from character {o.calib_offset} on (calibration.txt). Mass = "
             "mean substituted gate mass per token-layer. The bands sort misses by gate weight only; rank and weight "
             "are not separated (the heavy band's substitutions are mostly first choices: see the column).", ""]
    for lv in result.levels:
        lines += [f"{heading}# Mass level: heavy band lo={lv.heavy_lo:g}", ""]
        if lv.calib_heavy_mass is not None:
            lines += [f"Calibration: heavy mass {lv.calib_heavy_mass:.4f}; light band edge search (hi -> mass): "
                      + ", ".join(f"{s.hi:g} -> {s.mass:.4f}" for s in lv.calib_steps)
                      + (f"; chosen hi={lv.light_hi:g}." if lv.light_hi is not None else "."), ""]
        if lv.note:
            lines += [lv.note, ""]
        if lv.heavy is not None or lv.light is not None:
            lines += [md_table(["composition", "rule", "PPL", "delta PPL vs full [95% CI]", "mass", "substituted",
                                "first choices substituted", "max substituted weight"],
                               [["heavy", *_cells(lv.heavy, lv)], ["light", *_cells(lv.light, lv)]]), ""]
            gap = lv.mass_gap
            lines += [f"Heavy vs light, paired on the same tokens: {delta_cell(lv.pair)} (95% CI, block bootstrap "
                      f"over chunks); realised masses differ by {gap:.1%} of their mean" if gap is not None else
                      f"Heavy vs light, paired: {delta_cell(lv.pair)}", ""]
    if result.warnings:
        lines += ["Notes:", ""] + [f"- {w}" for w in result.warnings] + [""]
    return lines


def render_composition_markdown(result: CompositionResult) -> str:
    o = result.options
    lines = ["# Experiment B: heavy vs light substitutions at equal mass", "",
             "Two compositions of the same cache, each with `rule=band`: heavy substitutes only misses with gate "
             "weight >= lo (any rank), light only misses with gate weight < hi (hi <= lo), fetching every other "
             "miss; hi is searched on a calibration text so that the substituted masses match. The decision rule "
             "was fixed before the runs (harness/domain/composition.py). Regenerate with "
             f"`{' '.join(o.argv) or 'harness composition'}`.", ""]
    return "\n".join(lines + composition_section(result)) + "\n"
