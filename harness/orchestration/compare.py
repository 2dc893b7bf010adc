"""`harness compare`: stock llama.cpp against the patched build with the expert cache, under one budget.

Plans the runs from GGUF metadata (harness.orchestration.planner), runs them through an injected `Runner`
(harness.orchestration.executor: interleaved, resumable), summarises them (harness.orchestration.summary:
paired delta-PPL% of each policy against the full model from per-token NLL dumps, with a block-bootstrap CI
over chunks; tokens/s with CIs; the budget verdict) and writes report.md (harness.report.markdown).

`--ram SIZE` instead of a device budget: every run inside one memory cgroup of SIZE (harness.tools.cgroup, page
cache counted), stock with mmap and --repack 0, the patched build's engine reading missed experts from the model
file (host=file) with the slots that the engine's ram=SIZE formula gives, which the quality runs get too; the verdict
is each run's peak in the cgroup against the limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.files import refuse_special, require_utf8_text
from harness.core.records import ResultsFile, prepare_out_dir
from harness.domain.catalogue import STOCK, check_policies
from harness.domain.options import CompareOptions
from harness.domain.plan import ComparePlan
from harness.domain.results import CompareResult, EstimateRow
from harness.orchestration.executor import Environment, Progress, execute_runs, no_progress
from harness.orchestration.planner import model_of, plan_compare, plan_compare_ram, plan_runs, ram_context
from harness.orchestration.serialise import (
    COMPARE_OPTION_KEYS,
    compare_fingerprint,
    compare_options_from_json,
    options_json,
    read_meta,
)
from harness.orchestration.summary import (
    engine_slot_warnings,
    estimate_speeds,
    load_nlls,
    summarize_quality,
    summarize_speed,
    verify_budget,
    verify_ram,
)
from harness.orchestration.warmstart import warm_start
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.report.tables import plan_lines
from harness.tools.cgroup import check_ram_limit
from harness.tools.requests import Runner

Announce = Callable[[Sequence[str]], None]  # receives the plan's lines before the first run
NO_GPU_NOTE = "no GPU found: the CPU build runs; speed figures are labelled 'CPU build'"
LAVAPIPE_NOTE = ("the device is Mesa's lavapipe (Vulkan on the CPU): the budget is a real device's memory, but its "
                 "speed figures are not a goal (a CPU running a GPU's program; nothing to learn about GPU speeds)")


def check_ram_options(opts: CompareOptions, available: int) -> int:
    """The --ram limit in bytes, after the checks of the options that go with it (one line each)."""
    assert opts.ram is not None
    if opts.vram is not None:
        raise HarnessError("pass either --vram (a device budget) or --ram (a RAM limit for the whole process), "
                           "not both")
    if opts.ram.bytes is None:
        raise HarnessError(f"--ram must be an absolute size (like 8G or 1600M), not {opts.ram}")
    if opts.speed and opts.bench_cache_mode != "engine":
        raise HarnessError(f"--ram runs the patched build with mode=engine,host=file: --speed-mode "
                           f"{opts.bench_cache_mode} cannot read experts from the file")
    check_ram_limit(opts.ram.bytes, available)
    return opts.ram.bytes


def plan_of(opts: CompareOptions, info: ModelInfo, host_available_bytes: int | None = None) -> ComparePlan:
    """The plan of a comparison: under --ram (plan_compare_ram) or a device budget (plan_compare)."""
    if opts.ram is not None and opts.ram.bytes is not None:
        return plan_compare_ram(info, opts.ram.bytes, reserve_bytes=opts.reserve_bytes, n_ctx=ram_context(opts),
                                quality=opts.quality)
    return plan_compare(info, opts.vram, reserve_bytes=opts.reserve_bytes, host_available_bytes=host_available_bytes)


def run_compare(opts: CompareOptions, runner: Runner, info: ModelInfo, *, env: Environment | None = None,
                progress: Progress = no_progress, announce: Announce | None = None) -> CompareResult:
    """Plan, run what is not recorded yet, summarise. Ctrl-C stops after the records that finished are
    written; the result then has `interrupted=True` and summarises what there is. `announce` gets the plan's
    lines before the first run. With --ram every run is made inside one memory cgroup of that limit, removed
    at the end (also on Ctrl-C)."""
    env = env or Environment()
    check_policies(opts.policies)
    if opts.runs < 1:
        raise HarnessError("--runs must be at least 1")
    if opts.threads is not None and opts.threads < 1:
        raise HarnessError(f"--threads must be at least 1, not {opts.threads}")
    if opts.quality and opts.text is not None and not opts.text.is_file():
        raise HarnessError(f"cannot read the text {opts.text}: no such file")
    limit = check_ram_options(opts, env.host_available_bytes()) if opts.ram is not None else None
    builds = env.builds()
    gpu = env.gpu()
    backend = ",".join(sorted({b.backend for b in builds.values()}))
    plan = plan_of(opts, info, env.host_available_bytes())
    prov = env.provenance(builds, opts.argv, gpu)
    opts = warm_start(opts, model_of(opts), opts.text if opts.quality else None, opts.out / "warm", runner,
                      builds["patched"], info.n_expert, info.n_moe_layers)
    fp = compare_fingerprint(opts, plan, dict(prov.binaries))
    notes = list(plan.notes)
    if opts.threads is None:
        # fingerprinted as the default (so that a resumed run matches); each record's tool output names the count
        threads, why = env.default_threads()
        opts = replace(opts, threads=threads)
        threads_note = f"threads: {threads} per run, no more than the machine has free ({why}); --threads N to choose"
    else:
        threads_note = f"threads: {opts.threads} per run (--threads)"
    notes.append(threads_note)
    if gpu == "none" and plan.ram is None:
        notes.append(NO_GPU_NOTE)
    if "llvmpipe" in gpu:
        notes.append(LAVAPIPE_NOTE)
    if announce is not None:
        announce([*plan_lines(plan), *notes])

    results = ResultsFile(opts.out / "results.jsonl")
    meta = {"command": "compare", "options": options_json(opts, COMPARE_OPTION_KEYS), "threads_note": threads_note}
    if limit is not None:
        with env.memory_cgroup(limit) as cgroup:
            notes.extend(cgroup.cleaned)
            outcome = execute_runs(plan_runs(opts, plan, cgroup), runner, builds, prov, fp, results, progress,
                                   meta=meta)
    else:
        outcome = execute_runs(plan_runs(opts, plan), runner, builds, prov, fp, results, progress, meta=meta)
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
    if plan.ram is not None:
        budget = verify_ram(((r["key"], r["config"], r.get("peak_ram_bytes"), r.get("peak_ram_source", ""))
                             for r in records), plan.ram.limit)
        warnings.extend(engine_slot_warnings(records, plan.ram.slots_per_layer))
    else:
        budget = verify_budget(((r["key"], r["config"], r.get("peak_device_mib"), r.get("peak_source", ""))
                                for r in records),
                               plan.budget_bytes, gpu != "none")
    if interrupted:
        warnings.append(f"interrupted: {n_run} new runs recorded in {results.path}; run the same command again "
                        "to resume")
    estimates: tuple[EstimateRow, ...] = ()
    if gpu == "none" and opts.profile and plan.ram is None:
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
    plan = plan_of(opts, info)
    prov = meta["provenance"]
    gpu = str(prov.get("gpu", "none"))
    notes = list(plan.notes)
    if meta.get("threads_note"):
        notes.append(str(meta["threads_note"]))
    if gpu == "none" and plan.ram is None:
        notes.append(NO_GPU_NOTE)
    if "llvmpipe" in gpu:
        notes.append(LAVAPIPE_NOTE)
    runs = [r for r in results.read() if r.get("kind") == "bench"]
    if opts.speed and runs and not any(r.get("build") == "patched" for r in runs):
        notes.append("no speed runs of the patched build were recorded (no engine mode in that build)")
    return summarize_compare(opts, plan, results, read_nll_dump_file, gpu, str(prov.get("backend", "")), notes)


DEFAULT_TEXT = Path("eval/data/heldout.txt")


# with several models under models/, the default is localmoe: the study's routing shape (512 experts, top-10) in
# about the study's regime (a 25% cache hits about 0.89-0.91 of calls), `harness compare` on it in about a minute on
# 2 cores (issue 39). tinymoe (64 experts, perplexity ~400) is the quick one for mechanics: pass it by --model.
DEFAULT_MODEL_NAME = "localmoe-q8_0.gguf"


def default_model(root: Path | None = None) -> Path:
    """The project's trained model: the one .gguf under models/, or with several the default, DEFAULT_MODEL_NAME
    (docs/commands.md, harness compare)."""
    base = (root or project.project_root()) / "models"
    found = sorted(base.glob("*.gguf")) if base.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise HarnessError(f"no default model: {base} holds no .gguf (the project's trained model); pass --model "
                           "FILE (for a quick try, make one with `harness synth -o m.gguf`)")
    if base / DEFAULT_MODEL_NAME in found:
        return base / DEFAULT_MODEL_NAME
    raise HarnessError(f"{base} holds several models ({', '.join(p.name for p in found)}): pass --model FILE")


def resolve_text(text: Path | None, dataset: str | None, root: Path | None = None) -> Path:
    """--text FILE, or --dataset NAME (fetched once and cached, see harness.tools.datasets), or the held-out text."""
    if text is not None and dataset is not None:
        raise HarnessError("pass either --text or --dataset, not both")
    if dataset is not None:
        from harness.tools.datasets import dataset_text

        return dataset_text(dataset)
    path = text if text is not None else (root or project.project_root()) / DEFAULT_TEXT
    refuse_special(path, "the text")
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as e:
        raise HarnessError(f"cannot read the text {path}: {e.strerror}") from None
    require_utf8_text(path, "the text")
    return path


def compare(opts: CompareOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
            env: Environment | None = None, announce: Announce | None = None) -> CompareResult:
    """`harness compare`: read the model, run (or resume) the comparison, write report.md next to
    results.jsonl. `opts.model` and `opts.text` may be None for the defaults."""
    from harness.parsers.gguf_model import read_model_info
    from harness.report.markdown import render_compare_markdown
    from harness.tools.runners import ToolRunner

    prepare_out_dir(opts.out)
    model = opts.model or default_model()
    text = resolve_text(opts.text, opts.dataset) if opts.quality else None
    opts = replace(opts, model=model, text=text)
    info = read_model_info(model)
    result = run_compare(opts, runner or ToolRunner(), info, env=env, progress=progress, announce=announce)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.md").write_text(render_compare_markdown(result))
    return result
