"""What the commands produce and the report layer renders: frozen results of compare, check, sweep, topics, study,
simulate and doctor. Computed in harness.orchestration; every +/- says what it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harness.domain.finding import Verdict
from harness.domain.options import CompareOptions, FrontierOptions, StudyOptions, SweepOptions, TopicOptions
from harness.domain.plan import ComparePlan, SweepPoint
from harness.parsers.baseline import Baseline
from harness.parsers.cache_stats import CacheStats
from harness.stats.intervals import Correlation, DeltaPPL, MeanCI, RatioCI

if TYPE_CHECKING:
    from harness.domain.verdicts import AdmissionPair, DomainRow, MatchedResult

# ---- compare ----------------------------------------------------------------------------------------------


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
    measurable: bool  # device: a GPU to measure on; RAM (compare --ram): the memory cgroup measures every run
    checks: tuple[BudgetCheck, ...]
    message: str
    memory: str = "device"  # "device" (--vram) or "RAM" (--ram: peak_mib is the memory cgroup's peak)

    @property
    def over(self) -> tuple[BudgetCheck, ...]:
        return tuple(c for c in self.checks if c.over)

    @property
    def ok(self) -> bool:
        return self.measurable and not self.over and all(c.peak_mib is not None for c in self.checks)


@dataclass(frozen=True)
class SpeedRow:
    config: str
    test: str  # pp512, tg128
    tokens_per_s: MeanCI  # over repetitions; +/- is a 95% CI
    vs_stock: RatioCI | None
    warnings: tuple[str, ...]
    unstable: str = ""  # why this row (or its ratio to stock) is too unstable to be a result; "" when it is not


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


# ---- check ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateLine:
    """One check of `harness check`: the full model's PPL, or a policy's delta PPL and substitution figures."""

    policy: str
    ok: bool
    message: str
    baseline_pct: float | None = None
    delta_pct: float | None = None
    low: float | None = None
    high: float | None = None
    band: tuple[float, float] | None = None  # the delta PPL% range that passes (harness.orchestration.check.band)


@dataclass(frozen=True)
class CheckResult:
    """`harness check`: the gates against `baseline` (with --update: the baseline written from this run), over the
    quality-only comparison it ran."""

    lines: tuple[GateLine, ...]
    passed: bool
    updated: bool
    baseline_path: Path
    compare: CompareResult
    baseline: Baseline
    rule: str = ""  # the gate's rule in words, with the baseline's tolerances (harness.orchestration.check.rule_text)


# ---- sweep ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRow:
    point: SweepPoint
    ppl: float
    delta: DeltaPPL | None
    substitution_rate: float | None
    substituted_mass: float | None
    fetches_per_token: float | None
    est_ms_per_token: float | None  # cost model estimate, not a measurement


@dataclass(frozen=True)
class MassHypothesis:
    correlation: Correlation | None
    n_points: int
    note: str


@dataclass(frozen=True)
class SweepResult:
    options: SweepOptions
    full_ppl: float | None
    rows: tuple[SweepRow, ...]
    frontier: tuple[str, ...]  # point names on the quality/speed Pareto frontier
    mass: MassHypothesis
    results_path: Path
    n_run: int
    n_resumed: int
    interrupted: bool
    warnings: tuple[str, ...]


# ---- frontier ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrontierRow:
    """One policy at one residency of `harness frontier`. Bytes are per decoded token, from the emulate run's
    counters: synchronous fetches and background admissions times the bytes of one expert (host computes move
    none). `est_ms_per_token` is the cost model's estimate, not a measurement."""

    point: SweepPoint
    ppl: float
    delta: DeltaPPL | None
    hit_rate: float | None
    substitution_rate: float | None
    substituted_mass: float | None
    fetches_per_token: float | None
    sync_bytes: float | None  # synchronous fetches x expert bytes, per token
    background_bytes: float | None  # background admissions x expert bytes, per token
    host_computes_per_token: float | None
    est_ms_per_token: float | None

    @property
    def bytes_moved(self) -> float | None:
        if self.sync_bytes is None or self.background_bytes is None:
            return None
        return self.sync_bytes + self.background_bytes


