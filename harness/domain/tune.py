"""`harness tune`: its options, its search space, the rules of its search, its result, and the tuned profile that
`--moe-cache auto` reads (docs/expert-cache.md, "Tuned profile"). Pure: no files are read here, no process runs.

The search space is two kinds of knobs:

- a **rung**: the miss rule and its threshold, which set how much gate weight a miss may lose. Rungs form two
  chains ordered by how much they lose: `substitute` (fetch-all, the threshold rule over `taus` ascending,
  first-choice) and `drop` (fetch-all, colibri's `zero` rule over `zero_taus` ascending: the `drop-light` family).
  Rung 0 of both chains is fetch-all, which never substitutes or drops: exact, the full model's output.
- **speed knobs**: admission, eviction and prefetch, which change what is resident (hits and misses) and what
  moves in the background, and so how often a rung's rule substitutes or drops.

The simulator gives every candidate (rung x speed knobs x residency) an estimated decode time and the gate weight it
loses; per rung, of the speed knobs within 1% of its fastest estimate, those that lose the least stand for it
(`best_per_rung`). Along each chain the delta-PPL grows with the rung (the
assumption the search rests on, the study's mass hypothesis within one rule), so the most aggressive rung within
the bound is found by bisection (`bisect_chain`): a handful of emulate runs instead of one per grid point. The
choice is then the fastest estimate among the rungs at or below each chain's boundary, checked in emulate itself
(`pick_fastest`); a rung whose estimate is within the measurement error of the fastest's (their spans over the
decode measurement's 95% CI overlap) and that loses less gate weight is taken instead.

The decode rate the estimates rest on is measured as pyperf would (`SpeedCheck`): a discarded warm-up process, then
`SPEED_RUNS` processes (the process is the sample), and the coefficient of variation of their tokens/s against
`SPEED_CV_WARN`; above it the round is run again once, and a second unstable round is recorded as unstable in the
profile and the report (`stability_line` says so in one line each time).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.domain.costmodel import Profile, TokenWork, estimate
from harness.domain.plan import slots_for_residency
from harness.domain.settings import PerplexitySettings
from harness.parsers.gguf_model import ModelInfo
from harness.stats.intervals import CV_WARN, DeltaPPL, MeanCI, mean_ci

TUNE_SCHEMA = "moe-subst/tune-profile"
TUNE_SCHEMA_VERSION = 1
PROFILE_SUFFIX = ".moe-tune.json"  # <model file name> + this next to the model, + .<fingerprint> + this in the cache
HOSTS = ("file", "ram")  # where a miss is read from: the model file (host=file) or host memory
EVICTS = ("lfu", "lru", "classlru")
PREFETCH = ("off", "on")
CHAINS = ("substitute", "drop")
TUNE_PRESETS = ("quality", "speed", "fetch-all")  # the table's comparison
# the spec keys a profile's policy may hold (docs/expert-cache.md, "Tuned profile"); tune writes the first five
POLICY_KEYS = ("rule", "tau", "evict", "admit", "prefetch", "tau_file", "halve")


@dataclass(frozen=True)
class TuneGrid:
    fractions: tuple[float, ...] = (0.25,)  # residencies: resident share of each layer's experts
    # the substitute chain: the threshold rule. Dense below 0.1: with top-10 routing a token's gate weights average
    # 0.1, and on studymoe (512 experts, top-10) the loss rose from +0.00% at tau 0.05 to +1.28% at 0.1 with fetches
    # per token falling from 11.8 to 2.8 (eval/tune-studymoe, first run): the bound usually falls in that step.
    taus: tuple[float, ...] = (0.05, 0.065, 0.08, 0.1, 0.15, 0.25, 0.4)
    first_choice: bool = True  # the substitute chain ends with first-choice (every non-first miss substituted)
    zero_taus: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3)  # the drop chain: the zero rule's thresholds
    admits: tuple[str, ...] = ("off", "0.5")
    evicts: tuple[str, ...] = EVICTS
    prefetch: tuple[str, ...] = PREFETCH


@dataclass(frozen=True)
class TuneOptions(PerplexitySettings):
    out: Path
    model: Path | None = None  # None: the project's trained model
    max_delta_pct: float = 1.0  # the bound on delta-PPL%, on its point estimate (strict: on its 95% CI's upper end)
    check_text: Path | None = None  # out of sample: the choice (chosen on the text) judged on this text too
    strict: bool = False
    grid: TuneGrid = TuneGrid()
    host: str | None = None  # None: file on a machine without a GPU, ram with one
    base_profile: str = "cpu-disk"  # the cost model's constants this machine's measurements do not replace
    readers: int = 4  # the engine's reader threads (host=file): the disk is measured with as many
    measure: bool = False  # llama-bench with the engine for the choice and the presets
    measure_grid: int = 0  # --measure: also the N fastest estimated grid points within the bound (verifies the choice)
    runs: int = 5  # --measure: llama-bench processes per configuration (the process is the sample); SPEED_RUNS
    n_gen: int = 32  # --measure: decoded tokens per repetition
    profile_out: Path | None = None  # None: next to the model, else the cache folder (profile_locations)
    n_boot: int = 2000
    seed: int = 0
    argv: tuple[str, ...] = ()
    chunks: int | None = field(default=32, kw_only=True)


# ---- the search space ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rung:
    chain: str  # CHAINS; "" for fetch-all, which starts both chains
    rule: str
    tau: float | None
    level: int  # 0 = fetch-all (exact); higher loses more gate weight

    @property
    def name(self) -> str:
        return self.rule + (f" tau={self.tau:g}" if self.tau is not None else "")

    @property
    def exact(self) -> bool:
        return self.rule == "fetch-all"


FETCH_ALL = Rung("", "fetch-all", None, 0)


def chain_rungs(grid: TuneGrid, chain: str) -> list[Rung]:
    """A chain's rungs, least loss first, fetch-all first."""
    if chain == "substitute":
        out = [Rung(chain, "threshold", t, i + 1) for i, t in enumerate(sorted(set(grid.taus)))]
        if grid.first_choice:
            out.append(Rung(chain, "first-choice", None, len(out) + 1))
    elif chain == "drop":
        out = [Rung(chain, "zero", t, i + 1) for i, t in enumerate(sorted(set(grid.zero_taus)))]
    else:
        raise HarnessError(f"unknown chain {chain!r}")
    return [FETCH_ALL, *out]


