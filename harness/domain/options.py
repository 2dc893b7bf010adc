"""The options of the commands that measure: what a run of compare, sweep, topics or study was asked to do.

Each extends `PerplexitySettings` (text, n_ctx, n_batch, chunks, threads), declared once there. How options
are written into and read back from a results folder's meta record is `harness.orchestration.serialise`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.core.sizes import Size
from harness.domain.catalogue import DEFAULT_POLICIES, FRONTIER_FAMILIES, FRONTIER_FRACTIONS, SWEEP_RULES, SWEEP_TAUS
from harness.domain.settings import PerplexitySettings


@dataclass(frozen=True)
class CompareOptions(PerplexitySettings):
    """`text` None: the held-out text (compare) or no quality runs (run_compare)."""

    out: Path
    model: Path | None = None  # None: the project's trained model (default_model)
    vram: Size | None = None  # None: the budget that keeps DEFAULT_RESIDENCY of the experts resident
    ram: Size | None = None  # a RAM limit (bytes): every run inside a memory cgroup of it, the engine with host=file
    policies: tuple[str, ...] = DEFAULT_POLICIES
    dataset: str | None = None  # a named dataset instead of --text (only from a local file)
    runs: int = 5
    n_prompt: int = 512
    n_gen: int = 128
    reserve_bytes: int = 0  # device memory kept for KV cache and compute buffers (--ram: vram_reserve, 0: 256 MiB)
    speed: bool = True
    quality: bool = True
    bench_cache_mode: str = "engine"
    n_boot: int = 2000
    seed: int = 0
    profile: str | None = "rtx3090"  # hardware profile for speed estimates when there is no GPU (None: none)
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class SweepGrid:
    rules: tuple[str, ...] = SWEEP_RULES
    taus: tuple[float, ...] = SWEEP_TAUS  # only for the threshold rule
    admits: tuple[str, ...] = ("off", "0.5")  # "off" or a beta
    evicts: tuple[str, ...] = ("lfu",)
    fractions: tuple[float, ...] = (0.25,)  # resident share of each layer's experts


@dataclass(frozen=True)
class SweepOptions(PerplexitySettings):
    """`text` None: the held-out text."""

    out: Path
    model: Path | None = None  # None: the project's trained model
    grid: SweepGrid = SweepGrid()
    n_boot: int = 2000
    seed: int = 0
    profile: str = "rtx3090"  # hardware profile for the time-per-token estimates
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrontierGrid:
    """The knobs of `harness frontier`, per family (catalogue.FRONTIER_FAMILIES); validated against the model by
    harness.orchestration.frontier.frontier_points."""

    families: tuple[str, ...] = tuple(FRONTIER_FAMILIES)
    fractions: tuple[float, ...] = FRONTIER_FRACTIONS  # resident share of each layer's experts
    taus: tuple[float, ...] = (0.05, 0.1, 0.15, 0.25)  # ours: thresholds of the threshold rule
    admits: tuple[str, ...] = ("off", "0.5")  # ours: admission, "off" or a beta
    evicts: tuple[str, ...] = ("lru", "lfu", "classlru")  # fetch-all: evictions
    j: tuple[int, ...] = (1, 2)  # cache-route: ranks always computed, in [0, k]
    m: tuple[str, ...] = ("auto", "4k")  # cache-route: the window of router ranks in [k, n_expert], xk or auto (2k)
    alpha: tuple[float, ...] = (1.0, 0.5)  # cache-route: substitutes' weight scale, in [0, 1]
    zero_taus: tuple[float, ...] = (0.03, 0.1, 0.2)  # zero: thresholds, in [0, 1]
    renorms: tuple[str, ...] = ("off", "on")  # zero, ser
    kmins: tuple[int, ...] = (1, 2)  # ser: ranks always run, in [1, k]
    ts: tuple[float, ...] = (0.1, 0.3)  # ser: ratio to rank 0's weight, in [0, 1]


@dataclass(frozen=True)
class FrontierOptions(PerplexitySettings):
    """`text` None: the held-out text."""

    out: Path
    model: Path | None = None
    grid: FrontierGrid = FrontierGrid()
    n_boot: int = 2000
    seed: int = 0
    profile: str = "rtx3090"  # hardware profile for the time-per-token estimates
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class TopicOptions(PerplexitySettings):
    """`text` None: eval/data/topic-shift.txt (segments: the .json next to it)."""

    out: Path
    model: Path | None = None
    tokenizer: Path | None = None  # default: the one *tokenizer.json in models/
    policy: str = "quality"
    fraction: float = 0.25
    window: int = 256
    n_boot: int = 2000
    seed: int = 0
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class StudyOptions(PerplexitySettings):
    out: Path
    model: Path | None = None
    chunks: int | None = field(default=32, kw_only=True)
    residency: float = 0.25
    topics: bool = True
    frontier: bool = True  # the side-by-side frontier at the residency and half of it
    composition: bool = True  # finding 3: Experiment B (harness composition)
    generation: bool = True  # the generation test (harness generate)
    matched: bool = True  # the matched runs of findings 1 and 1/3 (harness.orchestration.study_matched)
    calib_text: Path | None = None  # their calibration text (None: heldout-docs.txt for the whole text)
    tokenizer: Path | None = None
    seed: int = 0
    argv: tuple[str, ...] = ()
