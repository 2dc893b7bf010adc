"""Statistics for the harness: pure functions of numbers (numpy/scipy), no I/O.

Every interval type says what its plus-minus means: `MeanCI.kind` and friends are "95% CI" (or the
level asked for); standard errors are given separately and labelled as such.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import stats as _sps

from harness.core.errors import HarnessError

CV_WARN = 0.10  # pyperf warns when the standard deviation exceeds 10% of the mean
MIN_SAMPLES = 5  # fewer repetitions than this: the t interval is wide and the CV itself unreliable
UNSTABLE_CV = 0.25  # a configuration whose runs vary more than this is not measured: its ratio is not a result
UNSTABLE_RATIO_WIDTH = 0.5  # nor a ratio whose 95% CI is wider than half the ratio


def _level_label(level: float) -> str:
    return f"{level * 100:g}% CI"


@dataclass(frozen=True)
class MeanCI:
    """Mean of repeated measurements with a Student-t confidence interval (`low`, `high`).

    `half_width` is the +/- of the interval (a `level` CI, not one SE); `se` is the standard error.
    With one sample the interval is undefined (nan)."""

    mean: float
    half_width: float
    low: float
    high: float
    n: int
    sd: float
    se: float
    level: float = 0.95

    @property
    def kind(self) -> str:
        return _level_label(self.level)

    @property
    def cv(self) -> float:
        """Coefficient of variation (sample sd / mean); nan when undefined."""
        if self.n < 2 or self.mean == 0:
            return math.nan
        return abs(self.sd / self.mean)


def mean_ci(samples: Sequence[float] | npt.NDArray[np.float64], level: float = 0.95) -> MeanCI:
    """Mean with a t-based `level` confidence interval: mean +/- t_{(1+level)/2, n-1} * sd / sqrt(n)."""
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise HarnessError("mean_ci needs at least one sample")
    if not np.all(np.isfinite(x)):
        raise HarnessError(f"mean_ci got a non-finite sample: {x.tolist()}")
    n = int(x.size)
    mean = float(x.mean())
    if n < 2:
        return MeanCI(mean, math.nan, math.nan, math.nan, n, math.nan, math.nan, level)
    sd = float(x.std(ddof=1))
    se = sd / math.sqrt(n)
    t = float(_sps.t.ppf((1 + level) / 2, n - 1))
    hw = t * se
    return MeanCI(mean, hw, mean - hw, mean + hw, n, sd, se, level)


def spread_warnings(ci: MeanCI, what: str = "the measurement", *, cv_warn: float = CV_WARN,
                    min_samples: int = MIN_SAMPLES) -> tuple[str, ...]:
    """pyperf-style warnings with advice: few samples, or a standard deviation above `cv_warn` of the mean."""
    out: list[str] = []
    if ci.n < min_samples:
        out.append(f"{what}: only {ci.n} sample{'s' if ci.n != 1 else ''}; the {ci.kind} is wide or "
                   f"undefined - use at least {min_samples} runs (--runs)")
    cv = ci.cv
    if not math.isnan(cv) and cv > cv_warn:
        out.append(f"{what}: the standard deviation is {cv * 100:.0f}% of the mean (more than "
                   f"{cv_warn * 100:.0f}%): results may be unstable - close other programs, fix the CPU "
                   "frequency, or raise --runs")
    return tuple(out)


@dataclass(frozen=True)
class DeltaPPL:
    """Paired change in perplexity of `test` against `base` on the same tokens, in percent.

    delta_pct = 100 * (PPL_test / PPL_base - 1) = 100 * (exp(mean(nll_test - nll_base)) - 1).
    (`low`, `high`) is a percentile block-bootstrap `level` CI that resamples whole chunks (not one SE)."""

    delta_pct: float
    low: float
    high: float
    ppl_base: float
    ppl_test: float
    n_tokens: int
    n_chunks: int
    n_boot: int
    seed: int
    level: float = 0.95

    @property
    def kind(self) -> str:
        return f"{_level_label(self.level)}, block bootstrap over {self.n_chunks} chunks"

    @property
    def ci_contains_zero(self) -> bool:
        return self.low <= 0.0 <= self.high


def _chunk_sums(values: npt.NDArray[np.float64], chunk_ids: npt.NDArray[np.int64]) -> tuple[
        npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    _, inverse = np.unique(chunk_ids, return_inverse=True)
    sums = np.bincount(inverse, weights=values).astype(np.float64)
    counts = np.bincount(inverse).astype(np.float64)
    return sums, counts


def paired_delta_ppl(base_nll: Sequence[float] | npt.NDArray[np.float64],
                     test_nll: Sequence[float] | npt.NDArray[np.float64],
                     chunk_ids: Sequence[int] | npt.NDArray[np.int64], *,
                     n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> DeltaPPL:
    """Paired delta-PPL% from per-token negative log-likelihoods of the same tokens under two configurations.

    `chunk_ids[i]` names the chunk (llama-perplexity context window) of token i; tokens of a chunk share
    context, so they are resampled together: each bootstrap replicate draws as many chunks as there are,
    with replacement, and recomputes the token-weighted mean difference. Seeded, hence reproducible."""
    base = np.asarray(base_nll, dtype=np.float64)
    test = np.asarray(test_nll, dtype=np.float64)
    ids = np.asarray(chunk_ids, dtype=np.int64)
    if base.shape != test.shape or base.shape != ids.shape or base.ndim != 1:
        raise HarnessError(f"paired NLL arrays differ in shape: base {base.shape}, test {test.shape}, "
                           f"chunks {ids.shape}; the runs did not score the same tokens")
    if base.size == 0:
        raise HarnessError("no tokens to compare")
    if not (np.all(np.isfinite(base)) and np.all(np.isfinite(test))):
        raise HarnessError("a per-token NLL is not finite (nan or inf): the run diverged")
    diff = test - base
    sums, counts = _chunk_sums(diff, ids)
    n_chunks = int(sums.size)
    mean_diff = float(diff.mean())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_chunks, size=(n_boot, n_chunks))
    boot = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return DeltaPPL(
        delta_pct=100.0 * math.expm1(mean_diff),
        low=100.0 * math.expm1(float(lo)),
        high=100.0 * math.expm1(float(hi)),
        ppl_base=math.exp(float(base.mean())),
        ppl_test=math.exp(float(test.mean())),
        n_tokens=int(base.size),
        n_chunks=n_chunks,
        n_boot=n_boot,
        seed=seed,
        level=level,
    )


@dataclass(frozen=True)
class Correlation:
    """Pearson r with a `level` CI: Fisher z, tanh(atanh(r) +/- z_{(1+level)/2} / sqrt(n - 3)), or a cluster
    bootstrap (cluster_bootstrap_pearson)."""

    r: float
    low: float
    high: float
    n: int
    p_value: float
    level: float = 0.95
    method: str = "Fisher z"

    @property
    def kind(self) -> str:
        return f"{_level_label(self.level)}, {self.method}"


def pearson_fisher(x: Sequence[float] | npt.NDArray[np.float64], y: Sequence[float] | npt.NDArray[np.float64],
                   level: float = 0.95) -> Correlation:
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise HarnessError(f"correlation needs two equal-length series, got {a.shape} and {b.shape}")
    n = int(a.size)
    if n < 4:
        raise HarnessError(f"a Fisher-z interval needs at least 4 points, got {n}: add policies to the sweep")
    if float(a.std()) == 0.0 or float(b.std()) == 0.0:
        raise HarnessError("correlation is undefined: one of the series is constant")
    res = _sps.pearsonr(a, b)
    r = float(res.statistic)
    p = float(res.pvalue)
    z = math.atanh(max(min(r, 1 - 1e-15), -1 + 1e-15))
    q = float(_sps.norm.ppf((1 + level) / 2))
    half = q / math.sqrt(n - 3)
    return Correlation(r, math.tanh(z - half), math.tanh(z + half), n, p, level)


def cluster_bootstrap_pearson(x: Sequence[float] | npt.NDArray[np.float64],
                              y: Sequence[float] | npt.NDArray[np.float64], clusters: Sequence[str], *,
                              n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> Correlation:
    """Pearson r of (x, y) with a percentile CI from resampling whole clusters with replacement: points of one
    cluster (e.g. one policy family's runs) are not independent, so the clusters are the sample. A resample whose
    x or y is constant has no r and is drawn again."""
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(clusters) != a.size:
        raise HarnessError(f"correlation needs equal-length series and labels, got {a.shape}, {b.shape}, "
                           f"{len(clusters)}")
    names = list(dict.fromkeys(clusters))
    if len(names) < 4:
        raise HarnessError(f"a cluster bootstrap needs at least 4 clusters, got {len(names)}: add policies")
    if float(a.std()) == 0.0 or float(b.std()) == 0.0:
        raise HarnessError("correlation is undefined: one of the series is constant")
    res = _sps.pearsonr(a, b)
    members = [np.flatnonzero(np.asarray(clusters) == c) for c in names]
    rng = np.random.default_rng(seed)
    rs: list[float] = []
    for _ in range(50 * n_boot):
        sel = np.concatenate([members[i] for i in rng.integers(0, len(names), len(names))])
        xa, yb = a[sel], b[sel]
        if float(xa.std()) > 0.0 and float(yb.std()) > 0.0:
            rs.append(float(np.corrcoef(xa, yb)[0, 1]))
            if len(rs) == n_boot:
                break
    else:
        raise HarnessError("a cluster bootstrap drew too many resamples without an r (constant mass or delta)")
    lo, hi = np.quantile(rs, [(1 - level) / 2, (1 + level) / 2])
    return Correlation(float(res.statistic), float(lo), float(hi), int(a.size), float(res.pvalue), level,
                       f"cluster bootstrap over {len(names)} clusters, {n_boot} resamples")


@dataclass(frozen=True)
class RatioCI:
    """Ratio of two means (e.g. patched / stock tokens per second) with a percentile bootstrap `level` CI,
    each group resampled independently (the runs are not paired)."""

    ratio: float
    low: float
    high: float
    n_a: int
    n_b: int
    level: float = 0.95

    @property
    def kind(self) -> str:
        return f"{_level_label(self.level)}, bootstrap"


def ratio_ci(a: Sequence[float] | npt.NDArray[np.float64], b: Sequence[float] | npt.NDArray[np.float64], *,
             n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> RatioCI:
    """mean(a) / mean(b) with a seeded bootstrap CI; with fewer than 2 samples in a group the CI is nan."""
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.size == 0 or y.size == 0:
        raise HarnessError("a ratio needs samples on both sides")
    if float(y.mean()) == 0.0:
        raise HarnessError("a ratio with a zero denominator mean")
    ratio = float(x.mean() / y.mean())
    if x.size < 2 or y.size < 2:
        return RatioCI(ratio, math.nan, math.nan, int(x.size), int(y.size), level)
    rng = np.random.default_rng(seed)
    bx = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    by = y[rng.integers(0, y.size, size=(n_boot, y.size))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(bx / by, [alpha, 1 - alpha])
    return RatioCI(ratio, float(lo), float(hi), int(x.size), int(y.size), level)


def unstable_reason(x: MeanCI, base: MeanCI | None = None, ratio: RatioCI | None = None, *, what: str = "the runs",
                    base_what: str = "the baseline's runs", cv_max: float = UNSTABLE_CV,
                    width_max: float = UNSTABLE_RATIO_WIDTH) -> str:
    """Why a measurement (and its ratio to a baseline) is too unstable to be reported as a result, or "" when it is
    not: its own runs or the baseline's vary by more than `cv_max` of their mean (coefficient of variation), or the
    ratio's CI is wider than `width_max` of the ratio. Undefined spreads (one sample) are not judged here."""
    reasons: list[str] = []
    for ci, name in ((x, what), (base, base_what)):
        if ci is not None and not math.isnan(ci.cv) and ci.cv > cv_max:
            reasons.append(f"{name} vary by {ci.cv * 100:.0f}% of their mean (CV; at most {cv_max * 100:.0f}%)")
    if ratio is not None and math.isfinite(ratio.low) and ratio.ratio > 0:
        width = (ratio.high - ratio.low) / ratio.ratio
        if width > width_max:
            reasons.append(f"the ratio's {ratio.kind} [{ratio.low:.2f}, {ratio.high:.2f}] is {width * 100:.0f}% of "
                           f"the ratio wide (at most {width_max * 100:.0f}%)")
    return "; ".join(reasons)
