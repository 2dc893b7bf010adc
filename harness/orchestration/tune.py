"""`harness tune MODEL`: the fastest cache policy within a delta-PPL bound on this machine, written as the tuned
profile that `--moe-cache auto` reads (docs/expert-cache.md, "Tuned profile").

1. This machine, once: the model file's disk with the engine's read pattern (harness.tools.machine), a host memory
   copy, and the decode rate with every weight in memory (llama-bench, cache off: a discarded warm-up process, then
   SPEED_RUNS processes, their CV checked, measured again once when above 10%: `_speeds`); with the packaged base
   profile (`cpu-disk`) they make the cost model's profile (domain.tune.machine_profile), and at the two ends of the
   decode rate's 95% CI the span of every estimate (a faster rung within it that loses more is not taken).
2. One llama-perplexity run on the text in emulate mode with `policy=fetch-all` and every expert resident, writing
   the router trace (`trace=`, `trace_top` = n_expert: substitutes replay exactly) and the NLL dump: fetch-all never
   substitutes, so this run is the full model's (bit-identical to the cache off) and the reference of every paired
   delta.
3. llama-moe-sim replays the trace for every candidate of the grid (rule and tau, admission, eviction, prefetch, per
   residency); the cost model estimates each one's decode time (harness simulate's arithmetic: counters per decoded
   token, simulate.per_token; prefetches are background loads as admissions are).
4. The search (domain.tune): per rung its speed knobs (within 1% of its fastest estimate, the least loss), per chain
   the most aggressive rung within the bound by bisection, then the fastest estimate at or below the boundaries;
   every rung it leans on is run in emulate mode (NLL dump, paired block-bootstrap delta-PPL with a 95% CI, as
   compare and sweep do). The presets (quality, speed, fetch-all) are in the table too: quality and speed run in
   emulate mode; fetch-all, like the fetch-all rung, is the full model's output (it never substitutes), not run.
5. `--measure`: llama-bench with the engine (decode: a warm-up process each, then `--runs` processes interleaved,
   checked and measured again as the decode rate is) for the choice and the presets.
6. The profile: next to the model (`<model>.moe-tune.json`) where its folder is writable, else in the user's cache
   folder under the model's file name and fingerprint (domain.tune.profile_locations); `report.md`, `results.jsonl`
   (the runs, resumable) and `sim.jsonl` (every replay's counters) in `--out`.

Every speed but --measure's is an ESTIMATE of the cost model from counted work, and says so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.core.records import ResultsFile, prepare_out_dir, utc_now
from harness.domain.catalogue import BASELINE_POLICY, FULL
from harness.domain.costmodel import Profile, load_profile
from harness.domain.plan import RunSpec
from harness.domain.tune import (
    BOUND_ON,
    CHAINS,
    HOSTS,
    SPEED_RUNS,
    TUNE_PRESETS,
    Candidate,
    CheckRow,
    MachineFacts,
    ModelIdentity,
    OutOfSample,
    Rung,
    SimPoint,
    SpeedCheck,
    TuneChoice,
    TuneOptions,
    TuneProfile,
    TuneResult,
    best_per_rung,
    bisect_chain,
    chain_rungs,
    check_profile_model,
    compute_ms_span,
    cv_label,
    estimate_ms,
    machine_profile,
    parse_tune_profile,
    pick_fastest,
    profile_locations,
    profile_to_json,
    residency_label,
    stability_line,
    tune_cache_dir,
    tune_candidates,
    within_bound,
    within_bound_points,
)
from harness.orchestration.executor import Environment, Progress, execute_runs, no_progress, safe_name
from harness.orchestration.serialise import TUNE_OPTION_KEYS, options_json, tune_fingerprint
from harness.orchestration.simulate import SimRunner, check_trace_matches, per_token, sim_spec
from harness.orchestration.warmstart import warm_start
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.parsers.sim import SimRun
from harness.stats.intervals import DeltaPPL, MeanCI, paired_delta_ppl
from harness.tools.requests import BenchRequest, CacheSpec, Placement, Runner

COMPUTE = "compute"  # the decode run with the cache off, every weight in memory
COMPUTE_TOKENS = 16
COMPUTE_WHAT = "decode in memory, cache off"
COMPUTE_RUNS = SPEED_RUNS

Warn = Callable[[str], None]  # a one-line warning, shown when it happens (the CLI: above the progress bar)


def stderr_warn(line: str) -> None:
    print(f"harness: warning: {line}", file=sys.stderr, flush=True)


class TuneEnvironment(Environment):
    """The outside world of `harness tune` beyond the runs: the machine's measurements, the model's fingerprint,
    the user's cache folder. Tests pass a fake."""

    def machine(self, model: Path, readers: int, disk: bool) -> MachineFacts:
        """Everything but the decode rate (compute_ms_per_token None); the disk only when `disk`."""
        from harness.tools import machine

        cpus, total, avail, gpus = machine.machine_basics()
        d = machine.disk_rate(model, readers) if disk else None
        return MachineFacts(cpus=cpus, mem_total=total, mem_available=avail, gpus=gpus, disk_path=str(model.resolve()),
                            disk_expert_bytes=d.expert_bytes if d else 0, disk_read_bytes=d.read_bytes if d else 0,
                            disk_readers=readers if d else 0, disk_direct=d.direct if d else False,
                            disk_expert_us=d.expert_s * 1e6 if d else 0.0, disk_gbs=d.gbs if d else 0.0,
                            host_copy_gbs=machine.host_copy_gbs(), compute_ms_per_token=None)

    def fingerprint(self, model: Path) -> int:
        from harness.parsers.gguf_model import model_fingerprint

        return model_fingerprint(model)

    def cache_dir(self) -> Path:
        return tune_cache_dir(os.environ, Path.home())

    def writable(self, folder: Path) -> bool:
        return folder.is_dir() and os.access(folder, os.W_OK)


