"""Agreement between two generations of the same prompt, and its intervals: pure functions, no I/O.

The generation test (PAPER.md, "Limits"; issue 13, item 5) compares the greedy tokens of a policy with the full
model's on the same prompt: how many tokens agree before the first divergence, whether the whole generation is
identical, and (math prompts) whether the final answers agree. Over prompts: a bootstrap CI of a mean and a Wilson
score interval of a proportion.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _sps

from harness.core.errors import HarnessError


def agreeing_prefix(ref: Sequence[int], test: Sequence[int]) -> int:
    """Tokens of `test` equal to `ref` before the first divergence (position of the first differing token; a
    generation that stops early, or runs on, diverges where the shorter one ends)."""
    n = 0
    for a, b in zip(ref, test, strict=False):
        if a != b:
            break
        n += 1
    return n


def identical(ref: Sequence[int], test: Sequence[int]) -> bool:
    return list(ref) == list(test)


@dataclass(frozen=True)
class Proportion:
    """k of n with a Wilson score `level` interval (`low`, `high`); n = 0: nan."""

    k: int
    n: int
    low: float
    high: float
    level: float = 0.95

    @property
    def share(self) -> float:
        return self.k / self.n if self.n else math.nan


def wilson(k: int, n: int, level: float = 0.95) -> Proportion:
    if n < 0 or not 0 <= k <= max(n, 0):
        raise HarnessError(f"a proportion needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return Proportion(0, 0, math.nan, math.nan, level)
    z = float(_sps.norm.ppf((1 + level) / 2))
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    # at k = 0 (k = n) the interval's lower (upper) end is exactly 0 (1); rounding would leave 1e-17 off
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return Proportion(k, n, low, high, level)


@dataclass(frozen=True)
class BootMean:
    """Mean over items with a seeded percentile bootstrap `level` CI over the items; fewer than 2 items: nan."""

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95


def bootstrap_mean(values: Sequence[float], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> BootMean:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise HarnessError("a mean needs at least one value")
    mean = float(x.mean())
    if x.size < 2:
        return BootMean(mean, math.nan, math.nan, int(x.size), level)
    rng = np.random.default_rng(seed)
    boot = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return BootMean(mean, float(lo), float(hi), int(x.size), level)
