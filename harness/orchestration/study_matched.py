"""The matched runs of `harness study` (docs/study-verdicts.md), in the resumable folder `matched/` of the study's
--out, with `harness composition`'s runs and search (harness.orchestration.composition):
- finding 1: lightest-first at the 0.15 rule's count, `rule=band,hi=H` with H bisected on the calibration text so
  that its substitution rate matches the rule's there;
- findings 1 and 3, rank against weight: heavy non-first `rule=band,lo=0.15,min_rank=1` against light first choices
  `rule=band,hi=H,max_rank=0`, H bisected so that the masses match.
Each then runs on the evaluation tokens, with the full model and the 0.15 rule, and is paired there.
"""

from __future__ import annotations

from pathlib import Path

from harness.core import project
from harness.core.errors import HarnessError
from harness.domain.catalogue import POLICIES
from harness.domain.composition import CalibStep, Composition, CompositionOptions
from harness.domain.options import StudyOptions
from harness.domain.verdicts import RANK_LO, MatchedResult
from harness.orchestration.composition import (
    Runs,
    band_items,
    calibration_text,
    composition_of,
    record_mass,
    record_rate,
    search_light_edge,
)
from harness.orchestration.executor import Environment, Progress, no_progress
from harness.orchestration.study_parts import HELDOUT_DOCS
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import DeltaPPL, paired_delta_ppl
from harness.tools.requests import Runner

RULE = POLICIES["rule-0.15"]


def _pair(base: NllDump, test: NllDump, opts: CompositionOptions) -> DeltaPPL | None:
    if base.nll.shape != test.nll.shape or not (base.tokens == test.tokens).all():
        return None
    return paired_delta_ppl(base.nll, test.nll, base.chunk, n_boot=opts.n_boot, seed=opts.seed)


def calibration_source(opts: StudyOptions, text: Path) -> tuple[str, str]:
    """(the calibration slice, where it came from): --calib-text, or heldout-docs.txt when the whole text is
    evaluated, or the composition's slice of the text past the evaluation chunks."""
    c = CompositionOptions(out=opts.out)
    src = opts.calib_text or (project.project_root() / HELDOUT_DOCS if opts.chunks is None else None)
    if src is not None:
        if not src.is_file():
            raise HarnessError(f"cannot read the calibration text {src}: no such file")
        return calibration_text(src.read_text(), 0, c.calib_chars), f"`{src.name}`, its first {c.calib_chars} " \
                                                                     "characters"
    return (calibration_text(text.read_text(), c.calib_offset, c.calib_chars),
            f"`{text.name}` from character {c.calib_offset}")


def run_matched(opts: StudyOptions, runner: Runner, info: ModelInfo, *, env: Environment | None = None,
                progress: Progress = no_progress) -> MatchedResult:
    env = env or Environment()
    if opts.model is None or opts.text is None:
        raise HarnessError("no model or text given")
    copts = CompositionOptions(out=opts.out / "matched", model=opts.model, text=opts.text, residency=opts.residency,
                               n_ctx=opts.n_ctx, chunks=opts.chunks, threads=opts.threads, seed=opts.seed,
                               argv=opts.argv, heavy_los=(RANK_LO,), warm_from=opts.warm_from)
    copts.out.mkdir(parents=True, exist_ok=True)
    slots = max(info.n_expert_used, min(info.n_expert, round(opts.residency * info.n_expert)))
    calib = copts.out / "calibration.txt"
    calib_text, where = calibration_source(opts, opts.text)
    if not calib.is_file() or calib.read_text() != calib_text:
        calib.write_text(calib_text)
    runs = Runs(copts, runner, env, opts.model, opts.text, calib, slots, progress, info)
    notes: list[str] = []
    dumps: list[tuple[str, NllDump]] = []

    def measure(what: str, items: tuple[tuple[str, str], ...]) -> float:
        rec = runs.run("calib", items)
        v = record_rate(rec) if what == "rate" else record_mass(rec)
        if v is None:
            raise HarnessError("a calibration run recorded no cache statistics")
        return v

    full = runs.nll(runs.run("eval", None))

    def evaluate(items: tuple[tuple[str, str], ...]) -> tuple[Composition, NllDump]:
        rec = runs.run("eval", items)
        return composition_of(runs, rec, items, full), runs.nll(rec)

    # finding 1: lightest-first at the rule's count
    rule, rule_nll = evaluate(RULE)
    dumps.append(("matched:rule", rule_nll))
    lightest = q = None
    target = measure("rate", RULE)
    h1: float | None = None
    steps1: list[CalibStep] = []
    if target <= 0:
        notes.append("the 0.15 rule substituted nothing on the calibration text: no count to match")
    else:
        h1, steps1 = search_light_edge(lambda h: measure("rate", band_items(hi=h, evict=copts.evict)), target, 1.0,
                                       copts.tolerance, copts.max_steps)
        if h1 is None:
            notes.append(f"lightest-first reaches a substitution rate of {steps1[0].mass:.4f} at most (hi=1), below "
                         f"the rule's {target:.4f}")
        else:
            lightest, light_nll = evaluate(band_items(hi=h1, evict=copts.evict))
            q = _pair(light_nll, rule_nll, copts)
            dumps.append(("matched:lightest", light_nll))

    # rank against weight: heavy non-first vs light first choices at matched mass
    heavy_items = band_items(lo=RANK_LO, min_rank=1, evict=copts.evict)
    heavy = light_first = r = None
    h2: float | None = None
    steps2: list[CalibStep] = []
    try:  # a build without the band's max_rank (or min_rank) fails here; finding 1's runs stand
        m = measure("mass", heavy_items)
        if m <= 0:
            notes.append(f"heavy non-first (lo={RANK_LO:g}, min_rank=1) substituted nothing on the calibration text")
        else:
            h2, steps2 = search_light_edge(lambda h: measure("mass", band_items(hi=h, max_rank=0, evict=copts.evict)),
                                           m, 1.0, copts.tolerance, copts.max_steps)
            if h2 is None:
                notes.append(f"light first choices reach mass {steps2[0].mass:.4f} at most (hi=1), below heavy "
                             f"non-first's {m:.4f}")
            else:
                heavy, heavy_nll = evaluate(heavy_items)
                light_first, lf_nll = evaluate(band_items(hi=h2, max_rank=0, evict=copts.evict))
                r = _pair(lf_nll, heavy_nll, copts)
                dumps += [("matched:heavy", heavy_nll), ("matched:light-first", lf_nll)]
    except HarnessError as e:
        notes.append(f"rank against weight not run: {e}")
    notes += list(runs.results.warnings) + runs.notes
    return MatchedResult(where, rule, h1, tuple(steps1), lightest, q, heavy, h2, tuple(steps2), light_first, r,
                         tuple(notes), tuple(dumps))


def matched_part(opts: StudyOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
                 env: Environment | None = None) -> tuple[MatchedResult | None, str]:
    """The matched runs on the study's model, text and residency; (None, why) when skipped or failed."""
    from harness.parsers.gguf_model import read_model_info
    from harness.tools.runners import ToolRunner

    if not opts.matched:
        return None, "not run (--no-matched)"
    assert opts.model is not None
    try:
        return run_matched(opts, runner or ToolRunner(), read_model_info(opts.model), env=env,
                           progress=progress), ""
    except HarnessError as e:
        return None, f"not run: {e}"