def model_identity(info: ModelInfo, model: Path, fingerprint: int) -> ModelIdentity:
    return ModelIdentity(name=info.name, file_name=model.name, file_bytes=info.file_bytes,
                         fingerprint=f"{fingerprint:016x}", n_expert=info.n_expert, n_expert_used=info.n_expert_used,
                         n_moe_layers=info.n_moe_layers)


def profile_target(opts: TuneOptions, model: Path, fingerprint: str, env: TuneEnvironment) -> Path:
    """--profile-out, else next to the model where its folder is writable, else the user's cache folder under the
    model's file name and fingerprint."""
    if opts.profile_out is not None:
        return opts.profile_out
    beside, keyed, _ = profile_locations(model, env.cache_dir(), fingerprint)
    return beside if env.writable(beside.parent) else keyed


def read_profile_for(model: Path, identity: ModelIdentity, cache_dir: Path) -> tuple[TuneProfile, Path] | None:
    """The tuned profile `--moe-cache auto` would read for this model (profile_locations' order), checked against
    the model (HarnessError naming the file when it is another model's or damaged); None when there is none."""
    for path in profile_locations(model, cache_dir, identity.fingerprint):
        if path.is_file():
            try:
                text = path.read_text()
            except OSError as e:
                raise HarnessError(f"cannot read the tuned profile {path}: {e.strerror or e}") from None
            prof = parse_tune_profile(text, str(path))
            check_profile_model(prof, identity, str(path))
            return prof, path
    return None


def _lost_mass(run: SimRun) -> float:
    t = run.doc["total"]
    n = t.get("token_layers") or 0
    return (float(t.get("subst_mass_sum") or 0.0) + float(t.get("drop_mass_sum") or 0.0)) / n if n else 0.0


def sim_point(c: Candidate, run: SimRun, info: ModelInfo, profile: Profile,
              span: tuple[Profile, Profile] | None = None) -> SimPoint:
    """`span`: the profiles at the two ends of the decode rate's 95% CI (the estimate's span)."""
    fetches = per_token(run, "fetches")
    background = per_token(run, "admissions") + per_token(run, "prefetches")
    hit = run.doc["total"].get("hit_rate")
    est_span = (estimate_ms(span[0], info, fetches, background), estimate_ms(span[1], info, fetches, background)) \
        if span else None
    return SimPoint(c, fetches, background, _lost_mass(run), float(hit) if isinstance(hit, (int, float)) else 0.0,
                    estimate_ms(profile, info, fetches, background), est_span)


def _preset_candidate(preset: str, fraction: float, slots: int) -> Candidate:
    """A preset as a candidate, for the replay and the emulate run (its policy is `policy=<preset>`)."""
    return Candidate(Rung("preset", preset, None, -1), "", "", "off", fraction, slots)


