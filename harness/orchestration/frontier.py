"""`harness frontier`: every family's knobs (catalogue.FRONTIER_FAMILIES: ours, fetch-all with each eviction, the
anchors' rules, upstream's CPU share, combinations) over a grid, side by side at the same residencies on the same
tokens, in emulate mode.

Per point: delta-PPL with its paired 95% CI against the full model (the sweep's machinery: one llama-perplexity run
with an NLL dump and the cache statistics per point, resumable results.jsonl), the bytes moved per token
(synchronous fetches and background admissions, each times the bytes of one expert; host computes move none),
the hit rate, and the decode time per token that the cost model estimates from the counters (fetches,
admissions, host computes) on a hardware profile: an estimate, not a measurement. Then per residency: the Pareto
frontier of delta-PPL against estimated time (and against bytes moved), whether the presets are on it (and which
points dominate them, with the paired delta against the preset), and the table "at <= +0.5% and <= +1% delta-PPL,
the fewest bytes per token each family reaches".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.core.records import ResultsFile, prepare_out_dir
from harness.core.sizes import Size
from harness.domain.catalogue import FRONTIER_BOUNDS, FRONTIER_FAMILIES, FRONTIER_PRESETS, FULL
from harness.domain.costmodel import cache_work, estimate, load_profile
from harness.domain.options import FrontierGrid, FrontierOptions
from harness.domain.plan import SweepPoint, plan_slots, slots_for_residency
from harness.domain.results import BoundCell, FrontierResult, FrontierRow, PresetCheck
from harness.orchestration.executor import Environment, Progress, execute_runs, no_progress
from harness.orchestration.serialise import (
    FRONTIER_GRID_KEYS,
    FRONTIER_OPTION_KEYS,
    frontier_fingerprint,
    frontier_options_from_json,
    options_json,
)
from harness.orchestration.summary import load_nlls, summarize_quality
from harness.orchestration.sweep import sweep_runs
from harness.orchestration.warmstart import warm_start
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.stats.frontier import pareto_front
from harness.stats.intervals import paired_delta_ppl
from harness.tools.requests import Runner

EVICTS = ("lfu", "lru", "classlru")
RENORMS = ("off", "on")


def _in(key: str, values: Sequence[float], low: float, high: float, what: str) -> None:
    for v in values:
        if not low <= v <= high:
            raise HarnessError(f"frontier grid: {key}={v:g} is outside the accepted range [{low:g}, {high:g}] "
                               f"({what})")


def _one_of(key: str, values: Sequence[str], accepted: Sequence[str]) -> None:
    for v in values:
        if v not in accepted:
            raise HarnessError(f"frontier grid: {key}={v!r} is not accepted: use {', '.join(accepted)}")


def check_grid(grid: FrontierGrid, info: ModelInfo) -> None:
    """Every value of the grid in the range the policy accepts for this model (k experts used per token, n per
    layer); the first one outside is a one-line error naming the key and the accepted range."""
    k, n = info.n_expert_used, info.n_expert
    unknown = [f for f in grid.families if f not in FRONTIER_FAMILIES]
    if unknown:
        raise HarnessError(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}: use "
                           f"{', '.join(FRONTIER_FAMILIES)}")
    if not grid.families:
        raise HarnessError("frontier grid: no families")
    if not grid.fractions:
        raise HarnessError("frontier grid: no residencies")
    for f in grid.fractions:
        if not 0 < f <= 1:
            raise HarnessError(f"frontier grid: residency {f * 100:g}% is outside the accepted range (0, 100]%")
    _in("tau", grid.taus, 0, 1, "the threshold rule's gate weight")
    for a in grid.admits:
        if a not in ("off", "on"):
            try:
                if not float(a) > 0:
                    raise ValueError
            except ValueError:
                raise HarnessError(f"frontier grid: admit={a!r} is not accepted: use off, on, or a beta > 0") from None
    _one_of("evict", grid.evicts, EVICTS)
    _in("j", grid.j, 0, k, f"ranks always computed: at most k = {k}, the experts used per token")
    for m in grid.m:
        window_of(m, k, n)
    _in("alpha", grid.alpha, 0, 1, "a substitute's weight scale")
    _in("zero tau", grid.zero_taus, 0, 1, "the zero rule's gate weight")
    _one_of("renorm", grid.renorms, RENORMS)
    _in("kmin", grid.kmins, 1, k, f"ranks always run: at least 1, at most k = {k}")
    _in("t", grid.ts, 0, 1, "a ratio to the first choice's gate weight")


def window_of(m: str, k: int, n: int) -> str:
    """cache-route's m as the spec takes it: `auto` (2k), a number of router ranks, or `<x>k` (x times k, for grids
    that fit models of any k); a one-line error outside [k, n]."""
    if m == "auto":
        return m
    try:
        mv = int(m[:-1]) * k if m.endswith("k") else int(m)
    except ValueError:
        raise HarnessError(f"frontier grid: m={m!r} is not accepted: a window of router ranks in [{k}, {n}] "
                           "(k, the experts per layer), a multiple of k such as 4k, or auto") from None
    _in("m", [mv], k, n, f"a window of router ranks: at least k = {k}, at most the {n} experts per layer")
    return str(mv)


def slots_of(fraction: float, info: ModelInfo) -> int:
    """Slots per layer of a residency: slots_for_residency (rounded as the engine), at least k (as the sweep's)."""
    return slots_for_residency(fraction, info.n_expert, info.n_expert_used)


def _family_points(family: str, g: FrontierGrid, fraction: float, slots: int, info: ModelInfo) -> list[SweepPoint]:
    s = f"slots={slots}"

    def pt(name: str, rule: str, tau: float | None, admit: str, evict: str,
           params: tuple[tuple[str, str], ...] = (), preset: str | None = None) -> SweepPoint:
        return SweepPoint(f"{name} {s}", rule, tau, admit, evict, fraction, slots, family, preset, params)

    out: list[SweepPoint] = []
    if family == "ours":
        out += [pt("quality", "threshold", 0.15, "0.5", "lfu", preset="quality"),
                pt("speed", "first-choice", None, "0.5", "lfu", preset="speed")]
        for tau in g.taus:
            for a in g.admits:
                if not (tau == 0.15 and a == "0.5"):  # the quality preset
                    out.append(pt(f"threshold tau={tau:g} admit={a} evict=lfu", "threshold", tau, a, "lfu"))
        out += [pt(f"first-choice admit={a} evict=lfu", "first-choice", None, a, "lfu")
                for a in g.admits if a != "0.5"]  # first-choice + admission 0.5 is the speed preset
    elif family == "fetch-all":
        out += [pt(f"fetch-all evict={e}", "fetch-all", None, "off", e) for e in g.evicts]
    elif family == "cache-route":
        out += [pt(f"cache-route j={j} m={m} alpha={a:g} admit=off evict=lfu", "cache-route", None, "off", "lfu",
                   (("j", str(j)), ("m", m), ("alpha", f"{a:g}")))
                for j in g.j for m in dict.fromkeys(window_of(x, info.n_expert_used, info.n_expert) for x in g.m)
                for a in g.alpha]
    elif family == "zero":
        out += [pt(f"zero tau={t:g} renorm={r} admit=off evict=lfu", "zero", t, "off", "lfu", (("renorm", r),))
                for t in g.zero_taus for r in g.renorms]
    elif family == "ser":
        out += [pt(f"ser kmin={km} t={t:g} renorm={r} admit=off evict=lfu", "ser", None, "off", "lfu",
                   (("kmin", str(km)), ("t", f"{t:g}"), ("renorm", r)))
                for km in g.kmins for t in g.ts for r in g.renorms]
    elif family == "host":
        out += [pt("first-choice light=host admit=off evict=classlru", "first-choice", None, "off", "classlru",
                   (("light", "host"),)),
                pt("threshold tau=0.15 light=host admit=off evict=classlru", "threshold", 0.15, "off", "classlru",
                   (("light", "host"),)),
                pt("substitute-all light=host admit=off evict=classlru", "substitute-all", None, "off", "classlru",
                   (("light", "host"),))]
    elif family == "combos":
        out += [pt("cache-route j=1 m=auto alpha=1 admit=0.5 evict=lfu", "cache-route", None, "0.5", "lfu",
                   (("j", "1"), ("m", "auto"), ("alpha", "1"))),
                pt("threshold tau=0.15 admit=0.5 evict=classlru", "threshold", 0.15, "0.5", "classlru"),
                pt("threshold tau=0.15 light=host admit=off evict=lfu", "threshold", 0.15, "off", "lfu",
                   (("light", "host"),))]
    return out


def frontier_points(grid: FrontierGrid, info: ModelInfo) -> list[SweepPoint]:
    """The grid's points, per residency and family in the catalogue's order (the grid checked first)."""
    check_grid(grid, info)
    points: dict[str, SweepPoint] = {}
    for fraction in grid.fractions:
        slots = slots_of(fraction, info)
        for family in FRONTIER_FAMILIES:
            if family in grid.families:
                for p in _family_points(family, grid, fraction, slots, info):
                    points.setdefault(p.name, p)  # two residencies with the same slots: one run
    if not points:
        raise HarnessError("the frontier grid is empty")
    return list(points.values())


# ---- the summary: pure functions of the rows ---------------------------------------------------------------

def fronts(rows: Sequence[FrontierRow], x: Callable[[FrontierRow], float | None]) -> dict[float, tuple[str, ...]]:
    """Per residency, the names on the Pareto frontier of (x, delta-PPL%), both minimised."""
    out: dict[float, tuple[str, ...]] = {}
    for f in sorted({r.point.fraction for r in rows}, reverse=True):
        pts = [(r.point.name, float(xv), r.delta.delta_pct) for r in rows
               if r.point.fraction == f and r.delta is not None and (xv := x(r)) is not None]
        out[f] = pareto_front(pts)
    return out


def bound_table(rows: Sequence[FrontierRow], families: Sequence[str], fractions: Sequence[float],
                bounds: Sequence[float] = FRONTIER_BOUNDS) -> tuple[BoundCell, ...]:
    """Per residency, family and bound: the row with the fewest bytes moved per token (synchronous + background)
    among those whose delta-PPL point estimate is <= bound (ties: the lower estimated time, then the name);
    None when no row of the family meets the bound."""
    cells: list[BoundCell] = []
    for f in fractions:
        for fam in families:
            for b in bounds:
                ok = [r for r in rows if r.point.fraction == f and r.point.family == fam and r.delta is not None
                      and r.bytes_moved is not None and r.delta.delta_pct <= b]
                best = min(ok, key=lambda r: (r.bytes_moved or 0.0, r.est_ms_per_token if r.est_ms_per_token
                                              is not None else float("inf"), r.point.name), default=None)
                cells.append(BoundCell(fam, f, b, best))
    return tuple(cells)


def dominators(rows: Sequence[FrontierRow], row: FrontierRow) -> list[FrontierRow]:
    """The rows at the same residency that are no worse in estimated time and delta-PPL and better in one,
    fastest first."""
    if row.delta is None or row.est_ms_per_token is None:
        return []
    t, d = row.est_ms_per_token, row.delta.delta_pct
    out = [r for r in rows if r.point.fraction == row.point.fraction and r is not row and r.delta is not None
           and r.est_ms_per_token is not None and r.est_ms_per_token <= t and r.delta.delta_pct <= d
           and (r.est_ms_per_token < t or r.delta.delta_pct < d)]
    return sorted(out, key=lambda r: (r.est_ms_per_token or 0.0, r.point.name))


def preset_checks(rows: Sequence[FrontierRow], frontier: dict[float, tuple[str, ...]],
                  fractions: Sequence[float], presets: Sequence[str] = FRONTIER_PRESETS) -> tuple[PresetCheck, ...]:
    out: list[PresetCheck] = []
    for f in fractions:
        for preset in presets:
            row = next((r for r in rows if r.point.preset == preset and r.point.fraction == f), None)
            if row is None:
                out.append(PresetCheck(preset, f, "", False, ()))
                continue
            doms = tuple(r.point.name for r in dominators(rows, row))
            out.append(PresetCheck(preset, f, row.point.name, row.point.name in frontier.get(f, ()), doms))
    return tuple(out)


def frontier_rows(points: Sequence[SweepPoint], quality: Sequence[Any], info: ModelInfo,
                  profile_name: str) -> list[FrontierRow]:
    """The rows of the points that ran: bytes per token from the counters, the cost model's estimate."""
    profile = load_profile(profile_name)
    by_name = {q.config: q for q in quality}
    bpe = info.bytes_per_expert
    rows: list[FrontierRow] = []
    for p in points:
        q = by_name.get(p.name)
        if q is None:
            continue
        c = q.cache
        sync = bg = host = est = None
        if c is not None and c.fetches_per_token is not None and c.tokens:
            adm = (c.admissions or 0) / c.tokens
            host = c.host_computes_per_token()
            sync, bg = c.fetches_per_token * bpe, adm * bpe
            est = estimate(profile, cache_work(info, c.fetches_per_token, admissions_per_token=adm,
                                               host_computes_per_token=host)).ms_per_token
        rows.append(FrontierRow(p, q.ppl, q.delta, c.hit_rate if c else None, c.substitution_rate if c else None,
                                c.substituted_mass if c else None, c.fetches_per_token if c else None, sync, bg,
                                host, est))
    return rows


def summarize_frontier(opts: FrontierOptions, info: ModelInfo, points: Sequence[SweepPoint], results: ResultsFile,
                       load_nll: Callable[[Path], NllDump], notes: list[str], n_run: int = 0, n_resumed: int = 0,
                       interrupted: bool = False) -> FrontierResult:
    records = [r for r in results.read() if r.get("kind") == "ppl"]
    warnings = list(results.warnings) + notes
    nll, nll_warnings = load_nlls(records, load_nll)
    warnings += nll_warnings
    quality, qwarn = summarize_quality(records, nll, [p.name for p in points], n_boot=opts.n_boot, seed=opts.seed)
    warnings += qwarn
    rows = frontier_rows(points, quality, info, opts.profile)
    # a point shared by two residencies (the same slots) is listed under each
    fractions = opts.grid.fractions
    shared = [replace(r, point=replace(r.point, fraction=f)) for f in fractions for r in rows
              if r.point.fraction != f and r.point.slots == slots_of(f, info)]
    rows += shared
    time_front = fronts(rows, lambda r: r.est_ms_per_token)
    bytes_front = fronts(rows, lambda r: r.bytes_moved)
    checks = preset_checks(rows, time_front, fractions)
    checks = tuple(_with_pairs(c, nll, opts.seed) for c in checks)
    full = next((q for q in quality if q.config == FULL), None)
    if interrupted:
        warnings.append(f"interrupted: {n_run} new runs recorded in {results.path}; run the same command "
                        "again to resume")
    return FrontierResult(opts, full.ppl if full else None, info.bytes_per_expert, tuple(rows), time_front,
                          bytes_front, bound_table(rows, [f for f in FRONTIER_FAMILIES if f in opts.grid.families],
                                                   fractions), checks, results.path, n_run, n_resumed, interrupted,
                          tuple(warnings))


def _with_pairs(c: PresetCheck, nll: dict[str, NllDump], seed: int) -> PresetCheck:
    """The dominators' names with their paired delta-PPL against the preset on the same tokens (a dominator whose
    CI straddles 0 is not better in quality beyond noise)."""
    base = nll.get(c.name)
    if base is None or not c.dominated_by:
        return c
    named: list[str] = []
    for name in c.dominated_by:
        other = nll.get(name)
        if other is not None and other.nll.shape == base.nll.shape:
            d = paired_delta_ppl(base.nll, other.nll, base.chunk, seed=seed)
            named.append(f"{name} ({d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}] vs {c.preset})")
        else:
            named.append(name)
    return replace(c, dominated_by=tuple(named))


# ---- running -----------------------------------------------------------------------------------------------

def _resolved(opts: FrontierOptions) -> tuple[Path, Path]:
    if opts.model is None or opts.text is None:
        raise HarnessError("no model or text given")  # frontier() fills in the defaults
    return opts.model, opts.text


def run_frontier(opts: FrontierOptions, runner: Runner, info: ModelInfo, *, env: Environment | None = None,
                 progress: Progress = no_progress) -> FrontierResult:
    env = env or Environment()
    model, text = _resolved(opts)
    if not text.is_file():
        raise HarnessError(f"cannot read the text {opts.text}: no such file")
    points = frontier_points(opts.grid, info)
    plan_slots(info, Size(fraction=min(opts.grid.fractions)))  # the same "too small" checks as compare
    builds = env.builds()
    prov = env.provenance(builds, opts.argv, env.gpu())
    opts = warm_start(opts, model, text, opts.out / "warm", runner, builds["patched"], info.n_expert,
                      info.n_moe_layers)
    fp = frontier_fingerprint(model, text, opts, dict(prov.binaries))
    results = ResultsFile(opts.out / "results.jsonl")
    meta: dict[str, Any] = {"command": "frontier", "options": options_json(opts, FRONTIER_OPTION_KEYS),
                            "grid": options_json(opts.grid, FRONTIER_GRID_KEYS)}
    outcome = execute_runs(sweep_runs(opts, points), runner, builds, prov, fp, results, progress, meta=meta)
    return summarize_frontier(opts, info, points, results, runner.load_nll, list(outcome.notes), outcome.n_run,
                              outcome.n_resumed, outcome.interrupted)


def reload_frontier(out: Path, *, model: Path | None = None) -> FrontierResult:
    """A frontier re-read from its results folder (for `harness report`); nothing is run."""
    from harness.orchestration.serialise import read_meta
    from harness.parsers.gguf_model import read_model_info
    from harness.parsers.nll_dump import read_nll_dump_file

    results = ResultsFile(out / "results.jsonl")
    meta = read_meta(results, "frontier")
    opts = frontier_options_from_json(meta["options"], meta["grid"], out, model)
    m, _ = _resolved(opts)
    info = read_model_info(m)
    return summarize_frontier(opts, info, frontier_points(opts.grid, info), results, read_nll_dump_file, [])


def frontier(opts: FrontierOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
             env: Environment | None = None) -> FrontierResult:
    """`harness frontier`: resolve the default model and text, run (or resume) the grid, write report.md."""
    from harness.orchestration.compare import default_model, resolve_text
    from harness.parsers.gguf_model import read_model_info
    from harness.report.markdown import render_frontier_markdown
    from harness.tools.runners import ToolRunner

    prepare_out_dir(opts.out)
    opts = replace(opts, model=opts.model or default_model(), text=resolve_text(opts.text, None))
    model, _ = _resolved(opts)
    result = run_frontier(opts, runner or ToolRunner(), read_model_info(model), env=env, progress=progress)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.md").write_text(render_frontier_markdown(result))
    return result
