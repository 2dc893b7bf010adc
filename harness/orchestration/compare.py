"""`harness compare`: stock llama.cpp against the patched build with the expert cache, under one budget.

Plans the runs from GGUF metadata (harness.orchestration.planner), runs them through an injected `Runner`
(harness.orchestration.executor: interleaved, resumable), summarises them (harness.orchestration.summary:
paired delta-PPL% of each policy against the full model from per-token NLL dumps, with a block-bootstrap CI
over chunks; tokens/s with CIs; the budget verdict) and writes report.md (harness.report.markdown).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.records import ResultsFile, prepare_out_dir
from harness.domain.catalogue import STOCK, check_policies
from harness.domain.options import CompareOptions
from harness.domain.plan import ComparePlan
from harness.domain.results import CompareResult, EstimateRow
from harness.orchestration.executor import Environment, Progress, execute_runs, no_progress
from harness.orchestration.planner import model_of, plan_compare, plan_runs
from harness.orchestration.serialise import (
    COMPARE_OPTION_KEYS,
    compare_fingerprint,
    compare_options_from_json,
    options_json,
    read_meta,
)
from harness.orchestration.summary import estimate_speeds, load_nlls, summarize_quality, summarize_speed, verify_budget
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.tools.runners import Runner

NO_GPU_NOTE = "no GPU found: the CPU build runs; speed figures are labelled 'CPU build'"


def run_compare(opts: CompareOptions, runner: Runner, info: ModelInfo, *, env: Environment | None = None,
                progress: Progress = no_progress) -> CompareResult:
    """Plan, run what is not recorded yet, summarise. Ctrl-C stops after the records that finished are
    written; the result then has `interrupted=True` and summarises what there is."""
    env = env or Environment()
    check_policies(opts.policies)
    if opts.runs < 1:
        raise HarnessError("--runs must be at least 1")
    if opts.quality and opts.text is not None and not opts.text.is_file():
        raise HarnessError(f"cannot read the text {opts.text}: no such file")
    builds = env.builds()
    gpu = env.gpu()
    backend = ",".join(sorted({b.backend for b in builds.values()}))
    plan = plan_compare(info, opts.vram, reserve_bytes=opts.reserve_bytes,
                        host_available_bytes=env.host_available_bytes())
    prov = env.provenance(builds, opts.argv, gpu)
    fp = compare_fingerprint(opts, plan, dict(prov.binaries))
    notes = list(plan.notes)
    if gpu == "none":
        notes.append(NO_GPU_NOTE)

    results = ResultsFile(opts.out / "results.jsonl")
    outcome = execute_runs(plan_runs(opts, plan), runner, builds, prov, fp, results, progress,
                           meta={"command": "compare", "options": options_json(opts, COMPARE_OPTION_KEYS)})
    notes.extend(outcome.notes)
    n_run, n_resumed, interrupted = outcome.n_run, outcome.n_resumed, outcome.interrupted

    return summarize_compare(opts, plan, results, runner.load_nll, gpu, backend, notes, n_run, n_resumed,
                             interrupted)


def summarize_compare(opts: CompareOptions, plan: ComparePlan, results: ResultsFile,
                      load_nll: Callable[[Path], NllDump], gpu: str, backend: str, notes: Sequence[str],
                      n_run: int = 0, n_resumed: int = 0, interrupted: bool = False) -> CompareResult:
    """Every statistic of a comparison, from its records (after a run, or re-rendering later)."""
    records = [r for r in results.read() if r.get("kind") in ("ppl", "bench")]
    warnings = list(results.warnings)
    nll, nll_warnings = load_nlls(records, load_nll)
    warnings.extend(nll_warnings)
    quality, qwarn = summarize_quality(records, nll, opts.policies, n_boot=opts.n_boot, seed=opts.seed)
    warnings.extend(qwarn)
    speed = summarize_speed(records, [STOCK, *opts.policies], n_boot=opts.n_boot, seed=opts.seed)
    budget = verify_budget(((r["key"], r["config"], r.get("peak_device_mib"), r.get("peak_source", ""))
                            for r in records),
                           plan.budget_bytes, gpu != "none")
    if interrupted:
        warnings.append(f"interrupted: {n_run} new runs recorded in {results.path}; run the same command again "
                        "to resume")
    estimates: tuple[EstimateRow, ...] = ()
    if gpu == "none" and opts.profile:
        estimates = estimate_speeds(plan, quality, opts.profile)
    return CompareResult(plan, opts, gpu, backend, tuple(notes), speed, quality, budget, results.path,
                         n_run, n_resumed, interrupted, tuple(warnings), estimates,
                         (opts.profile or "") if estimates else "")


def reload_compare(out: Path, *, model: Path | None = None) -> CompareResult:
    """A comparison re-read from its results folder (for `harness report`); nothing is run. The model file
    is read again for the plan (`model` overrides a moved one)."""
    from harness.parsers.gguf_model import read_model_info
    from harness.parsers.nll_dump import read_nll_dump_file

    results = ResultsFile(out / "results.jsonl")
    meta = read_meta(results, "compare")
    opts = compare_options_from_json(meta["options"], out, model)
    info = read_model_info(model_of(opts))
    plan = plan_compare(info, opts.vram, reserve_bytes=opts.reserve_bytes)
    prov = meta["provenance"]
    gpu = str(prov.get("gpu", "none"))
    notes = list(plan.notes)
    if gpu == "none":
        notes.append(NO_GPU_NOTE)
    runs = [r for r in results.read() if r.get("kind") == "bench"]
    if opts.speed and runs and not any(r.get("build") == "patched" for r in runs):
        notes.append("no speed runs of the patched build were recorded (no engine mode in that build)")
    return summarize_compare(opts, plan, results, read_nll_dump_file, gpu, str(prov.get("backend", "")), notes)


DEFAULT_TEXT = Path("eval/data/heldout.txt")


def default_model(root: Path | None = None) -> Path:
    """The project's trained model: the one .gguf under models/ (README)."""
    base = (root or project.project_root()) / "models"
    found = sorted(base.glob("*.gguf")) if base.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise HarnessError(f"no default model: {base} holds no .gguf (the project's trained model); pass --model "
                           "FILE (for a quick try, make one with `harness synth -o m.gguf`)")
    raise HarnessError(f"{base} holds several models ({', '.join(p.name for p in found)}): pass --model FILE")