class _Runs:
    """The emulate runs of the search: one llama-perplexity run per configuration (resumable), its paired delta."""

    def __init__(self, opts: TuneOptions, model: Path, text: Path, runner: Runner, env: TuneEnvironment,
                 results: ResultsFile, fp: str, progress: Progress, meta: dict[str, Any]) -> None:
        self.opts, self.model, self.text, self.runner = opts, model, text, runner
        self.builds = env.builds()
        self.prov = env.provenance(self.builds, opts.argv, env.gpu())
        self.results, self.fp, self.progress, self.meta = results, fp, progress, meta
        self.full: NllDump | None = None
        self.full_label = FULL  # the run the deltas pair against
        self.deltas: dict[str, DeltaPPL | None] = {}

    def run(self, specs: Sequence[RunSpec]) -> None:
        outcome = execute_runs(specs, self.runner, self.builds, self.prov, self.fp, self.results, self.progress,
                               meta=self.meta)
        if outcome.interrupted:
            raise KeyboardInterrupt

    def ppl_spec(self, label: str, cache: CacheSpec) -> RunSpec:
        o = self.opts
        req = o.perplexity_request(self.model, self.text, Placement(n_cpu_moe=999), cache=cache,
                                   nll_dump=o.out / "nll" / f"{safe_name(label)}.bin", label=label)
        return RunSpec(f"ppl:{label}", "ppl", "patched", label, None, ppl=req)

    def speeds_of(self, keys: Sequence[str]) -> list[float]:
        """tokens/s of the decode test of each recorded bench run among `keys` (one process each), in their order."""
        by_key = {str(r.get("key")): r for r in self.results.read() if r.get("kind") == "bench"}
        return [float(t["avg_ts"]) for k in keys if k in by_key for t in by_key[k]["tests"] if t["n_gen"] > 0]

    def record(self, config: str, kind: str = "ppl") -> dict[str, Any]:
        rec = next((r for r in self.results.read() if r.get("kind") == kind and r.get("config") == config), None)
        if rec is None:
            raise HarnessError(f"tune: no record of {config} in {self.results.path}")
        return rec

    def nll(self, config: str) -> NllDump:
        path = self.record(config).get("nll_dump")
        if not path:
            raise HarnessError(f"tune: the run {config} has no NLL dump")
        return self.runner.load_nll(Path(path))

    def delta(self, label: str, cache: CacheSpec) -> DeltaPPL | None:
        if label not in self.deltas:
            self.run([self.ppl_spec(label, cache)])
            if self.full is None:
                self.full = self.nll(self.full_label)
            mine = self.nll(label)
            ok = mine.nll.shape == self.full.nll.shape and bool((mine.tokens == self.full.tokens).all())
            self.deltas[label] = paired_delta_ppl(self.full.nll, mine.nll, self.full.chunk, n_boot=self.opts.n_boot,
                                                  seed=self.opts.seed) if ok else None
        return self.deltas[label]


def _emulate_cache(c: Candidate, stats: Path) -> CacheSpec:
    if c.rung.chain == "preset":
        return CacheSpec("emulate", c.rung.rule, c.slots, str(stats))
    return CacheSpec("emulate", None, c.slots, str(stats), c.policy_items())


def _engine_cache(c: Candidate, host: str) -> CacheSpec:
    tier = (("host", "file"),) if host == "file" else ()
    if c.rung.chain == "preset":
        return CacheSpec("engine", c.rung.rule, c.slots, None, tier)
    return CacheSpec("engine", None, c.slots, None, (*c.policy_items(), *tier))


def _run_spec_string(c: Candidate, host: str) -> str:
    return _engine_cache(c, host).render()