@dataclass(frozen=True)
class BoundCell:
    """Of one family at one residency, the row with the fewest bytes moved per token whose delta-PPL (point
    estimate) is at most `bound` percent; None when no row of the family meets it."""

    family: str
    fraction: float
    bound: float
    row: FrontierRow | None


@dataclass(frozen=True)
class PresetCheck:
    """Is a preset on the Pareto frontier (delta-PPL vs estimated time) at a residency; if not, who dominates it."""

    preset: str
    fraction: float
    name: str  # the point's name; "" when the preset did not run
    on_frontier: bool
    dominated_by: tuple[str, ...]


@dataclass(frozen=True)
class FrontierResult:
    options: FrontierOptions
    full_ppl: float | None
    bytes_per_expert: int
    rows: tuple[FrontierRow, ...]
    frontier: dict[float, tuple[str, ...]]  # per residency: names on the delta-PPL / est. time frontier
    bytes_frontier: dict[float, tuple[str, ...]]  # per residency: names on the delta-PPL / bytes moved frontier
    table: tuple[BoundCell, ...]
    presets: tuple[PresetCheck, ...]
    results_path: Path
    n_run: int
    n_resumed: int
    interrupted: bool
    warnings: tuple[str, ...]


# ---- topics -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopicRow:
    label: str  # "<policy> vs full", "<policy> admit=off vs full", "admission effect"
    overall: DeltaPPL
    after_change: DeltaPPL | None
    elsewhere: DeltaPPL | None


@dataclass(frozen=True)
class TopicResult:
    options: TopicOptions
    n_boundaries: int
    n_scored: int
    n_after_change: int
    rows: tuple[TopicRow, ...]
    results_path: Path
    warnings: tuple[str, ...]


# ---- study ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudyResult:
    options: StudyOptions
    compare: CompareResult
    pairs: dict[str, DeltaPPL]  # "a vs b" -> paired delta of a against b
    sweep: SweepResult
    topics: TopicResult | None
    topics_note: str
    verdicts: tuple[Verdict, ...]
    frontier: FrontierResult | None = None
    frontier_note: str = ""
    matched: MatchedResult | None = None  # the matched runs of findings 1 and 1/3
    matched_note: str = ""
    header: tuple[str, ...] = ()  # the text's chunks and domains, for the report's header
    admission_pairs: tuple[AdmissionPair, ...] = ()  # finding 2's admission on/off pairs, within each tau
    domain_rows: tuple[DomainRow, ...] = ()  # the paired comparisons per domain of the text
    domain_note: str = ""  # why there are none


# ---- simulate ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimRow:
    """One policy at one residency. `est_*` are cost-model ESTIMATES (profile `profile`), not measurements."""

    policy: str
    residency: str  # as requested ("25%", or a slot count)
    slots: int  # per MoE layer, as the cache resolved it
    n_expert: int
    tokens: int  # token-layers / MoE layers
    hit_rate: float
    fetches_per_token: float  # summed over MoE layers of each layer's fetches per token it decided (per_token)
    substitution_rate: float
    substituted_mass: float  # mean substituted gate mass per token-layer
    admissions_per_token: float
    profile: str
    est_ms_per_token: float
    est_fetch_all_ms: float  # fetch-every-miss at the same residency
    est_stock_ms: float  # stock llama.cpp with the same device memory
    stock_gpu_moe_layers: int
    replay_decisions_per_s: float | None = None

    @property
    def est_speedup_vs_fetch_all(self) -> float:
        return self.est_fetch_all_ms / self.est_ms_per_token

    @property
    def est_speedup_vs_stock(self) -> float:
        return self.est_stock_ms / self.est_ms_per_token


# ---- doctor -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildStatus:
    name: str
    present: bool
    backend: str
    bin_dir: str
    version: str
    identifies_as_patched: bool


@dataclass(frozen=True)
class Diagnosis:
    pin: str
    pin_sha256: str
    patch_series: str
    n_patches: int
    source_unpacked: bool
    builds: tuple[BuildStatus, ...]
    gpus: tuple[str, ...]
    nvcc: str
    python: str
    host_ram_bytes: int
    cpu_count: int
    problems: tuple[str, ...]
