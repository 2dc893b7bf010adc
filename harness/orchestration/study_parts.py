"""The parts of `harness study` that test finding 3 (Experiment B, harness composition) and the generation test
(harness generate), each in its own resumable folder under the study's --out: `composition/`, `generation/`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.core import project
from harness.core.errors import HarnessError
from harness.domain.composition import FINDING3, CompositionOptions, CompositionResult
from harness.domain.finding import Verdict
from harness.domain.generation import GenerateOptions, GenerationResult
from harness.domain.options import StudyOptions
from harness.orchestration.executor import Environment, Progress, no_progress
from harness.tools.requests import Runner

HELDOUT_DOCS = Path("eval/data/heldout-docs.txt")  # calibration apart from the whole of heldout.txt


def composition_part(opts: StudyOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
                     env: Environment | None = None) -> tuple[CompositionResult | None, str]:
    """Experiment B on the study's model, text and residency; (None, why) when it was skipped or failed. Its
    calibration: --calib-text, or heldout-docs.txt when the whole text is evaluated (chunks None), else the slice of
    the text past the evaluation chunks."""
    from harness.orchestration.composition import composition

    if not opts.composition:
        return None, "not run (--no-composition)"
    try:
        calib = opts.calib_text or (project.project_root() / HELDOUT_DOCS if opts.chunks is None else None)
        copts = CompositionOptions(out=opts.out / "composition", model=opts.model, text=opts.text,
                                   residency=opts.residency, n_ctx=opts.n_ctx, chunks=opts.chunks,
                                   threads=opts.threads, seed=opts.seed, argv=opts.argv, warm_from=opts.warm_from)
        if calib is not None:
            copts = replace(copts, calib_text=calib, calib_offset=0)
        return composition(copts, progress, runner=runner, env=env), ""
    except HarnessError as e:
        return None, f"not run: {e}"


def generation_part(opts: StudyOptions, progress: Progress = no_progress, *,
                    env: Environment | None = None) -> tuple[GenerationResult | None, str]:
    """The generation test on the study's model and residency (the bundled prompts); (None, why) when skipped."""
    from harness.orchestration.generation import generation

    if not opts.generation:
        return None, "not run (--no-generation)"
    try:
        return generation(GenerateOptions(out=opts.out / "generation", model=opts.model, residency=opts.residency,
                                          threads=opts.threads, seed=opts.seed, argv=opts.argv), progress,
                          env=env), ""
    except HarnessError as e:
        return None, f"not run: {e}"


def finding3(result: CompositionResult | None, note: str) -> Verdict:
    """Finding 3's verdict: Experiment B's decision rule (harness.domain.composition.finding3_verdict)."""
    return result.verdict if result is not None else Verdict(FINDING3, None, note)