def _speeds(runs: _Runs, configs: Sequence[tuple[str, str, BenchRequest]], n: int, warn: Warn,
            notes: list[str]) -> dict[str, SpeedCheck]:
    """Each configuration's decode speed (name, what to call it, its llama-bench request of one repetition): a warm-up
    process each (`bench:NAME:warmup`, discarded: the model's pages, the CPU's clock), then `n` processes each,
    interleaved (`bench:NAME:REP`); when any one's CV is above SPEED_CV_WARN, a warning line and the `n` processes of
    every configuration again (`bench:NAME:again:REP`; they then stand for all, measured under the same conditions);
    still above: a second line, and a note. The process is the sample. Every run is recorded (resumable)."""
    def spec(name: str, req: BenchRequest, key: str, rep: int | None) -> RunSpec:
        return RunSpec(f"bench:{name}:{key}", "bench", "patched", name, rep, bench=req)

    def round_of(tag: str, first_rep: int) -> dict[str, list[str]]:
        keys = {name: [f"{tag}{i}" for i in range(n)] for name, _, _ in configs}
        runs.run([spec(name, req, keys[name][i], first_rep + i) for i in range(n) for name, _, req in configs])
        return {name: [f"bench:{name}:{k}" for k in ks] for name, ks in keys.items()}

    runs.run([spec(name, req, "warmup", None) for name, _, req in configs])
    first = {name: runs.speeds_of(keys) for name, keys in round_of("", 0).items()}
    checks = {name: SpeedCheck(what, tuple(first[name])) for name, what, _ in configs if first[name]}
    bad = [c for c in checks.values() if not c.stable]
    if not bad:
        return checks
    warn(stability_line(bad, again=False))
    again = {name: runs.speeds_of(keys) for name, keys in round_of("again:", n).items()}
    checks = {name: SpeedCheck(what, tuple(again[name]), tuple(first[name])) for name, what, _ in configs
              if again[name]}
    still = [c for c in checks.values() if not c.stable]
    if still:
        line = stability_line(still, again=True)
        warn(line)
        notes.append(line)
    else:
        notes.append("the first round of decode measurements was unstable (" +
                     "; ".join(f"{c.what}: CV {cv_label(c.cv)}" for c in bad) +
                     "): measured again, stable; the re-run's processes are the measurement")
    return checks


def _resolved(opts: TuneOptions) -> tuple[Path, Path]:
    if opts.model is None or opts.text is None:
        raise HarnessError("no model or text given")  # tune() fills in the defaults
    return opts.model, opts.text


def _check_options(opts: TuneOptions, text: Path) -> None:
    if not text.is_file():
        raise HarnessError(f"cannot read the text {text}: no such file")
    if opts.check_text is not None:
        if not opts.check_text.is_file():
            raise HarnessError(f"cannot read the --check-text {opts.check_text}: no such file")
        if opts.check_text.resolve() == text.resolve():
            raise HarnessError(f"--check-text {opts.check_text} is the text the choice is made on: give other text "
                               "(the check is out of sample)")
    if not opts.max_delta_pct > 0:
        raise HarnessError(f"--max-delta-ppl must be above 0%, got {opts.max_delta_pct:g}%")
    if opts.measure_grid < 0 or (opts.measure_grid and not opts.measure):
        raise HarnessError(f"--measure-grid {opts.measure_grid}: a count of grid points to measure, 0 or more, "
                           "with --measure")
    if opts.measure and opts.runs < 2:
        raise HarnessError(f"--runs {opts.runs}: at least 2 processes per configuration (a spread needs two; "
                           f"{SPEED_RUNS} or more recommended)")


def _this_machine(opts: TuneOptions, model: Path, info: ModelInfo, env: TuneEnvironment,
                  notes: list[str]) -> tuple[str, MachineFacts]:
    """Step 1: the tier the profile is for and this machine's facts (the decode rate comes with the runs)."""
    basics = env.machine(model, opts.readers, disk=False)
    host = opts.host or ("ram" if basics.gpus else "file")
    if host not in HOSTS:
        raise HarnessError(f"--host {host!r}: use {', '.join(HOSTS)}")
    facts = env.machine(model, opts.readers, disk=True) if host == "file" else basics
    if info.total_bytes + (2 << 30) < facts.mem_available:
        notes.append(f"the model ({info.total_bytes / 2**30:.2f} GiB) fits in this machine's available memory "
                     f"({facts.mem_available / 2**30:.1f} GiB): `--moe-cache auto` leaves the cache off here; the "
                     "profile serves a run under a tighter memory limit")
    if facts.gpus:
        notes.append("a GPU is present: its link and compute are not measured by harness tune yet; the base "
                     f"profile's ({opts.base_profile}) stand in")
    return host, facts