@dataclass(frozen=True)
class Candidate:
    rung: Rung
    admit: str
    evict: str
    prefetch: str
    fraction: float
    slots: int

    def policy_items(self) -> tuple[tuple[str, str], ...]:
        """The policy's spec keys, in the order a user writes them (no mode, residency or tier)."""
        items: list[tuple[str, str]] = [("rule", self.rung.rule)]
        if self.rung.tau is not None:
            items.append(("tau", f"{self.rung.tau:g}"))
        items += [("evict", self.evict), ("admit", self.admit)]
        if self.prefetch != "off":
            items.append(("prefetch", self.prefetch))
        return tuple(items)

    @property
    def policy(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.policy_items())

    @property
    def name(self) -> str:
        return f"{self.policy} slots={self.slots}"

    def sim_spec(self) -> str:
        return f"{self.policy},slots={self.slots}"


def residency_label(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def check_grid(grid: TuneGrid, info: ModelInfo) -> None:
    """Every value in the range the policy accepts; the first one outside is one line naming it."""
    if not grid.fractions:
        raise HarnessError("tune: no residencies")
    for f in grid.fractions:
        if not 0 < f <= 1:
            raise HarnessError(f"tune: residency {f * 100:g}% is outside (0, 100]%")
    for key, values in (("--taus", grid.taus), ("--zero-taus", grid.zero_taus)):
        for t in values:
            if not 0 < t <= 1:
                raise HarnessError(f"tune: {key} value {t:g} is outside (0, 1] (a gate weight)")
    for a in grid.admits:
        if a not in ("off", "on"):
            try:
                if not float(a) > 0:
                    raise ValueError
            except ValueError:
                raise HarnessError(f"tune: admission {a!r} is not accepted: use off, on, or a beta > 0") from None
    for opt, words, accepted in (("--evicts", grid.evicts, EVICTS), ("--prefetch", grid.prefetch, PREFETCH)):
        bad = [w for w in words if w not in accepted]
        if bad or not words:
            raise HarnessError(f"tune: {opt} {','.join(bad) or '(none)'} is not accepted: use {', '.join(accepted)}")
    if not grid.admits:
        raise HarnessError("tune: no admissions")


def tune_candidates(grid: TuneGrid, info: ModelInfo) -> list[Candidate]:
    """Every candidate of the grid: per residency, every rung with every speed knob (fetch-all substitutes nothing,
    so admission is moot there: admit=off only). Slots: slots_for_residency, at least k."""
    check_grid(grid, info)
    out: dict[str, Candidate] = {}
    for f in grid.fractions:
        slots = slots_for_residency(f, info.n_expert, info.n_expert_used)
        rungs = dict.fromkeys([*chain_rungs(grid, "substitute"), *chain_rungs(grid, "drop")])
        for rung in rungs:
            admits = ("off",) if rung.exact else grid.admits
            for evict in grid.evicts:
                for admit in admits:
                    for pf in grid.prefetch:
                        c = Candidate(rung, admit, evict, pf, f, slots)
                        out.setdefault(c.name, c)
    return list(out.values())


# ---- a measured speed and its stability ------------------------------------------------------------------------

SPEED_RUNS = 5  # processes per speed measured (the process is the sample), after one discarded warm-up process
SPEED_CV_WARN = CV_WARN  # pyperf's rule: a standard deviation above 10% of the mean is an unstable measurement


def speed_cv(samples: Sequence[float]) -> float:
    """The coefficient of variation of repeated measurements: sample standard deviation / mean; nan with fewer than
    two samples or a mean of 0 (no spread can be told)."""
    n = len(samples)
    if n < 2:
        return math.nan
    mean = sum(samples) / n
    if mean == 0:
        return math.nan
    return math.sqrt(sum((x - mean) ** 2 for x in samples) / (n - 1)) / abs(mean)


def is_stable(samples: Sequence[float], threshold: float = SPEED_CV_WARN) -> bool:
    """pyperf's rule: the CV at or below `threshold`; fewer than two samples are never stable (the CV is unknown)."""
    cv = speed_cv(samples)
    return math.isfinite(cv) and cv <= threshold


@dataclass(frozen=True)
class SpeedCheck:
    """A decode speed measured in repeated processes after a discarded warm-up process: tokens/s of each process of
    the round used, and, when the first round's CV was above SPEED_CV_WARN and it was run again, the first round's
    (the re-run's samples are the measurement)."""

    what: str
    samples: tuple[float, ...]
    first: tuple[float, ...] = ()

    @property
    def ci(self) -> MeanCI:
        return mean_ci(self.samples)

    @property
    def cv(self) -> float:
        return speed_cv(self.samples)

    @property
    def rerun(self) -> bool:
        return bool(self.first)

    @property
    def stable(self) -> bool:
        return is_stable(self.samples)


def cv_label(cv: float) -> str:
    return f"{cv * 100:.1f}%" if math.isfinite(cv) else "unknown (fewer than 2 runs)"


def stability_line(checks: Sequence[SpeedCheck], again: bool) -> str:
    """The one-line warning for the checks found unstable: after the first round (`again` False: they are measured
    again) or after the re-run (`again` True: recorded as unstable). Names each one's CV."""
    what = "; ".join(f"{c.what}: CV {cv_label(c.cv)} over {len(c.samples)} runs" for c in checks)
    if not again:
        return (f"unstable decode measurement ({what}; above {SPEED_CV_WARN * 100:g}%, pyperf's rule): the machine is "
                "busy or its speed changes; measuring again")
    return (f"still unstable after a re-run ({what}; above {SPEED_CV_WARN * 100:g}%): the choice rests on an UNSTABLE "
            "measurement, recorded as such in the profile and the report; tune again on an idle machine")


def compute_ms_span(samples: Sequence[float]) -> tuple[float, float, float]:
    """The decode time per token from repeated processes' tokens/s: (1000 / their mean, and the ends of its 95% CI:
    1000 / the CI's upper end, 1000 / its lower end); a lower end at or below 0 (a very unstable measurement) is
    replaced by the slowest process. One sample: no interval, the point three times."""
    ci = mean_ci(samples)
    ms = 1000.0 / ci.mean
    if ci.n < 2:
        return ms, ms, ms
    return ms, 1000.0 / ci.high, 1000.0 / (ci.low if ci.low > 0 else min(samples))


# ---- what the simulator says of a candidate -------------------------------------------------------------------

@dataclass(frozen=True)
class SimPoint:
    """A candidate replayed by llama-moe-sim: per decoded token (simulate.per_token) its synchronous fetches and
    its background loads (admissions and prefetches), the gate weight it loses per token-layer (substituted plus
    dropped), the hit rate, and the cost model's estimated ms per token (an ESTIMATE); `est_span`: the estimate at
    the two ends of the decode measurement's 95% CI (None: no interval, the point)."""

    candidate: Candidate
    fetches: float
    background: float
    lost_mass: float
    hit_rate: float
    est_ms: float
    est_span: tuple[float, float] | None = None

    @property
    def est_tps(self) -> float:
        return 1000.0 / self.est_ms

    @property
    def span(self) -> tuple[float, float]:
        lo, hi = self.est_span or (self.est_ms, self.est_ms)
        return min(lo, hi, self.est_ms), max(lo, hi, self.est_ms)


def within_error(a: SimPoint, b: SimPoint) -> bool:
    """Two estimates within their measurement error of each other: their spans over the decode measurement's 95% CI
    overlap (without an interval: equal estimates)."""
    (alo, ahi), (blo, bhi) = a.span, b.span
    return alo <= bhi and blo <= ahi


def sim_work(info: ModelInfo, fetches: float, background: float) -> TokenWork:
    """The cost model's work of a decoded token (costmodel.cache_work's terms): background loads, admissions and
    prefetches alike, overlap the compute."""
    bpe = info.bytes_per_expert
    return TokenWork(n_layers=info.n_layers,
                     resident_bytes=info.non_expert_bytes + info.n_expert_used * bpe * info.n_moe_layers,
                     fetch_bytes=fetches * bpe, fetch_ops=fetches, sync_layers=info.n_moe_layers,
                     admit_bytes=background * bpe)


def estimate_ms(profile: Profile, info: ModelInfo, fetches: float, background: float) -> float:
    return estimate(profile, sim_work(info, fetches, background)).ms_per_token


KNOB_TOLERANCE = 0.01  # speed knobs within 1% of a rung's fastest estimate are as fast (the cost model's resolution)


def best_per_rung(points: Sequence[SimPoint], fraction: float,
                  tolerance: float = KNOB_TOLERANCE) -> dict[Rung, SimPoint]:
    """Per rung at a residency, the speed knobs that stand for it: of those within `tolerance` of the rung's fastest
    estimate, the one that loses the least gate weight (the knobs change what is resident, and so how often the rule
    substitutes or drops: on the trained model prefetch halved the zero rule's dropped mass at 0.25% of the speed),
    then the faster, the fewer background loads, admission and prefetch off, the name."""
    by_rung: dict[Rung, list[SimPoint]] = {}
    for p in points:
        if p.candidate.fraction == fraction:
            by_rung.setdefault(p.candidate.rung, []).append(p)
    best: dict[Rung, SimPoint] = {}
    for rung, pts in by_rung.items():
        fastest = min(p.est_ms for p in pts)
        near = [p for p in pts if p.est_ms <= fastest * (1 + tolerance)]
        best[rung] = min(near, key=lambda p: (p.lost_mass, p.est_ms, p.background, p.candidate.admit != "off",
                                              p.candidate.prefetch != "off", p.candidate.name))
    return best


BOUND_ON = {False: "point estimate", True: "95% CI upper end"}


def within_bound(delta: DeltaPPL | None, bound_pct: float, strict: bool = False) -> bool:
    """The bound holds on the paired delta-PPL's point estimate (its 95% CI is reported beside it), or with `strict`
    on the CI's upper end (a choice the data cannot tell from one over the bound is refused)."""
    if delta is None:
        return False
    v = delta.high if strict else delta.delta_pct
    return math.isfinite(v) and v <= bound_pct


def bisect_chain(rungs: Sequence[Rung], passes: Callable[[Rung], bool]) -> int:
    """The index of the most aggressive rung of a chain (least loss first, rung 0 exact) that `passes`, assuming
    that the loss grows along the chain: the last rung first (often the one that answers when the bound is loose),
    then bisection. `passes` is called at most 1 + ceil(log2(len - 1)) times, never for rung 0."""
    if not rungs:
        raise HarnessError("an empty chain")
    lo, hi = 0, len(rungs) - 1
    if hi == 0 or passes(rungs[hi]):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(rungs[mid]):
            lo = mid
        else:
            hi = mid
    return lo


def pick_fastest(best: Mapping[Rung, SimPoint], boundaries: Mapping[str, int], grid: TuneGrid,
                 passes: Callable[[Rung], bool], loss: Callable[[Rung], float | None] | None = None) -> SimPoint:
    """The fastest estimate among the rungs at or below each chain's boundary, confirmed by `passes` (a rung that
    fails, against the chain's order, is dropped and the next fastest tried); fetch-all, exact, when none is left.
    Then, of the rungs within the measurement error of that one (`within_error`), the one that loses the least and
    passes: a speed the measurement cannot tell apart is not worth the loss.

    The loss: with `loss` (a rung's measured delta-PPL% once `passes` has run it; fetch-all's is 0), the measured
    one, so that rules that lose gate weight differently are compared by what they cost (issue 37: the zero rule lost
    less gate weight than the threshold rule and cost +0.49% against +0.25%); every rung within the error is then
    checked. Without it, the gate weight the simulator counts (`lost_mass`), and only rungs losing less than the
    fastest are checked."""
    pool: list[SimPoint] = []
    for chain, b in boundaries.items():
        pool += [best[r] for r in chain_rungs(grid, chain)[: b + 1] if r in best]
    pool = sorted(dict.fromkeys(pool), key=lambda p: (p.est_ms, p.candidate.rung.level, p.candidate.name))
    fastest = next((p for p in pool if p.candidate.rung.exact or passes(p.candidate.rung)), None)
    if fastest is None:
        raise HarnessError("tune: no candidate left, not even fetch-all (was it simulated?)")
    by_mass = sorted(pool, key=lambda p: (p.lost_mass, p.est_ms, p.candidate.rung.level, p.candidate.name))
    if loss is None:
        for p in by_mass:
            if p.lost_mass >= fastest.lost_mass:
                break
            if within_error(p, fastest) and (p.candidate.rung.exact or passes(p.candidate.rung)):
                return p
        return fastest

    def measured(p: SimPoint) -> float | None:
        return 0.0 if p.candidate.rung.exact else loss(p.candidate.rung)

    chosen, chosen_loss = fastest, measured(fastest)
    for p in by_mass:
        if p is fastest or not within_error(p, fastest):
            continue
        if not (p.candidate.rung.exact or passes(p.candidate.rung)):
            continue
        lp = measured(p)
        if lp is not None and (chosen_loss is None or lp < chosen_loss):
            chosen, chosen_loss = p, lp
    return chosen


def within_bound_points(points: Sequence[SimPoint], fraction: float, boundaries: Mapping[str, int], grid: TuneGrid,
                        failed: Collection[Rung]) -> list[SimPoint]:
    """Every grid point at a residency (all its speed knobs, not only each rung's best) whose rung is at or below its
    chain's boundary and was not found over the bound when checked, fastest estimate first: the pool the choice is
    the fastest rung of, for --measure-grid to measure the choice against."""
    rungs: set[Rung] = {FETCH_ALL}
    for chain, b in boundaries.items():
        rungs.update(chain_rungs(grid, chain)[: b + 1])
    pool = [p for p in points if p.candidate.fraction == fraction and p.candidate.rung in rungs
            and p.candidate.rung not in failed]
    return sorted(pool, key=lambda p: (p.est_ms, p.candidate.name))


def grid_verdict(chosen: MeanCI | None, grid: Sequence[MeanCI | None], within: float = 0.05) -> str:
    """The issue's goal on measured speed: the choice within `within` of the fastest measured grid point at the bound
    (the grid points measured: the fastest estimates). 'held', 'did not hold', or why it cannot be said."""
    speeds = [m.mean for m in grid if m is not None]
    if chosen is None or not speeds:
        return "not measured"
    best = max(speeds + [chosen.mean])
    return "held" if chosen.mean >= (1 - within) * best else "did not hold"


def tuned_policy(profile: TuneProfile | None, planned_slots: int, source: str = "") -> tuple[str, str]:
    """What `--moe-cache auto` does with a (read and model-checked) profile when it planned `planned_slots` per layer
    (docs/expert-cache.md, "Tuned profile", steps 4 and 6): (the policy's spec keys, or "" for quality; the reason for
    its one log line). The reference the C++ reader follows."""
    if profile is None:
        return "", "policy quality (no tuned profile)"
    ok = [c for c in profile.choices if c.slots <= planned_slots]
    if not ok:
        tuned = ", ".join(f"{c.residency} ({c.slots} slots)" for c in profile.choices)
        return "", (f"policy quality (the tuned profile {source} was tuned at {tuned}, more than the {planned_slots} "
                    "slots planned)")
    c = max(ok, key=lambda c: c.slots)
    return c.policy, (f"policy {c.policy} (tuned {profile.created}: delta-PPL {c.delta_pct:+.2f}% [{c.ci_low:+.2f}, "
                      f"{c.ci_high:+.2f}] <= {profile.bound_pct:g}% on the {profile.bound_on} at {c.residency})")


def auto_policy(text: str | None, source: str, mine: ModelIdentity, planned_slots: int) -> tuple[str, str]:
    """Steps 2-4 and 6 of what `--moe-cache auto` does with the tuned profile found at `source` (its text; None: none
    was found) when it planned `planned_slots` per layer: (the policy's spec keys, or "" for quality; the reason its
    plan line ends with). A damaged profile or another model's is not used: quality, and the reason says why. The
    reference that the C++ reader (src/llama/llama-expert-tuned.cpp) is tested against (tests/test_tuned.py)."""
    if text is None:
        return tuned_policy(None, planned_slots)
    try:
        p = parse_tune_profile(text, source)
        check_profile_model(p, mine, source)
    except HarnessError as e:
        return "", f"policy quality ({e})"
    return tuned_policy(p, planned_slots, source)


# ---- the machine ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MachineFacts:
    """What `harness tune` measured (harness.tools.machine) or read of this machine."""

    cpus: int
    mem_total: int
    mem_available: int
    gpus: tuple[str, ...]
    disk_path: str  # the file read: the model
    disk_expert_bytes: int  # one expert: its slices of its layer's expert tensors
    disk_read_bytes: int  # one read: one expert's slice of one expert tensor (the engine's read size)
    disk_readers: int  # reader threads, as the engine's readers=
    disk_direct: bool  # O_DIRECT (else buffered reads from a dropped page cache)
    disk_expert_us: float  # time per expert read, effective over all readers (wall time / experts)
    disk_gbs: float  # disk_expert_bytes / disk_expert_us: the rate a fetch from the file gets
    host_copy_gbs: float  # a memcpy of expert-sized blocks in host memory
    compute_ms_per_token: float | None  # decode with every weight in memory, the cache off (llama-bench tg)


def machine_profile(facts: MachineFacts, info: ModelInfo, base: Profile, host: str) -> tuple[Profile, dict[str, str]]:
    """The cost model's profile of this machine: the base profile's constants, with those it measured in their
    place, and where each came from. Without a GPU the banks are in RAM, so the compute rate is the decode's
    (every weight of a token read once per token, less the base's fixed time per layer) and stands for both the
    device's and the host's; the link is the disk (host=file) or a host memcpy (host=ram). With a GPU only the
    host side is measured here: the device's constants and its link stay the base's (said in the sources)."""
    values: dict[str, float] = {}
    src: dict[str, str] = {}
    if facts.compute_ms_per_token is not None and facts.compute_ms_per_token > 0:
        ms = facts.compute_ms_per_token
        fixed_ms = info.n_layers * base.layer_fixed_us * 1e-3
        layer_fixed = base.layer_fixed_us
        if fixed_ms > 0.5 * ms:  # the base's fixed time alone would exceed half the measurement: scale it down
            layer_fixed = 0.5 * ms / info.n_layers * 1e3
            fixed_ms = 0.5 * ms
            src["layer_fixed_us"] = "half the measured decode time per token, per layer (the base's was more)"
        values["layer_fixed_us"] = layer_fixed
        resident = info.non_expert_bytes + info.n_expert_used * info.bytes_per_expert * info.n_moe_layers
        gbs = resident / ((ms - fixed_ms) * 1e-3) / 1e9
        if not facts.gpus:
            values["vram_bw_gbs"] = gbs
            src["vram_bw_gbs"] = (f"measured: decode of the model in memory with the cache off, {ms:.3f} ms per "
                                  f"token, less {layer_fixed:.0f} us per layer")
        values["cpu_bw_gbs"] = gbs
        src["cpu_bw_gbs"] = "measured: as vram_bw_gbs (the host computes)" if not facts.gpus else \
            f"measured: decode in memory, {ms:.3f} ms per token"
    if host == "file":
        values["h2d_bw_gbs"] = facts.disk_gbs
        values["fetch_latency_us"] = 0.0
        how = f"{'O_DIRECT' if facts.disk_direct else 'buffered'} reads of {facts.disk_read_bytes} B"
        src["h2d_bw_gbs"] = (f"measured: random experts of the model file, {how}, {facts.disk_readers} readers (the "
                             f"engine's pattern): {facts.disk_expert_us:.1f} us per expert of "
                             f"{facts.disk_expert_bytes} B")
        src["fetch_latency_us"] = ("0: the measured time per expert holds the reads' latency (a fetch is always one "
                                   "expert of this model)")
    elif not facts.gpus:
        values["h2d_bw_gbs"] = facts.host_copy_gbs
        values["fetch_latency_us"] = 1.0
        src["h2d_bw_gbs"] = "measured: memcpy of expert-sized blocks in host memory"
        src["fetch_latency_us"] = "assumed: a copy's setup in host memory, ~1 us"
    else:
        src["h2d_bw_gbs"] = f"the base profile's ({base.name}): the GPU's link is not measured by harness tune yet"
    if not facts.gpus:
        values["vram_bytes"] = facts.mem_total
        src["vram_bytes"] = "this machine's RAM (the banks are in RAM without a GPU)"
    prof = Profile(**{**asdict(base), **values, "name": "tuned", "description":
                      f"{base.name}'s constants with this machine's measurements (harness tune)"})
    return prof, src


# ---- the result -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckRow:
    """One configuration run in emulate mode (or exact by construction) at a residency: a checked candidate, the
    choice or a preset; with the simulator's estimate and, with --measure, llama-bench's decode speed."""

    role: str  # "checked", "chosen", a preset name, or "grid" (--measure-grid: measured, not run in emulate)
    name: str
    policy: str  # the policy's spec keys
    fraction: float
    slots: int
    est_ms: float
    delta: DeltaPPL | None  # paired against the full model; None: exact (nothing substituted or dropped) or failed
    exact: bool
    passes: bool
    measured: MeanCI | None = None  # tokens/s, llama-bench tg with the engine (--measure)
    note: str = ""

    @property
    def est_tps(self) -> float:
        return 1000.0 / self.est_ms


@dataclass(frozen=True)
class TuneChoice:
    """The choice at one residency, as the profile holds it."""

    residency: str  # "25%"
    fraction: float
    slots: int
    n_expert: int
    policy: str  # spec keys of the policy: what auto puts in place of policy=quality
    spec: str  # the whole spec to run it by hand (mode=engine, the tier, slots)
    delta_pct: float  # 0 for fetch-all (exact)
    ci_low: float
    ci_high: float
    est_tokens_per_s: float  # the simulator and the cost model: an ESTIMATE
    est_fetch_all_tokens_per_s: float
    est_quality_tokens_per_s: float | None
    measured_tokens_per_s: float | None = None  # --measure only


@dataclass(frozen=True)
class OutOfSample:
    """A configuration chosen (or preset) on the tune's text, judged on other text (`--check-text`): its paired
    delta-PPL there, and whether the bound holds there as the tune applies it."""

    residency: str
    role: str  # "chosen" or a preset
    policy: str
    text: str
    delta: DeltaPPL | None  # None: the two runs did not score the same tokens
    within_bound: bool


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    file_name: str
    file_bytes: int
    fingerprint: str  # 16 hex digits: harness.parsers.gguf_model.model_fingerprint
    n_expert: int
    n_expert_used: int
    n_moe_layers: int


@dataclass(frozen=True)
class TuneProfile:
    model: ModelIdentity
    bound_pct: float
    bound_on: str  # BOUND_ON's values
    host: str
    machine: MachineFacts
    cost_profile: dict[str, Any]  # the cost model's constants the estimates used (Profile's fields)
    choices: tuple[TuneChoice, ...]
    text: str
    n_ctx: int
    chunks: int | None
    created: str
    provenance: dict[str, str]  # pin, patch series
    speeds: tuple[SpeedCheck, ...] = ()  # the decode speeds measured in repeated processes, and their stability


@dataclass(frozen=True)
class TuneResult:
    opts: TuneOptions
    identity: ModelIdentity
    host: str
    machine: MachineFacts
    cost_profile: Profile
    cost_sources: dict[str, str]
    n_simulated: int
    frontier: tuple[SimPoint, ...]  # per residency, each rung's best speed knobs
    rows: tuple[CheckRow, ...]
    choices: tuple[TuneChoice, ...]
    profile_path: Path | None
    results_path: Path
    wall_s: float
    notes: tuple[str, ...]
    speeds: tuple[SpeedCheck, ...] = ()  # as TuneProfile.speeds
    out_of_sample: tuple[OutOfSample, ...] = ()  # --check-text: the choices judged on other text

    @property
    def stable(self) -> bool:
        return all(c.stable for c in self.speeds)


# ---- the profile file -----------------------------------------------------------------------------------------

def profile_locations(model: Path, cache_dir: Path, fingerprint: str) -> tuple[Path, Path, Path]:
    """Where a tuned profile of `model` (whose fingerprint is `fingerprint`, 16 hex digits) is looked for, in this
    order: next to the model (`<model file>.moe-tune.json`); in the user's cache folder keyed by the fingerprint
    (`<cache>/tune/<model file>.<fingerprint>.moe-tune.json`: two models of one file name have two profiles there);
    the cache folder's name-only path (`<cache>/tune/<model file>.moe-tune.json`, where harness tune wrote before the
    key: used only when its recorded model is this one, check_profile_model). harness tune writes the first or the
    second."""
    cached = cache_dir / "tune"
    return (model.with_name(model.name + PROFILE_SUFFIX), cached / f"{model.name}.{fingerprint}{PROFILE_SUFFIX}",
            cached / (model.name + PROFILE_SUFFIX))


def tune_cache_dir(environ: Mapping[str, str], home: Path) -> Path:
    """The user's cache folder, as build.sh and the datasets cache have it: $MOE_SUBST_CACHE, else
    $XDG_CACHE_HOME/moe-subst, else ~/.cache/moe-subst."""
    if environ.get("MOE_SUBST_CACHE"):
        return Path(environ["MOE_SUBST_CACHE"])
    xdg = environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else home / ".cache") / "moe-subst"


