"""`harness compare`: stock llama.cpp against the patched build with the expert cache, under one budget.

Orchestration only: plans the runs from GGUF metadata, runs them through an injected `Runner`
(interleaving stock and patched repetitions), appends one JSON Lines record per finished run, skips runs
already recorded (resume), and computes the summary with `harness.stats.intervals`. Rendering is in
`harness.report.markdown`.

Runs (keys are the resume keys):
- quality, on the same text and tokens: `ppl:full` (patched build, cache off: the full model),
  `ppl:stock` (the stock build, the same placement: must agree with `ppl:full`), and `ppl:<policy>` (patched
  build, cache in emulate mode with the planned slots); paired delta-PPL% of each policy against the
  full model from per-token NLL dumps, with a block-bootstrap CI over chunks;
- speed: `bench:<config>:<rep>` for rep in 0..runs-1, config in stock and every policy (engine mode);
  each repetition runs every config once, in an order that alternates between repetitions (ABBA), so
  slow drift of the machine affects all configurations alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.records import Provenance, ResultsFile, make_record, utc_now
from harness.core.sizes import Size, format_bytes
from harness.domain.costmodel import cache_work, estimate, load_profile, stock_gpu_moe_layers, stock_work
from harness.domain.plan import SlotPlan, budget_bytes, plan_slots
from harness.parsers.cache_stats import CacheStats
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import (
    DeltaPPL,
    MeanCI,
    RatioCI,
    mean_ci,
    paired_delta_ppl,
    ratio_ci,
    spread_warnings,
)
from harness.tools.runners import (
    BenchRequest,
    CacheSpec,
    PerplexityRequest,
    Placement,
    Runner,
    ToolCrashedError,
)

DEFAULT_RESIDENCY = Size(fraction=0.25)
# Named cache configurations (docs/expert-cache.md): the three presets, and the bare miss rules with LFU
# eviction and no admission (the rules of the study's first finding; "rule-0.15" is "quality" without
# admission, so the two compare admission).
POLICIES: dict[str, tuple[tuple[str, str], ...]] = {
    "quality": (("policy", "quality"),),
    "speed": (("policy", "speed"),),
    "fetch-all": (("policy", "fetch-all"),),
    "rule-0.15": (("rule", "threshold"), ("tau", "0.15"), ("evict", "lfu"), ("admit", "off")),
    "first-choice": (("rule", "first-choice"), ("evict", "lfu"), ("admit", "off")),
    "substitute-all": (("rule", "substitute-all"), ("evict", "lfu"), ("admit", "off")),
}
KNOWN_POLICIES = tuple(POLICIES)
STOCK = "stock"
FULL = "full"
NO_GPU_NOTE = "no GPU found: the CPU build runs; speed figures are labelled 'CPU build'"

Progress = Callable[[int, int, str], None]  # (done, total, label of the run that starts or was skipped)


def _no_progress(done: int, total: int, label: str) -> None:
    return None


@dataclass(frozen=True)
class CompareOptions:
    out: Path
    model: Path | None = None  # None: the project's trained model (default_model)
    vram: Size | None = None  # None: the budget that keeps DEFAULT_RESIDENCY of the experts resident
    policies: tuple[str, ...] = ("quality", "speed", "fetch-all")
    text: Path | None = None  # None: the held-out text (compare) or no quality runs (run_compare)
    dataset: str | None = None  # a named dataset instead of --text (only from a local file)
    runs: int = 5
    n_ctx: int = 512
    n_batch: int | None = None  # None: n_ctx (one sequence per batch: token order = decode order)
    chunks: int | None = None
    n_prompt: int = 512
    n_gen: int = 128
    threads: int | None = None
    reserve_bytes: int = 0  # device memory kept for KV cache and compute buffers
    speed: bool = True
    quality: bool = True
    bench_cache_mode: str = "engine"
    n_boot: int = 2000
    seed: int = 0
    profile: str | None = "rtx3090"  # hardware profile for speed estimates when there is no GPU (None: none)
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class ComparePlan:
    info: ModelInfo
    budget_bytes: int
    slots: SlotPlan
    stock_gpu_moe_layers: int
    stock: Placement
    patched: Placement
    host_expert_bytes_stock: int
    host_expert_bytes_patched: int
    notes: tuple[str, ...]

    @property
    def fits_whole_model(self) -> bool:
        return self.slots.fits_whole_model


def check_policies(policies: Sequence[str]) -> None:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise HarnessError(f"unknown polic{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}: "
                           f"use {', '.join(KNOWN_POLICIES)}")
    if not policies:
        raise HarnessError("no policies to compare")


def policy_cache_spec(policy: str, mode: str, slots: int, stats: str | None) -> CacheSpec:
    """The cache spec of a named configuration (POLICIES) in `mode` with `slots` per layer."""
    items = POLICIES[policy]
    preset = dict(items).get("policy")
    extra = tuple((k, v) for k, v in items if k != "policy")
    return CacheSpec(mode, preset, slots, stats, extra)


def _n_cpu_moe_for(info: ModelInfo, gpu_moe_layers: int) -> int:
    """--n-cpu-moe N puts the experts of layers 0..N-1 on the CPU (by layer index, dense layers included),
    so keeping the last `gpu_moe_layers` MoE layers on the device means N = index of the first of them."""
    if gpu_moe_layers >= info.n_moe_layers:
        return 0
    if gpu_moe_layers <= 0:
        return info.n_layers
    return info.moe_layers[info.n_moe_layers - gpu_moe_layers]


def plan_compare(info: ModelInfo, vram: Size | None, *, reserve_bytes: int = 0,
                 host_available_bytes: int | None = None) -> ComparePlan:
    """Stock: non-expert weights on the device plus as many whole MoE layers of experts as fit;
    patched: non-expert weights plus cache slots in the same budget, every expert tensor in host memory."""
    notes: list[str] = []
    size = vram
    if size is None:
        size = DEFAULT_RESIDENCY
        notes.append(f"no --vram given: using the budget that keeps about {DEFAULT_RESIDENCY}"
                     " of the experts resident")
    budget = budget_bytes(info, size)
    if budget >= info.total_bytes + reserve_bytes:
        notes.append(f"the budget ({format_bytes(budget)}) holds the whole model ({format_bytes(info.total_bytes)})"
                     ": nothing is offloaded, both builds run fully on the device and the cache has nothing "
                     "to do; pass a smaller --vram to compare offloading")
    slots = plan_slots(info, Size(bytes=budget), reserve=reserve_bytes)
    if slots.slots_per_layer <= info.n_expert_used:
        notes.append(f"only {slots.slots_per_layer} slots per layer for {info.n_expert_used} experts per token: "
                     "every resident expert is in use by almost every token, so eviction has little and background "
                     "admission no room to act; give a larger --vram to see admission work")
    gpu_layers = stock_gpu_moe_layers(info, budget, reserve_bytes)
    stock = Placement(n_cpu_moe=_n_cpu_moe_for(info, gpu_layers))
    # all expert tensors stay in host memory, unless the budget holds them all (then as stock: nothing offloaded)
    patched = Placement(n_cpu_moe=0 if gpu_layers >= info.n_moe_layers else info.n_layers)
    per_layer = info.bytes_per_expert * info.n_expert
    host_stock = (info.n_moe_layers - gpu_layers) * per_layer
    host_patched = info.expert_bytes if patched.n_cpu_moe else 0
    if host_available_bytes is not None:
        for who, need in (("stock", host_stock), ("patched", host_patched)):
            if need > host_available_bytes:
                notes.append(f"{who}: the host-side experts ({format_bytes(need)}) exceed the available RAM "
                             f"({format_bytes(host_available_bytes)}): they will stream from disk through "
                             "mmap, and speed will mostly measure the disk")
    return ComparePlan(info, budget, slots, gpu_layers, stock, patched, host_stock, host_patched, tuple(notes))


@dataclass(frozen=True)
class RunSpec:
    key: str
    kind: str  # "ppl" or "bench"
    build: str  # "stock" or "patched"
    config: str  # "stock", "full", or a policy
    rep: int | None
    ppl: PerplexityRequest | None = None
    bench: BenchRequest | None = None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _model(opts: CompareOptions) -> Path:
    if opts.model is None:
        raise HarnessError("no model given")  # compare() fills in the default; run_compare needs one
    return opts.model


def plan_runs(opts: CompareOptions, plan: ComparePlan) -> list[RunSpec]:
    """The run matrix, in execution order: quality runs first, then interleaved speed repetitions."""
    runs: list[RunSpec] = []
    slots = plan.slots.slots_per_layer
    model = _model(opts)
    if opts.quality and opts.text is not None:
        def ppl(config: str, placement: Placement, cache: CacheSpec | None, dump: bool) -> PerplexityRequest:
            return PerplexityRequest(
                model=model, text=opts.text or Path(), placement=placement, n_ctx=opts.n_ctx,
                n_batch=opts.n_batch or opts.n_ctx, chunks=opts.chunks, threads=opts.threads, cache=cache,
                nll_dump=opts.out / "nll" / f"{_safe(config)}.bin" if dump else None, label=config)

        runs.append(RunSpec("ppl:full", "ppl", "patched", FULL, None,
                            ppl=ppl(FULL, plan.patched, CacheSpec("off"), True)))
        runs.append(RunSpec("ppl:stock", "ppl", "stock", STOCK, None, ppl=ppl(STOCK, plan.patched, None, False)))
        for pol in opts.policies:
            stats = str(opts.out / "stats" / f"ppl-{_safe(pol)}.json")
            runs.append(RunSpec(f"ppl:{pol}", "ppl", "patched", pol, None,
                                ppl=ppl(pol, plan.patched, policy_cache_spec(pol, "emulate", slots, stats), True)))
    if opts.speed:
        configs = [STOCK, *opts.policies]
        for rep in range(opts.runs):
            order = configs if rep % 2 == 0 else list(reversed(configs))
            for config in order:
                if config == STOCK:
                    req = BenchRequest(model, plan.stock, opts.n_prompt, opts.n_gen, 1, opts.threads, label=STOCK)
                    runs.append(RunSpec(f"bench:stock:{rep}", "bench", "stock", STOCK, rep, bench=req))
                else:
                    stats = str(opts.out / "stats" / f"bench-{_safe(config)}-{rep}.json")
                    cache = policy_cache_spec(config, opts.bench_cache_mode, slots, stats)
                    req = BenchRequest(model, plan.patched, opts.n_prompt, opts.n_gen, 1, opts.threads, cache,
                                       label=config)
                    runs.append(RunSpec(f"bench:{config}:{rep}", "bench", "patched", config, rep, bench=req))
    return runs


# ---- budget verification ------------------------------------------------------------------------------

@dataclass(frozen=True)
class BudgetCheck:
    key: str
    config: str
    peak_mib: float | None
    source: str  # "memory breakdown", "nvidia-smi", or "" when not measured
    over: bool


@dataclass(frozen=True)
class BudgetVerdict:
    budget_mib: float
    has_gpu: bool
    checks: tuple[BudgetCheck, ...]
    message: str

    @property
    def over(self) -> tuple[BudgetCheck, ...]:
        return tuple(c for c in self.checks if c.over)

    @property
    def ok(self) -> bool:
        return self.has_gpu and not self.over and all(c.peak_mib is not None for c in self.checks)


def verify_budget(measured: Iterable[tuple[str, str, float | None, str]], budget_bytes: int, has_gpu: bool,
                  tolerance_mib: float = 0.0) -> BudgetVerdict:
    """Flag every run whose measured peak device memory exceeds the budget. `measured` holds
    (key, config, peak MiB or None, source) per run."""
    budget_mib = budget_bytes / 2**20
    checks = tuple(BudgetCheck(k, c, p, s if p is not None else "",
                               p is not None and p > budget_mib + tolerance_mib) for k, c, p, s in measured)
    if not has_gpu:
        msg = ("no GPU on this machine: the device budget cannot be verified; all runs used the CPU build, "
               "so speed figures are CPU-build figures, not what a GPU with this budget would do")
        return BudgetVerdict(budget_mib, False, checks, msg)
    over = [c for c in checks if c.over]
    missing = [c for c in checks if c.peak_mib is None]
    parts = []
    if over:
        parts.append(f"{len(over)} run{'s' if len(over) > 1 else ''} over the budget of {budget_mib:.0f} MiB: "
                     + ", ".join(f"{c.key} ({c.peak_mib:.0f} MiB)" for c in over))
    if missing:
        parts.append(f"{len(missing)} run{'s' if len(missing) > 1 else ''} without a device-memory measurement: "
                     + ", ".join(c.key for c in missing[:8]) + (" ..." if len(missing) > 8 else ""))
    if not parts:
        peak = max((c.peak_mib for c in checks if c.peak_mib is not None), default=0.0)
        parts.append(f"every run stayed within the budget of {budget_mib:.0f} MiB (highest peak {peak:.0f} MiB)")
    return BudgetVerdict(budget_mib, True, checks, "; ".join(parts))


# ---- summaries ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpeedRow:
    config: str
    test: str  # pp512, tg128
    tokens_per_s: MeanCI  # over repetitions; +/- is a 95% CI
    vs_stock: RatioCI | None
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class QualityRow:
    config: str
    ppl: float
    ppl_se: float  # one SE, as llama-perplexity prints it
    delta: DeltaPPL | None  # against the full model, paired
    cache: CacheStats | None
    note: str = ""


@dataclass(frozen=True)
class EstimateRow:
    """Estimated decode speed from the cost model (harness.domain.costmodel): an estimate, not a measurement."""

    config: str
    ms_per_token: float
    vs_stock: float | None  # estimated speed-up over stock


def estimate_speeds(plan: ComparePlan, quality: Sequence[QualityRow], profile_name: str) -> tuple[EstimateRow, ...]:
    """Decode time per token on a hardware profile: stock with the planned --n-cpu-moe, and every policy with
    the fetches (and admissions) per token that its emulate run counted."""
    profile = load_profile(profile_name)
    info = plan.info
    stock = estimate(profile, stock_work(info, plan.stock_gpu_moe_layers)).ms_per_token
    rows = [EstimateRow(STOCK, stock, None)]
    for q in quality:
        c = q.cache
        if q.config in (FULL, STOCK) or c is None or c.fetches_per_token is None:
            continue
        admissions = (c.admissions or 0) / c.tokens if c.tokens else 0.0
        ms = estimate(profile, cache_work(info, c.fetches_per_token, admissions_per_token=admissions)).ms_per_token
        rows.append(EstimateRow(q.config, ms, stock / ms))
    return tuple(rows)


@dataclass(frozen=True)
class CompareResult:
    plan: ComparePlan
    options: CompareOptions
    gpu: str
    backend: str
    notes: tuple[str, ...]
    speed: tuple[SpeedRow, ...]
    quality: tuple[QualityRow, ...]
    budget: BudgetVerdict
    results_path: Path
    n_run: int
    n_resumed: int
    interrupted: bool
    warnings: tuple[str, ...] = field(default_factory=tuple)
    estimates: tuple[EstimateRow, ...] = ()
    estimate_profile: str = ""


def summarize_speed(records: Sequence[dict[str, Any]], configs: Sequence[str], *, n_boot: int = 2000,
                    seed: int = 0) -> tuple[SpeedRow, ...]:
    """Tokens/s per config and test: mean with t 95% CI over all samples of all repetitions, and the
    ratio to stock with a bootstrap CI."""
    samples: dict[tuple[str, str], list[float]] = {}
    for rec in records:
        if rec.get("kind") != "bench":
            continue
        for t in rec["tests"]:
            ts = [t["n_tokens"] * 1e9 / ns for ns in t["samples_ns"]]
            samples.setdefault((rec["config"], t["test"]), []).extend(ts)
    tests = sorted({t for _, t in samples}, key=lambda s: (not s.startswith("pp"), s))
    rows: list[SpeedRow] = []
    for test in tests:
        stock = samples.get((STOCK, test))
        for config in configs:
            xs = samples.get((config, test))
            if not xs:
                continue
            ci = mean_ci(xs)
            vs = None
            if config != STOCK and stock:
                vs = ratio_ci(xs, stock, n_boot=n_boot, seed=seed)
            rows.append(SpeedRow(config, test, ci, vs, spread_warnings(ci, f"{config} {test}")))
    return tuple(rows)


def summarize_quality(records: Sequence[dict[str, Any]], nll: dict[str, NllDump], configs: Sequence[str], *,
                      n_boot: int = 2000, seed: int = 0) -> tuple[tuple[QualityRow, ...], tuple[str, ...]]:
    """Perplexity of every config and the paired delta against the full model where both NLL dumps exist."""
    by_config = {r["config"]: r for r in records if r.get("kind") == "ppl"}
    rows: list[QualityRow] = []
    warnings: list[str] = []
    full = nll.get(FULL)
    full_rec = by_config.get(FULL)
    stock_rec = by_config.get(STOCK)
    if full_rec is not None and stock_rec is not None:
        a, b = full_rec["ppl"], stock_rec["ppl"]
        if abs(a - b) > 1e-4 * max(1.0, abs(a)):
            warnings.append(f"the patched build with the cache off gives PPL {a:.4f} but stock gives {b:.4f}: "
                            "they must agree exactly (same tokens, same placement); the patch changes results")
    for config in (FULL, STOCK, *configs):
        rec = by_config.get(config)
        if rec is None:
            continue
        cache = CacheStats.from_dict(rec["cache_stats"]) if rec.get("cache_stats") is not None else None
        delta = None
        note = ""
        if config not in (FULL, STOCK):
            data = nll.get(config)
            if full is None or data is None:
                note = "no paired delta: per-token NLL dump unavailable"
            elif data.nll.shape != full.nll.shape or not (data.tokens == full.tokens).all():
                note = "no paired delta: the NLL dumps do not cover the same tokens"
            else:
                delta = paired_delta_ppl(full.nll, data.nll, full.chunk, n_boot=n_boot, seed=seed)
        rows.append(QualityRow(config, float(rec["ppl"]), float(rec["ppl_se"]), delta, cache, note))
    return tuple(rows), tuple(warnings)


# ---- the run ----------------------------------------------------------------------------------------------

def fingerprint(opts: CompareOptions, plan: ComparePlan, binaries: dict[str, str]) -> str:
    """What must not change between a run and its resumption: model file, budget plan, run settings, binaries."""
    m = _model(opts)
    st = m.stat()
    d = {
        "model": [str(m.resolve()), st.st_size, int(st.st_mtime)],
        "budget": plan.budget_bytes, "slots": plan.slots.slots_per_layer, "n_cpu_moe": plan.stock.n_cpu_moe,
        "text": str(opts.text) if opts.text else None, "n_ctx": opts.n_ctx, "n_batch": opts.n_batch,
        "chunks": opts.chunks, "n_prompt": opts.n_prompt, "n_gen": opts.n_gen, "threads": opts.threads,
        "bench_cache_mode": opts.bench_cache_mode, "binaries": binaries,
    }
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class Environment:
    """What `run_compare` needs from the outside world besides the runner; tests pass a fake."""

    def builds(self) -> dict[str, project.Build]:
        return {name: project.get_build(name) for name in ("stock", "patched")}

    def provenance(self, builds: dict[str, project.Build], argv: tuple[str, ...], gpu: str) -> Provenance:
        pin = project.read_pin()
        binaries = {f"{b.name}/{tool}": project.file_sha256(b.tool(tool), 16)
                    for b in builds.values() for tool in ("llama-bench", "llama-perplexity")}
        backend = ",".join(sorted({b.backend for b in builds.values()}))
        return Provenance(pin.name, pin.sha256, project.patch_series_hash(), binaries, backend, gpu, argv, utc_now())

    def gpu(self) -> str:
        from harness.tools.runners import gpu_name

        return gpu_name()

    def host_available_bytes(self) -> int:
        return int(psutil.virtual_memory().available)

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()


def _ppl_record(spec: RunSpec, run: Any) -> dict[str, Any]:
    r = run.result
    data: dict[str, Any] = {
        "build": spec.build, "config": spec.config,
        "cache_spec": spec.ppl.cache.render() if spec.ppl and spec.ppl.cache else None,
        "argv": list(run.output.argv), "wall_s": run.output.wall_s,
        "ppl": r.ppl, "ppl_se": r.ppl_se, "n_chunks": r.n_chunks, "n_ctx": r.n_ctx,
        "running_ppl": list(r.running_ppl),
        "peak_device_mib": None, "peak_source": "",
        "nll_dump": str(spec.ppl.nll_dump) if spec.ppl and spec.ppl.nll_dump else None,
        "cache_stats": run.cache_stats.as_dict() if run.cache_stats is not None else None,
    }
    if run.memory is not None and run.memory.device_self_mib is not None:
        data["peak_device_mib"], data["peak_source"] = run.memory.device_self_mib, "memory breakdown"
        data["memory_breakdown"] = [vars(row) for row in run.memory.rows]
    if run.output.peak_gpu_mib is not None and (data["peak_device_mib"] is None
                                                or run.output.peak_gpu_mib > data["peak_device_mib"]):
        data["peak_device_mib"], data["peak_source"] = run.output.peak_gpu_mib, "nvidia-smi"
    return data


def _bench_record(spec: RunSpec, run: Any) -> dict[str, Any]:
    return {
        "build": spec.build, "config": spec.config, "rep": spec.rep,
        "cache_spec": spec.bench.cache.render() if spec.bench and spec.bench.cache else None,
        "argv": list(run.output.argv), "wall_s": run.output.wall_s,
        "tests": [{"test": t.test, "n_prompt": t.n_prompt, "n_gen": t.n_gen, "n_tokens": t.n_tokens,
                   "samples_ns": list(t.samples_ns), "avg_ts": t.avg_ts, "n_cpu_moe": t.n_cpu_moe,
                   "n_gpu_layers": t.n_gpu_layers, "backends": t.backends, "gpu_info": t.gpu_info,
                   "build_commit": t.build_commit} for t in run.results],
        "peak_device_mib": run.output.peak_gpu_mib,
        "peak_source": "nvidia-smi" if run.output.peak_gpu_mib is not None else "",
    }


def options_json(opts: Any) -> dict[str, Any]:
    """A dataclass of options as JSON (paths and sizes as strings), for the meta record."""
    out: dict[str, Any] = {}
    for k, v in vars(opts).items():
        if isinstance(v, Size):
            out[k] = {"bytes": v.bytes, "fraction": v.fraction}
        elif isinstance(v, Path):
            out[k] = str(v.resolve())
        elif isinstance(v, tuple):
            out[k] = [str(x) if isinstance(x, Path) else x for x in v]
        elif v is None or isinstance(v, (str, int, float, bool)):
            out[k] = v
        else:
            out[k] = repr(v)
    return out


@dataclass(frozen=True)
class ExecOutcome:
    n_run: int
    n_resumed: int
    interrupted: bool
    notes: tuple[str, ...]


def execute_runs(specs: Sequence[RunSpec], runner: Runner, builds: dict[str, project.Build], prov: Provenance,
                 fp: str, results: ResultsFile, progress: Progress = _no_progress,
                 meta: dict[str, Any] | None = None) -> ExecOutcome:
    """Run every spec whose key is not recorded yet, appending one record per finished run. Refuses a results
    file of another configuration (fingerprint). Ctrl-C stops the loop and keeps what finished. A patched
    build that rejects the speed runs' cache mode (no engine yet) skips the patched speed runs with a note."""
    existing = results.read()
    other = {r.get("fingerprint") for r in existing if r.get("kind") in ("ppl", "bench", "meta")} - {fp}
    if other:
        raise HarnessError(f"{results.path} holds results of a different configuration (model, budget, settings "
                           "or binaries changed): use a new --out directory, or delete the file to start over")
    if meta is not None and not any(r.get("kind") == "meta" for r in existing):
        results.append(make_record("meta", "meta", prov, {**meta, "fingerprint": fp}))
    done = {str(r["key"]) for r in existing}
    total = len(specs)
    n_resumed = n_run = 0
    interrupted = no_engine = False
    notes: list[str] = []
    try:
        for i, spec in enumerate(specs):
            if spec.key in done:
                n_resumed += 1
                progress(i + 1, total, f"{spec.key} (recorded)")
                continue
            progress(i, total, spec.key)
            build = builds[spec.build]
            started = utc_now()
            if spec.kind == "ppl":
                assert spec.ppl is not None
                _fresh(spec.ppl.nll_dump)
                _fresh(Path(spec.ppl.cache.stats) if spec.ppl.cache and spec.ppl.cache.stats else None)
                data = _ppl_record(spec, runner.perplexity(build, spec.ppl))
            else:
                assert spec.bench is not None
                if spec.build == "patched" and no_engine:
                    progress(i + 1, total, f"{spec.key} (skipped: no engine mode)")
                    continue
                _fresh(Path(spec.bench.cache.stats) if spec.bench.cache and spec.bench.cache.stats else None)
                try:
                    data = _bench_record(spec, runner.bench(build, spec.bench))
                except ToolCrashedError as e:
                    mode = spec.bench.cache.mode if spec.bench.cache else ""
                    if mode and f"bad value '{mode}' for key 'mode'" in str(e):
                        no_engine = True
                        notes.append(f"the patched build has no '{mode}' mode (docs/expert-cache.md): the patched "
                                     "build's speed is not measured, only stock's")
                        progress(i + 1, total, f"{spec.key} (skipped: no {mode} mode)")
                        continue
                    raise
            data["fingerprint"] = fp
            results.append(make_record(spec.key, spec.kind, prov, data, started=started))
            n_run += 1
            progress(i + 1, total, spec.key)
    except KeyboardInterrupt:
        interrupted = True
    return ExecOutcome(n_run, n_resumed, interrupted, tuple(notes))