def _trace_and_full_model(opts: TuneOptions, runs: _Runs, runner: Runner, info: ModelInfo) -> Path:
    """Step 2a: the full model's NLLs and its router trace (recorded again for a resumed folder without it)."""
    trace = opts.out / "router.trace"
    full_cache = CacheSpec("emulate", "fetch-all", info.n_expert, str(opts.out / "stats" / "full.json"),
                           (("trace", str(trace)), ("trace_top", str(info.n_expert))))
    first = [runs.ppl_spec(FULL, full_cache)]
    runs.run(first)
    if not trace.is_file():  # a resumed folder without its trace (not committed: tens of MB): record it again
        runs.progress(0, 1, "router trace (again)")
        again = replace(first[0].ppl, nll_dump=None, label="trace") if first[0].ppl else None
        if again is not None:
            runner.perplexity(runs.builds["patched"], again)
        if not trace.is_file():
            raise HarnessError(f"tune: the full model's run wrote no router trace at {trace}")
    check_trace_matches(trace, info)
    return trace


def _decode_rate(runs: _Runs, model: Path, info: ModelInfo, facts: MachineFacts, host: str, base: Profile,
                 bench_threads: int, why: str, warn: Warn, notes: list[str]
                 ) -> tuple[MachineFacts, dict[str, SpeedCheck], tuple[Profile, Profile] | None]:
    """Step 2b, on a CPU machine: the decode rate in memory (llama-bench), and the profiles at its fast and slow
    ends (the estimate's span)."""
    if facts.gpus:
        return facts, {}, None
    notes.append(f"decode runs (llama-bench) use {bench_threads} thread{'s' if bench_threads != 1 else ''} ({why})")
    req = BenchRequest(model, Placement(), n_prompt=0, n_gen=COMPUTE_TOKENS, repetitions=1, threads=bench_threads,
                       label=COMPUTE)
    speeds = _speeds(runs, [(COMPUTE, COMPUTE_WHAT, req)], COMPUTE_RUNS, warn, notes)
    if COMPUTE not in speeds:
        return facts, speeds, None
    ms, ms_fast, ms_slow = compute_ms_span(speeds[COMPUTE].samples)
    span = (machine_profile(replace(facts, compute_ms_per_token=ms_fast), info, base, host)[0],
            machine_profile(replace(facts, compute_ms_per_token=ms_slow), info, base, host)[0])
    return replace(facts, compute_ms_per_token=ms), speeds, span


def _replay_all(opts: TuneOptions, sim: SimRunner, trace: Path, candidates: Sequence[Candidate], info: ModelInfo,
                profile: Profile, span: tuple[Profile, Profile] | None, progress: Progress
                ) -> tuple[list[SimPoint], dict[tuple[str, float], SimPoint], dict[float, int]]:
    """Step 3: every candidate replayed, and the presets at each residency; each replay a line of sim.jsonl."""
    points: list[SimPoint] = []
    presets: dict[tuple[str, float], SimPoint] = {}
    sim_log = opts.out / "sim.jsonl"
    sim_log.parent.mkdir(parents=True, exist_ok=True)
    with sim_log.open("w", buffering=1) as log:  # line by line: a long search can be watched
        def replay(c: Candidate, spec: str) -> SimPoint:
            if opts.warm_profile is not None:  # the replay starts from the same residency as the emulate runs
                spec = f"{spec},profile={opts.warm_profile}"
            run = sim.simulate(trace, spec)
            p = sim_point(c, run, info, profile, span)
            log.write(json.dumps({"spec": spec, "est_ms_per_token": p.est_ms, "est_ms_span": p.span,
                                  "fetches_per_token": p.fetches,
                                  "background_per_token": p.background, "lost_mass": p.lost_mass,
                                  "total": run.doc["total"]}) + "\n")
            return p

        slots_of = {c.fraction: c.slots for c in candidates}
        total = len(candidates) + len(slots_of) * len(TUNE_PRESETS)
        for i, c in enumerate(candidates):
            progress(i, total, f"replay {c.name}")
            points.append(replay(c, c.sim_spec()))
        for f, slots in slots_of.items():
            for preset in TUNE_PRESETS:
                pc = _preset_candidate(preset, f, slots)
                presets[(preset, f)] = replay(pc, sim_spec(preset, str(slots)))
    return points, presets, slots_of


@dataclass
class _Search:
    """Step 4's results over the residencies: the checked rows, the choices, the frontier, and per residency the
    grid points within the bound but the choice (--measure-grid's pool)."""

    rows: list[CheckRow] = field(default_factory=list)
    choices: list[TuneChoice] = field(default_factory=list)
    frontier: list[SimPoint] = field(default_factory=list)
    pools: dict[float, list[SimPoint]] = field(default_factory=dict)
    chosen: dict[float, Candidate] = field(default_factory=dict)


