"""Summaries of recorded runs: the statistics of compare (and of the sweep's and study's quality runs) from
their records and NLL dumps, and the budget verdict. Pure but for reading the dumps through `load`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.domain.catalogue import FULL, STOCK
from harness.domain.costmodel import cache_work, estimate, load_profile, stock_work
from harness.domain.plan import ComparePlan
from harness.domain.results import BudgetCheck, BudgetVerdict, EstimateRow, QualityRow, SpeedRow
from harness.parsers.cache_stats import CacheStats
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import mean_ci, paired_delta_ppl, ratio_ci, spread_warnings, unstable_reason


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


def verify_ram(measured: Iterable[tuple[str, str, int | None, str]], limit_bytes: int) -> BudgetVerdict:
    """compare --ram: every run's peak in its memory cgroup (page cache counted) against the limit. `measured`
    holds (key, config, peak bytes or None, source) per run. The kernel enforces the limit, so no peak exceeds
    it; a run without a peak was not measured inside the cgroup."""
    limit_mib = limit_bytes / 2**20
    checks = tuple(BudgetCheck(k, c, p / 2**20 if p is not None else None, s if p is not None else "",
                               p is not None and p > limit_bytes) for k, c, p, s in measured)
    over = [c for c in checks if c.over]
    missing = [c for c in checks if c.peak_mib is None]
    parts = []
    if over:
        parts.append(f"{len(over)} run{'s' if len(over) > 1 else ''} over the RAM limit of {limit_mib:.0f} MiB: "
                     + ", ".join(f"{c.key} ({c.peak_mib:.0f} MiB)" for c in over))
    if missing:
        parts.append(f"{len(missing)} run{'s' if len(missing) > 1 else ''} without a peak from the memory cgroup: "
                     + ", ".join(c.key for c in missing[:8]) + (" ..." if len(missing) > 8 else ""))
    if not parts:
        top = max(checks, key=lambda c: c.peak_mib or 0.0, default=None)
        source = top.source if top is not None else ""
        parts.append(f"every run stayed inside the RAM limit of {limit_mib:.0f} MiB (memory cgroup, page cache "
                     f"counted; highest peak {top.peak_mib if top and top.peak_mib else 0.0:.0f} MiB"
                     + (f", {top.config}" if top else "") + (f"; {source}" if source else "") + ")")
    at_limit = [c for c in checks if c.peak_mib is not None and c.peak_mib >= limit_mib - 1.0]
    if at_limit:
        parts.append(f"{len(at_limit)} of {len(checks)} runs peaked at the limit: there the kernel reclaimed page "
                     "cache (the model file read through mmap, at load or in decode) to keep them inside it, so "
                     "the limit was enforced, not that they need that much")
    return BudgetVerdict(limit_mib, True, checks, "; ".join(parts), memory="RAM")


def engine_slot_warnings(records: Iterable[dict[str, Any]], planned: int) -> list[str]:
    """compare --ram: the slots per layer the engine ran with (its statistics), where they differ from the plan's,
    which every patched run is given."""
    got: dict[str, set[int]] = {}
    for r in records:
        if r.get("kind") == "bench" and r.get("engine_slots") is not None:
            got.setdefault(str(r["config"]), set()).add(int(r["engine_slots"]))
    return [f"{config}: the engine ran with {', '.join(map(str, sorted(s)))} slots per layer, not the plan's {planned} "
            "that every run was given"
            for config, s in sorted(got.items()) if s != {planned}]


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
        ms = estimate(profile, cache_work(info, c.fetches_per_token, admissions_per_token=admissions,
                                          host_computes_per_token=c.host_computes_per_token())).ms_per_token
        rows.append(EstimateRow(q.config, ms, stock / ms))
    return tuple(rows)


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
        stock_ci = mean_ci(stock) if stock else None
        for config in configs:
            xs = samples.get((config, test))
            if not xs:
                continue
            ci = mean_ci(xs)
            vs = None
            if config != STOCK and stock:
                vs = ratio_ci(xs, stock, n_boot=n_boot, seed=seed)
            why = unstable_reason(ci, stock_ci if config != STOCK else None, vs, what=f"{config}'s {test} runs",
                                  base_what=f"stock's {test} runs")
            warnings = spread_warnings(ci, f"{config} {test}")
            if why:
                warnings += (f"{config} {test}: UNSTABLE, {'no ratio to stock reported' if vs else 'not a result'}: "
                             f"{why}; the machine was busy or its speed changed during the runs - rerun on an idle "
                             "machine (fewer --threads, more --runs)",)
            rows.append(SpeedRow(config, test, ci, vs, warnings, why))
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
