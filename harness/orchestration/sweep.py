"""`harness sweep`: a grid of cache policies in emulate mode on the same tokens, the quality/speed frontier,
and the mass hypothesis.

Every grid point is one llama-perplexity run of the patched build in emulate mode (NLL dump and cache
statistics), paired against the full model (cache off) on the same tokens. Speed per point is the
fetches per token the engine would do, and the decode time per token the cost model estimates from them
(an estimate). The mass hypothesis (PAPER.md, finding 2): among policies that always fetch the first
choice (rules fetch-all, threshold, first-choice), higher substituted mass goes with a higher delta-PPL;
tested with Pearson r and a Fisher-z 95% CI across the grid points.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.core.records import ResultsFile, prepare_out_dir
from harness.core.sizes import Size
from harness.domain.catalogue import FIRST_CHOICE_FETCHING, FULL, RULES
from harness.domain.costmodel import cache_work, estimate, load_profile
from harness.domain.options import FrontierOptions, SweepGrid, SweepOptions
from harness.domain.plan import RunSpec, SweepPoint, plan_slots, slots_for_residency
from harness.domain.results import MassHypothesis, SweepResult, SweepRow
from harness.orchestration.executor import Environment, Progress, execute_runs, no_progress, safe_name
from harness.orchestration.serialise import (
    SWEEP_GRID_KEYS,
    SWEEP_OPTION_KEYS,
    options_json,
    sweep_fingerprint,
    sweep_options_from_json,
)
from harness.orchestration.summary import load_nlls, summarize_quality
from harness.orchestration.warmstart import warm_start
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.stats.frontier import pareto_front
from harness.stats.intervals import pearson_fisher
from harness.tools.requests import CacheSpec, PerplexityRequest, Placement, Runner


def grid_points(grid: SweepGrid, info: ModelInfo) -> list[SweepPoint]:
    """The grid's points in a fixed order. fetch-all never substitutes, so admission is moot there: one point
    per eviction and residency. Slots per layer: slots_for_residency (rounded as the engine), at least k."""
    bad = [r for r in grid.rules if r not in RULES]
    if bad:
        raise HarnessError(f"unknown rule {', '.join(bad)}: use {', '.join(RULES)}")
    for a in grid.admits:
        if a != "off":
            try:
                if float(a) <= 0:
                    raise ValueError
            except ValueError:
                raise HarnessError(f"admission must be 'off' or a beta > 0, got {a!r}") from None
    points: list[SweepPoint] = []
    for fraction in grid.fractions:
        if not 0 < fraction <= 1:
            raise HarnessError(f"a residency fraction must be in (0, 1], got {fraction}")
        slots = slots_for_residency(fraction, info.n_expert, info.n_expert_used)
        for evict in grid.evicts:
            for rule in grid.rules:
                taus: Sequence[float | None] = grid.taus if rule == "threshold" else (None,)
                admits = ("off",) if rule == "fetch-all" else grid.admits
                for tau in taus:
                    for admit in admits:
                        name = (f"{rule}" + (f" tau={tau:g}" if tau is not None else "")
                                + f" admit={admit} evict={evict} slots={slots}")
                        points.append(SweepPoint(name, rule, tau, admit, evict, fraction, slots))
    if not points:
        raise HarnessError("the sweep grid is empty")
    return points


def mass_hypothesis(rows: Sequence[SweepRow], *, level: float = 0.95) -> MassHypothesis:
    """Pearson r between substituted mass and delta-PPL% over the points whose rule always fetches the first
    choice, with a Fisher-z CI; None (with the reason) when there are fewer than 4 such points or no spread."""
    pts = [(r.substituted_mass, r.delta.delta_pct) for r in rows
           if r.point.rule in FIRST_CHOICE_FETCHING and r.delta is not None and r.substituted_mass is not None]
    if len(pts) < 4:
        return MassHypothesis(None, len(pts), f"{len(pts)} points with a first-choice-fetching rule: at least 4 "
                              "are needed (add taus or residencies to the grid)")
    xs = [float(p[0]) for p in pts]
    ys = [float(p[1]) for p in pts]
    try:
        return MassHypothesis(pearson_fisher(xs, ys, level), len(pts), "")
    except HarnessError as e:
        return MassHypothesis(None, len(pts), str(e))


def _resolved(opts: SweepOptions | FrontierOptions) -> tuple[Path, Path]:
    if opts.model is None or opts.text is None:
        raise HarnessError("no model or text given")  # sweep() fills in the defaults
    return opts.model, opts.text


def sweep_runs(opts: SweepOptions | FrontierOptions, points: Sequence[SweepPoint]) -> list[RunSpec]:
    """The full model, then every point: one llama-perplexity run each (NLL dump, statistics); also `frontier`'s."""
    model, text = _resolved(opts)
    placement = Placement(n_cpu_moe=999)  # quality only: every expert tensor stays in host memory

    def req(label: str, cache: CacheSpec) -> PerplexityRequest:
        return opts.perplexity_request(model, text, placement, cache=cache,
                                       nll_dump=opts.out / "nll" / f"{safe_name(label)}.bin", label=label)

    runs = [RunSpec("ppl:full", "ppl", "patched", FULL, None, ppl=req(FULL, CacheSpec("off")))]
    for p in points:
        stats = str(opts.out / "stats" / f"{safe_name(p.name)}.json")
        runs.append(RunSpec(f"ppl:{p.name}", "ppl", "patched", p.name, None, ppl=req(p.name, p.cache(stats))))
    return runs