def _search_residency(opts: TuneOptions, runs: _Runs, info: ModelInfo, host: str, f: float, slots: int,
                      points: Sequence[SimPoint], presets: dict[tuple[str, float], SimPoint], out: _Search) -> None:
    """Step 4 at one residency: bisect each chain against the bound (emulate runs, each rung checked once), pick
    the fastest rung within it, check the presets, and record the choice."""
    best = best_per_rung(points, f)
    out.frontier += sorted(best.values(), key=lambda p: (p.candidate.rung.chain, p.candidate.rung.level))
    checked: dict[Rung, CheckRow] = {}

    def passes(rung: Rung) -> bool:
        if rung not in checked:
            p = best[rung]
            if rung.exact:
                checked[rung] = CheckRow("exact", p.candidate.name, p.candidate.policy, f, p.candidate.slots,
                                         p.est_ms, None, True, True)
            else:
                stats = opts.out / "stats" / f"{safe_name(p.candidate.name)}.json"
                d = runs.delta(p.candidate.name, _emulate_cache(p.candidate, stats))
                checked[rung] = CheckRow("checked", p.candidate.name, p.candidate.policy, f, p.candidate.slots,
                                         p.est_ms, d, False, within_bound(d, opts.max_delta_pct, opts.strict),
                                         note="" if d is not None else "no paired delta: NLL dumps differ")
        return checked[rung].passes

    boundaries: dict[str, int] = {}
    for chain in CHAINS:
        rungs = [r for r in chain_rungs(opts.grid, chain) if r in best]
        if len(rungs) > 1:
            boundaries[chain] = bisect_chain(rungs, passes)
    def measured(rung: Rung) -> float | None:
        row = checked.get(rung)
        return row.delta.delta_pct if row is not None and row.delta is not None else None

    chosen = pick_fastest(best, boundaries, opts.grid, passes, measured)
    out.chosen[f] = chosen.candidate
    failed = {rung for rung, row in checked.items() if not row.passes}
    out.pools[f] = [p for p in within_bound_points(points, f, boundaries, opts.grid, failed)
                    if p.candidate.name != chosen.candidate.name]
    rows = out.rows
    for rung, row in checked.items():
        rows.append(replace(row, role="chosen") if rung == chosen.candidate.rung else row)
    if chosen.candidate.rung not in checked:  # fetch-all chosen without a check: exact
        passes(chosen.candidate.rung)
        rows.append(replace(checked[chosen.candidate.rung], role="chosen"))
    chosen_row = next(r for r in rows if r.role == "chosen" and r.fraction == f)
    for preset in TUNE_PRESETS:
        pp = presets[(preset, f)]
        label = f"{preset} slots={slots}"
        if preset == BASELINE_POLICY:  # never substitutes: the full model's output (tests/test_tune.py checks it)
            rows.append(CheckRow(preset, label, f"policy={preset}", f, slots, pp.est_ms, None, True, True))
            continue
        stats = opts.out / "stats" / f"{safe_name(label)}.json"
        d = runs.delta(label, _emulate_cache(pp.candidate, stats))
        rows.append(CheckRow(preset, label, f"policy={preset}", f, slots, pp.est_ms, d, False,
                             within_bound(d, opts.max_delta_pct, opts.strict)))
    d = chosen_row.delta
    out.choices.append(TuneChoice(
        residency=residency_label(f), fraction=f, slots=slots, n_expert=info.n_expert,
        policy=chosen.candidate.policy, spec=_run_spec_string(chosen.candidate, host),
        delta_pct=d.delta_pct if d else 0.0, ci_low=d.low if d else 0.0, ci_high=d.high if d else 0.0,
        est_tokens_per_s=chosen.est_tps, est_fetch_all_tokens_per_s=presets[("fetch-all", f)].est_tps,
        est_quality_tokens_per_s=presets[("quality", f)].est_tps))


def _write_profile(opts: TuneOptions, model: Path, env: TuneEnvironment, doc_of: TuneProfile) -> Path:
    """Step 6: the tuned profile where `auto` finds it, and a copy in the results folder."""
    target = profile_target(opts, model, doc_of.model.fingerprint, env)
    doc = profile_to_json(doc_of)
    for path in dict.fromkeys((target, opts.out / "profile.moe-tune.json")):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(doc)
        except OSError as e:
            raise HarnessError(f"cannot write the tuned profile {path}: {e.strerror or e}") from None
    return target