def load_nlls(records: Iterable[dict[str, Any]], load: Callable[[Path], NllDump]) -> tuple[
        dict[str, NllDump], list[str]]:
    """The NLL dumps of the recorded perplexity runs, by configuration; unreadable ones become warnings."""
    nll: dict[str, NllDump] = {}
    errors: set[str] = set()
    for rec in records:
        if rec.get("kind") == "ppl" and rec.get("nll_dump"):
            try:
                nll[rec["config"]] = load(Path(rec["nll_dump"]))
            except HarnessError as e:
                errors.add(str(e))
    return nll, sorted(errors)


def _fresh(path: Path | None) -> None:
    """Make room for an output file of the tool: its folder exists, no stale file from an earlier attempt."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)


def run_compare(opts: CompareOptions, runner: Runner, info: ModelInfo, *, env: Environment | None = None,
                progress: Progress = _no_progress) -> CompareResult:
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
    fp = fingerprint(opts, plan, dict(prov.binaries))
    notes = list(plan.notes)
    if gpu == "none":
        notes.append(NO_GPU_NOTE)

    results = ResultsFile(opts.out / "results.jsonl")
    outcome = execute_runs(plan_runs(opts, plan), runner, builds, prov, fp, results, progress,
                           meta={"command": "compare", "options": options_json(opts)})
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


def read_meta(results: ResultsFile, command: str) -> dict[str, Any]:
    meta = next((r for r in results.read() if r.get("kind") == "meta"), None)
    if meta is None:
        raise HarnessError(f"{results.path}: no meta record (not written by this harness, or empty)")
    if meta.get("command") != command:
        raise HarnessError(f"{results.path} holds `harness {meta.get('command')}` results, not {command}")
    return meta


def _size(d: Any) -> Size | None:
    return Size(d.get("bytes"), d.get("fraction")) if isinstance(d, dict) else None


def reload_compare(out: Path, *, model: Path | None = None) -> CompareResult:
    """A comparison re-read from its results folder (for `harness report`); nothing is run. The model file
    is read again for the plan (`model` overrides a moved one)."""
    from harness.parsers.gguf_model import read_model_info
    from harness.parsers.nll_dump import read_nll_dump_file

    results = ResultsFile(out / "results.jsonl")
    meta = read_meta(results, "compare")
    o = meta["options"]
    opts = CompareOptions(
        out=out, model=model or Path(o["model"]), vram=_size(o.get("vram")), policies=tuple(o["policies"]),
        text=Path(o["text"]) if o.get("text") else None, runs=int(o["runs"]), n_ctx=int(o["n_ctx"]),
        n_batch=o.get("n_batch"), chunks=o.get("chunks"), n_prompt=int(o["n_prompt"]), n_gen=int(o["n_gen"]),
        threads=o.get("threads"), reserve_bytes=int(o["reserve_bytes"]), speed=bool(o["speed"]),
        quality=bool(o["quality"]), bench_cache_mode=str(o["bench_cache_mode"]), n_boot=int(o["n_boot"]),
        seed=int(o["seed"]), profile=o.get("profile"), argv=tuple(o.get("argv", ())))
    info = read_model_info(_model(opts))
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


# ---- the command's entry point ------------------------------------------------------------------------------

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


def compare(opts: CompareOptions, progress: Progress = _no_progress, *, runner: Runner | None = None,
            env: Environment | None = None) -> CompareResult:
    """`harness compare`: read the model, run (or resume) the comparison, write report.md next to
    results.jsonl. `opts.model` and `opts.text` may be None for the defaults."""
    from dataclasses import replace

    from harness.parsers.gguf_model import read_model_info
    from harness.report.markdown import render_compare_markdown
    from harness.tools.runners import ToolRunner

    model = opts.model or default_model()
    text = resolve_text(opts.text, opts.dataset) if opts.quality else None
    opts = replace(opts, model=model, text=text)
    info = read_model_info(model)
    result = run_compare(opts, runner or ToolRunner(), info, env=env, progress=progress)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.md").write_text(render_compare_markdown(result))
    return result