def run_sweep(opts: SweepOptions, runner: Runner, info: ModelInfo, *, env: Environment | None = None,
              progress: Progress = no_progress) -> SweepResult:
    env = env or Environment()
    _, text = _resolved(opts)
    if not text.is_file():
        raise HarnessError(f"cannot read the text {opts.text}: no such file")
    points = grid_points(opts.grid, info)
    plan_slots(info, Size(fraction=min(p.fraction for p in points)))  # the same "too small" checks as compare
    builds = env.builds()
    gpu = env.gpu()
    prov = env.provenance(builds, opts.argv, gpu)
    model, _ = _resolved(opts)
    opts = warm_start(opts, model, text, opts.out / "warm", runner, builds["patched"], info.n_expert,
                      info.n_moe_layers)
    fp = sweep_fingerprint(model, text, opts, dict(prov.binaries))
    results = ResultsFile(opts.out / "results.jsonl")
    meta: dict[str, Any] = {"command": "sweep", "options": options_json(opts, SWEEP_OPTION_KEYS),
                            "grid": options_json(opts.grid, SWEEP_GRID_KEYS)}
    outcome = execute_runs(sweep_runs(opts, points), runner, builds, prov, fp, results, progress, meta=meta)
    return summarize_sweep(opts, info, points, results, runner.load_nll, list(outcome.notes), outcome.n_run,
                           outcome.n_resumed, outcome.interrupted)


def summarize_sweep(opts: SweepOptions, info: ModelInfo, points: Sequence[SweepPoint], results: ResultsFile,
                    load_nll: Callable[[Path], NllDump], notes: list[str], n_run: int = 0, n_resumed: int = 0,
                    interrupted: bool = False) -> SweepResult:
    records = [r for r in results.read() if r.get("kind") == "ppl"]
    warnings = list(results.warnings) + notes
    nll, nll_warnings = load_nlls(records, load_nll)
    warnings += nll_warnings
    names = [p.name for p in points]
    quality, qwarn = summarize_quality(records, nll, names, n_boot=opts.n_boot, seed=opts.seed)
    warnings += qwarn
    by_name = {q.config: q for q in quality}
    profile = load_profile(opts.profile)
    rows: list[SweepRow] = []
    for p in points:
        q = by_name.get(p.name)
        if q is None:
            continue
        c = q.cache
        est = None
        if c is not None and c.fetches_per_token is not None:
            adm = (c.admissions or 0) / c.tokens if c.tokens else 0.0
            est = estimate(profile, cache_work(info, c.fetches_per_token, admissions_per_token=adm,
                                               host_computes_per_token=c.host_computes_per_token())).ms_per_token
        rows.append(SweepRow(p, q.ppl, q.delta, c.substitution_rate if c else None,
                             c.substituted_mass if c else None, c.fetches_per_token if c else None, est))
    front = pareto_front([(r.point.name, r.est_ms_per_token, r.delta.delta_pct) for r in rows
                          if r.delta is not None and r.est_ms_per_token is not None])
    full = by_name.get(FULL)
    if interrupted:
        warnings.append(f"interrupted: {n_run} new runs recorded in {results.path}; run the same command "
                        "again to resume")
    return SweepResult(opts, full.ppl if full else None, tuple(rows), front, mass_hypothesis(rows), results.path,
                       n_run, n_resumed, interrupted, tuple(warnings))


def reload_sweep(out: Path, *, model: Path | None = None) -> SweepResult:
    """A sweep re-read from its results folder (for `harness report`); nothing is run."""
    from harness.orchestration.serialise import read_meta
    from harness.parsers.gguf_model import read_model_info
    from harness.parsers.nll_dump import read_nll_dump_file

    results = ResultsFile(out / "results.jsonl")
    meta = read_meta(results, "sweep")
    opts = sweep_options_from_json(meta["options"], meta["grid"], out, model)
    grid = opts.grid
    m, _ = _resolved(opts)
    info = read_model_info(m)
    return summarize_sweep(opts, info, grid_points(grid, info), results, read_nll_dump_file, [])


def sweep(opts: SweepOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
          env: Environment | None = None) -> SweepResult:
    """`harness sweep`: resolve the default model and text, run (or resume) the grid, write report.md."""
    from dataclasses import replace

    from harness.orchestration.compare import default_model, resolve_text
    from harness.parsers.gguf_model import read_model_info
    from harness.report.markdown import render_sweep_markdown
    from harness.tools.runners import ToolRunner

    prepare_out_dir(opts.out)
    opts = replace(opts, model=opts.model or default_model(), text=resolve_text(opts.text, None))
    model, _ = _resolved(opts)
    result = run_sweep(opts, runner or ToolRunner(), read_model_info(model), env=env, progress=progress)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.md").write_text(render_sweep_markdown(result))
    return result