def resolve_text(text: Path | None, dataset: str | None, root: Path | None = None) -> Path:
    """--text FILE, or --dataset NAME (fetched once and cached, see harness.tools.datasets), or the held-out text."""
    if text is not None and dataset is not None:
        raise HarnessError("pass either --text or --dataset, not both")
    if dataset is not None:
        from harness.tools.datasets import dataset_text

        return dataset_text(dataset)
    path = text if text is not None else (root or project.project_root()) / DEFAULT_TEXT
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as e:
        raise HarnessError(f"cannot read the text {path}: {e.strerror}") from None
    return path


def compare(opts: CompareOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
            env: Environment | None = None) -> CompareResult:
    """`harness compare`: read the model, run (or resume) the comparison, write report.md next to
    results.jsonl. `opts.model` and `opts.text` may be None for the defaults."""
    from dataclasses import replace

    from harness.parsers.gguf_model import read_model_info
    from harness.report.markdown import render_compare_markdown
    from harness.tools.runners import ToolRunner

    prepare_out_dir(opts.out)
    model = opts.model or default_model()
    text = resolve_text(opts.text, opts.dataset) if opts.quality else None
    opts = replace(opts, model=model, text=text)
    info = read_model_info(model)
    result = run_compare(opts, runner or ToolRunner(), info, env=env, progress=progress)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.md").write_text(render_compare_markdown(result))
    return result