def run_tune(opts: TuneOptions, runner: Runner, sim: SimRunner, info: ModelInfo, *, env: TuneEnvironment,
             progress: Progress = no_progress, warn: Warn = stderr_warn) -> TuneResult:
    t0 = time.perf_counter()
    model, text = _resolved(opts)
    _check_options(opts, text)
    candidates = tune_candidates(opts.grid, info)
    notes: list[str] = []
    host, facts = _this_machine(opts, model, info, env, notes)  # 1. this machine

    identity = model_identity(info, model, env.fingerprint(model))
    results = ResultsFile(opts.out / "results.jsonl")
    builds = env.builds()
    prov = env.provenance(builds, opts.argv, env.gpu())
    opts = warm_start(opts, model, text, opts.out / "warm", runner, builds["patched"], info.n_expert,
                      info.n_moe_layers)
    fp = tune_fingerprint(model, text, opts, dict(prov.binaries))
    meta: dict[str, Any] = {"command": "tune", "options": options_json(opts, TUNE_OPTION_KEYS)}
    runs = _Runs(opts, model, text, runner, env, results, fp, progress, meta)

    # 2. the trace and the full model's NLLs; the decode rate in memory
    bench_threads, why = (opts.threads, "given") if opts.threads else env.default_threads()
    trace = _trace_and_full_model(opts, runs, runner, info)
    base = load_profile(opts.base_profile)
    facts, speeds, span = _decode_rate(runs, model, info, facts, host, base, bench_threads, why, warn, notes)
    profile, sources = machine_profile(facts, info, base, host)

    # 3. every candidate replayed, with the presets; 4. the search per residency, and the presets in emulate mode
    points, presets, slots_of = _replay_all(opts, sim, trace, candidates, info, profile, span, progress)
    search = _Search()
    for f, slots in slots_of.items():
        _search_residency(opts, runs, info, host, f, slots, points, presets, search)
    rows, choices = search.rows, search.choices

    # 4b. --check-text: the choice and the quality preset judged on text they were not chosen on
    out_of_sample = _out_of_sample(opts, model, runner, env, results, fp, progress, meta, info, search, presets) \
        if opts.check_text is not None else ()

    # 5. --measure: decode with the engine, the choice and the presets interleaved
    if opts.measure:
        rows, choices, measured = _measure(opts, model, host, not facts.gpus, runs, rows, choices, points, presets,
                                           bench_threads, search.pools, warn, notes)
        speeds.update(measured)

    # 6. the profile
    target = _write_profile(opts, model, env, TuneProfile(
        identity, opts.max_delta_pct, BOUND_ON[opts.strict], host, facts, asdict(profile), tuple(choices), str(text),
        opts.n_ctx, opts.chunks, utc_now(),
        {"pin": prov.pin, "pin_sha256": prov.pin_sha256, "patch_series": prov.patch_series}, tuple(speeds.values())))
    return TuneResult(opts, identity, host, facts, profile, sources, len(points) + len(presets), tuple(search.frontier),
                      tuple(rows), tuple(choices), target, results.path, time.perf_counter() - t0, tuple(notes),
                      tuple(speeds.values()), out_of_sample)


def _out_of_sample(opts: TuneOptions, model: Path, runner: Runner, env: TuneEnvironment, results: ResultsFile,
                   fp: str, progress: Progress, meta: dict[str, Any], info: ModelInfo, search: _Search,
                   presets: dict[tuple[str, float], SimPoint]) -> tuple[OutOfSample, ...]:
    """Step 4b: the full model on the check text, then per residency the choice and the quality preset there, each
    paired against it (labels "check:...", so that a resumed folder finds them)."""
    assert opts.check_text is not None
    text = opts.check_text.resolve()
    runs = _Runs(opts, model, text, runner, env, results, fp, progress, meta)
    runs.full_label = f"check:{FULL}"
    runs.run([runs.ppl_spec(runs.full_label, CacheSpec("emulate", "fetch-all", info.n_expert,
                                                       str(opts.out / "stats" / "check-full.json")))])
    out: list[OutOfSample] = []
    for f, c in search.chosen.items():
        q = presets[("quality", f)].candidate
        for role, cand, name, policy in (("chosen", c, c.name, c.policy),
                                         ("quality", q, f"quality slots={q.slots}", "policy=quality")):
            label = f"check:{name}"
            d = None if cand.rung.exact else runs.delta(label, _emulate_cache(cand, opts.out / "stats" /
                                                                             f"check-{safe_name(name)}.json"))
            ok = True if cand.rung.exact else within_bound(d, opts.max_delta_pct, opts.strict)
            out.append(OutOfSample(residency_label(f), role, policy, str(opts.check_text), d, ok))
    return tuple(out)