def profile_to_json(p: TuneProfile) -> str:
    d: dict[str, Any] = {"schema": TUNE_SCHEMA, "schema_version": TUNE_SCHEMA_VERSION, "created": p.created,
                         "model": asdict(p.model), "bound": {"max_delta_ppl_pct": p.bound_pct,
                                                              "on": p.bound_on},
                         "host": p.host, "choices": [asdict(c) for c in p.choices],
                         "machine": {**asdict(p.machine), "gpus": list(p.machine.gpus)},
                         "cost_profile": p.cost_profile,
                         "text": {"path": p.text, "n_ctx": p.n_ctx, "chunks": p.chunks},
                         "provenance": p.provenance}
    if p.speeds:
        d["stability"] = stability_to_json(p.speeds)
    return json.dumps(d, indent=1) + "\n"


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def stability_to_json(speeds: Sequence[SpeedCheck]) -> dict[str, Any]:
    """The profile's `stability`: whether every speed measured was stable, and each one's samples (tokens/s of each
    process), CV and first round when it was run again (docs/expert-cache.md, "Tuned profile")."""
    return {"cv_warn": SPEED_CV_WARN, "stable": all(c.stable for c in speeds),
            "speeds": [{"what": c.what, "tokens_per_s": list(c.samples), "cv": _finite(c.cv), "stable": c.stable,
                        "rerun": c.rerun, "first_tokens_per_s": list(c.first),
                        "first_cv": _finite(speed_cv(c.first)) if c.first else None} for c in speeds]}


