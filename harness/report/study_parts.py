"""The study report's sections for Experiment B (finding 3) and the generation test. Pure."""

from __future__ import annotations

from harness.domain.composition import CompositionResult
from harness.domain.generation import GenerationResult
from harness.report.composition import composition_section
from harness.report.generation import generation_section


def study_parts_markdown(comp: CompositionResult | None, comp_note: str, gen: GenerationResult | None,
                         gen_note: str) -> str:
    lines = ["## Experiment B: heavy vs light substitutions at equal mass (finding 3)", "",
             "Results in `composition/` (`harness composition`). Heavy: `rule=band,lo=L` substitutes only misses with "
             "gate weight >= L (any rank); light: `rule=band,hi=H` only misses below H <= L; every other miss is "
             "fetched. H is found on a calibration text so that the substituted masses match; the decision rule was "
             "fixed before the runs (harness/domain/composition.py).", ""]
    lines += composition_section(comp, "##") if comp is not None else [comp_note, ""]
    lines += ["## Generation test", "", "Results in `generation/` (`harness generate`).", ""]
    lines += generation_section(gen, "##") if gen is not None else [gen_note, ""]
    return "\n".join(lines)