def _measure(opts: TuneOptions, model: Path, host: str, cpu: bool, runs: _Runs, rows: list[CheckRow],
             choices: list[TuneChoice], points: Sequence[SimPoint],
             presets: dict[tuple[str, float], SimPoint], threads: int, pools: dict[float, list[SimPoint]],
             warn: Warn, notes: list[str]) -> tuple[list[CheckRow], list[TuneChoice], dict[str, SpeedCheck]]:
    """llama-bench tg with the engine for the choice and the presets, and with --measure-grid N the N fastest
    estimated grid points within the bound (rows of role "grid": their delta-PPL is their rung's emulate check where
    one ran): a warm-up process each, then `runs` processes each interleaved, their CV checked and measured again
    once when unstable (`_speeds`). On a CPU build without repacking: the engine copies experts slot by slot from
    their plain layout (docs/running.md)."""
    by_name = {p.candidate.name: p.candidate for p in points}
    configs: list[tuple[str, Candidate]] = []
    for r in rows:
        if r.role == "chosen":
            configs.append((r.name, by_name[r.name]))
        elif r.role in TUNE_PRESETS:
            configs.append((r.name, presets[(r.role, r.fraction)].candidate))
    grid_rows: list[CheckRow] = []
    for f, pool in pools.items():
        checked = {by_name[r.name].rung: r for r in rows if r.fraction == f and r.name in by_name
                   and r.role in ("checked", "chosen", "exact")}
        taken = {name for name, _ in configs}
        for p in [p for p in pool if p.candidate.name not in taken][: opts.measure_grid]:
            c = p.candidate
            rung_row = checked.get(c.rung)
            grid_rows.append(CheckRow("grid", c.name, c.policy, f, c.slots, p.est_ms,
                                      rung_row.delta if rung_row else None, c.rung.exact, True,
                                      note="" if rung_row or c.rung.exact else
                                      "its rung lies below the chain's boundary: not run in emulate"))
            configs.append((c.name, c))
    rows = rows + grid_rows
    extra = ("--repack", "0") if host == "file" or cpu else ()
    checks = _speeds(runs, [(name, f"decode with the engine, {name}",
                             BenchRequest(model, Placement(), n_prompt=0, n_gen=opts.n_gen, repetitions=1,
                                          threads=threads, cache=opts.warm(_engine_cache(c, host)), extra_args=extra,
                                          label=name))
                            for name, c in configs], opts.runs, warn, notes)
    speeds: dict[str, MeanCI] = {name: c.ci for name, c in checks.items()}
    rows = [replace(r, measured=speeds.get(r.name)) for r in rows]
    out: list[TuneChoice] = []
    for ch in choices:
        row = next(r for r in rows if r.role == "chosen" and r.fraction == ch.fraction)
        out.append(replace(ch, measured_tokens_per_s=row.measured.mean if row.measured else None))
    return rows, out, {f"measure:{name}": c for name, c in checks.items()}


def tune(opts: TuneOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
         sim: SimRunner | None = None, env: TuneEnvironment | None = None, warn: Warn = stderr_warn) -> TuneResult:
    """`harness tune`: resolve the default model and text, run (or resume) the tune, write report.md."""
    from harness.core.project import get_build
    from harness.orchestration.compare import default_model, resolve_text
    from harness.orchestration.simulate import ToolSimRunner
    from harness.parsers.gguf_model import read_model_info
    from harness.report.tune import render_tune_markdown
    from harness.tools.runners import ToolRunner

    prepare_out_dir(opts.out)
    opts = replace(opts, model=opts.model or default_model(), text=resolve_text(opts.text, None))
    model, _ = _resolved(opts)
    info = read_model_info(model)
    result = run_tune(opts, runner or ToolRunner(), sim or ToolSimRunner(get_build("patched")), info,
                      env=env or TuneEnvironment(), progress=progress, warn=warn)
    (opts.out / "report.md").write_text(render_tune_markdown(result))
    return result