def _stability_from_json(d: Any) -> tuple[SpeedCheck, ...]:
    """The profile's `stability` back as SpeedChecks; informational (auto does not read it): absent or not of its
    shape, none."""
    speeds = d.get("speeds") if isinstance(d, dict) else None
    if not isinstance(speeds, list):
        return ()
    out: list[SpeedCheck] = []
    for s in speeds:
        if not isinstance(s, dict):
            return ()
        samples, first = _numbers(s.get("tokens_per_s")), _numbers(s.get("first_tokens_per_s", []))
        if not isinstance(s.get("what"), str) or samples is None or first is None:
            return ()
        out.append(SpeedCheck(s["what"], samples, first))
    return tuple(out)


def _numbers(v: Any) -> tuple[float, ...] | None:
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return None
    return tuple(float(x) for x in v)


def _num(v: Any, what: str, *, none: bool = False) -> Any:
    if v is None and none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise HarnessError(f"{what} is {v!r}, not a finite number")
    return v


def _build(cls: Any, d: Any, what: str) -> Any:
    if not isinstance(d, dict):
        raise HarnessError(f"{what} is not an object")
    names = [f.name for f in fields(cls)]
    missing = [n for n in names if n not in d]
    if missing:
        raise HarnessError(f"{what} lacks {', '.join(missing)}")
    return cls(**{n: d[n] for n in names})


def parse_tune_profile(text: str, source: str) -> TuneProfile:
    """A profile file (profile_to_json's output); one line of HarnessError when it is not one."""
    try:
        d = json.loads(text)
    except ValueError as e:
        raise HarnessError(f"the tuned profile {source} is not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("schema") != TUNE_SCHEMA:
        raise HarnessError(f"{source} is not a tuned profile (schema {TUNE_SCHEMA!r})")
    if d.get("schema_version") != TUNE_SCHEMA_VERSION:
        raise HarnessError(f"the tuned profile {source} has schema_version {d.get('schema_version')!r}; this harness "
                           f"reads {TUNE_SCHEMA_VERSION}: run harness tune again")
    try:
        model = _build(ModelIdentity, d.get("model"), "model")
        mach = d.get("machine")
        machine = _build(MachineFacts, {**mach, "gpus": tuple(mach.get("gpus", ()))} if isinstance(mach, dict)
                         else mach, "machine")
        raw = d.get("choices")
        if not isinstance(raw, list) or not raw:
            raise HarnessError("choices is not a non-empty list")
        choices = tuple(_build(TuneChoice, c, f"choices[{i}]") for i, c in enumerate(raw))
        for i, c in enumerate(choices):
            _num(c.fraction, f"choices[{i}].fraction")
            _num(c.delta_pct, f"choices[{i}].delta_pct")
            _num(c.ci_low, f"choices[{i}].ci_low")
            _num(c.ci_high, f"choices[{i}].ci_high")
            _num(c.est_tokens_per_s, f"choices[{i}].est_tokens_per_s")
            if isinstance(c.slots, bool) or not isinstance(c.slots, int):
                raise HarnessError(f"choices[{i}].slots is {c.slots!r}, not an integer")
            keys = [item.partition("=")[0].strip() for item in c.policy.split(",")] if isinstance(c.policy, str) \
                else []
            if not keys or not all(k in POLICY_KEYS for k in keys) or len(set(keys)) != len(keys):
                raise HarnessError(f"choices[{i}].policy {c.policy!r} is not a policy's spec keys (once each, from "
                                   f"{', '.join(POLICY_KEYS)})")
        bound = d.get("bound")
        txt = d.get("text")
        if not isinstance(bound, dict) or not isinstance(txt, dict):
            raise HarnessError("bound or text is not an object")
        if bound.get("on") not in BOUND_ON.values():
            raise HarnessError(f"bound.on is {bound.get('on')!r}, not one of {', '.join(BOUND_ON.values())}")
        return TuneProfile(model, float(_num(bound.get("max_delta_ppl_pct"), "bound.max_delta_ppl_pct")),
                           str(bound["on"]), str(d.get("host")), machine, dict(d.get("cost_profile") or {}), choices,
                           str(txt.get("path")), int(txt.get("n_ctx") or 0), txt.get("chunks"),
                           str(d.get("created")), dict(d.get("provenance") or {}),
                           _stability_from_json(d.get("stability")))
    except HarnessError as e:
        raise HarnessError(f"the tuned profile {source} is damaged: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise HarnessError(f"the tuned profile {source} is damaged: {type(e).__name__}: {e}") from None


def check_profile_model(p: TuneProfile, mine: ModelIdentity, source: str) -> None:
    """Refuse a profile tuned on another model: its file size or its fingerprint is not this model's."""
    if p.model.file_bytes != mine.file_bytes or p.model.fingerprint != mine.fingerprint:
        raise HarnessError(f"the tuned profile {source} is of another model ({p.model.file_name}: "
                           f"{p.model.file_bytes} bytes, fingerprint {p.model.fingerprint}; this model "
                           f"{mine.file_name}: {mine.file_bytes} bytes, fingerprint {mine.fingerprint}): run "
                           "harness tune on this model")
