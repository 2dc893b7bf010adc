"""harness.stats.intervals against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.core.errors import HarnessError
from harness.stats.intervals import mean_ci, paired_delta_ppl, pearson_fisher, ratio_ci, spread_warnings

T_975_DF2 = 4.302652729911275  # Student t, 97.5th percentile, 2 degrees of freedom (printed tables: 4.303)
Z_975 = 1.959963984540054


def test_mean_ci_matches_the_t_table() -> None:
    ci = mean_ci([10.0, 12.0, 14.0])
    # mean 12, sd 2, se 2/sqrt(3); half width t * se = 4.9683
    assert ci.mean == pytest.approx(12.0)
    assert ci.sd == pytest.approx(2.0)
    assert ci.se == pytest.approx(2 / math.sqrt(3))
    assert ci.half_width == pytest.approx(T_975_DF2 * 2 / math.sqrt(3), rel=1e-9)
    assert ci.half_width == pytest.approx(4.968275, abs=1e-6)
    assert (ci.low, ci.high) == pytest.approx((12 - 4.968275, 12 + 4.968275), abs=1e-6)
    assert ci.kind == "95% CI"
    assert ci.cv == pytest.approx(2 / 12)


def test_mean_ci_of_one_sample_has_no_interval() -> None:
    ci = mean_ci([5.0])
    assert ci.mean == 5.0 and ci.n == 1
    assert math.isnan(ci.half_width) and math.isnan(ci.cv)


def test_mean_ci_rejects_nan_and_empty() -> None:
    with pytest.raises(HarnessError):
        mean_ci([])
    with pytest.raises(HarnessError):
        mean_ci([1.0, float("nan")])


def test_spread_warnings_like_pyperf() -> None:
    steady = mean_ci([100.0, 101.0, 99.0, 100.5, 99.5])
    assert spread_warnings(steady, "tg128") == ()
    noisy = mean_ci([100.0, 130.0, 70.0, 100.0, 100.0])  # sd 21.2 = 21% of the mean
    (w,) = spread_warnings(noisy, "tg128")
    assert "21%" in w and "--runs" in w
    few = spread_warnings(mean_ci([100.0, 100.5]), "pp512")
    assert len(few) == 1 and "only 2 samples" in few[0]


def test_paired_delta_constant_shift_is_exact() -> None:
    # every token's NLL rises by 0.01: delta = 100 (e^0.01 - 1), and every bootstrap replicate agrees
    rng = np.random.default_rng(1)
    base = rng.uniform(1, 5, 400)
    chunks = np.repeat(np.arange(8), 50)
    d = paired_delta_ppl(base, base + 0.01, chunks, n_boot=500, seed=3)
    expect = 100 * math.expm1(0.01)
    assert d.delta_pct == pytest.approx(expect)
    assert d.low == pytest.approx(expect) and d.high == pytest.approx(expect)
    assert not d.ci_contains_zero
    assert d.n_chunks == 8 and d.n_tokens == 400
    assert d.ppl_test / d.ppl_base == pytest.approx(math.exp(0.01))


def test_paired_delta_two_chunks_known_bootstrap_distribution() -> None:
    # chunk 0 unchanged, chunk 1 up by 1 nat per token: the bootstrap mean difference is 0, 0.5 or 1 with
    # probabilities 1/4, 1/2, 1/4, so the 95% percentile interval is [0, 1] nats -> [0%, 100 (e - 1)%]
    base = np.zeros(20)
    test = np.concatenate([np.zeros(10), np.ones(10)])
    chunks = np.repeat([0, 1], 10)
    d = paired_delta_ppl(base, test, chunks, n_boot=4000, seed=0)
    assert d.delta_pct == pytest.approx(64.87212707)
    assert d.low == pytest.approx(0.0, abs=1e-12)
    assert d.high == pytest.approx(171.82818285)
    assert d.ci_contains_zero


def test_paired_delta_weights_tokens_not_chunks() -> None:
    # a chunk of 1 token (+2 nats) and a chunk of 3 tokens (+0): mean difference 0.5 nats, not 1
    d = paired_delta_ppl([0, 0, 0, 0], [2, 0, 0, 0], [0, 1, 1, 1], n_boot=100)
    assert d.delta_pct == pytest.approx(100 * math.expm1(0.5))


def test_paired_delta_is_seeded_and_pairing_matters() -> None:
    rng = np.random.default_rng(7)
    chunk_level = np.repeat(rng.normal(3, 1, 40), 25)  # big differences between chunks
    base = chunk_level + rng.normal(0, 0.1, 1000)
    test = base + 0.02 + rng.normal(0, 0.01, 1000)
    chunks = np.repeat(np.arange(40), 25)
    a = paired_delta_ppl(base, test, chunks, seed=11)
    b = paired_delta_ppl(base, test, chunks, seed=11)
    assert (a.low, a.high) == (b.low, b.high)
    # pairing removes the chunk-to-chunk variation: the CI is narrow and excludes 0
    assert 0 < a.low < 100 * math.expm1(0.02) < a.high
    assert a.high - a.low < 0.5


def test_paired_delta_rejects_mismatched_tokens() -> None:
    with pytest.raises(HarnessError, match="same tokens"):
        paired_delta_ppl([1.0, 2.0], [1.0], [0, 0])
    with pytest.raises(HarnessError, match="not finite"):
        paired_delta_ppl([1.0, float("inf")], [1.0, 1.0], [0, 0])


def _series_with_r(r: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.arange(n, dtype=np.float64)
    a -= a.mean()
    b = np.cos(np.arange(n) * 1.3)
    b -= b.mean()
    b -= a * (a @ b) / (a @ a)  # orthogonal to a and to the constant
    b *= np.linalg.norm(a) / np.linalg.norm(b)
    return a, r * a + math.sqrt(1 - r * r) * b


def test_pearson_fisher_matches_hand_computation() -> None:
    x, y = _series_with_r(0.5, 28)
    c = pearson_fisher(x, y)
    assert c.r == pytest.approx(0.5, abs=1e-12)
    # z = atanh(0.5) = 0.549306; se = 1/sqrt(28 - 3) = 0.2; tanh(z -/+ 1.959964 * 0.2)
    assert c.low == pytest.approx(math.tanh(math.atanh(0.5) - Z_975 * 0.2))
    assert c.high == pytest.approx(math.tanh(math.atanh(0.5) + Z_975 * 0.2))
    assert (c.low, c.high) == pytest.approx((0.156028, 0.735818), abs=1e-6)
    assert c.n == 28 and "Fisher" in c.kind


def test_pearson_fisher_needs_four_points() -> None:
    with pytest.raises(HarnessError, match="at least 4"):
        pearson_fisher([1, 2, 3], [1, 2, 4])
    with pytest.raises(HarnessError, match="constant"):
        pearson_fisher([1, 2, 3, 4], [1, 1, 1, 1])


def test_ratio_ci() -> None:
    exact = ratio_ci([20.0, 20.0, 20.0], [10.0, 10.0])
    assert (exact.ratio, exact.low, exact.high) == pytest.approx((2.0, 2.0, 2.0))
    spread = ratio_ci([18.0, 22.0, 20.0, 19.0, 21.0], [10.0, 10.0, 10.0], seed=1)
    assert spread.ratio == pytest.approx(2.0)
    assert 1.8 <= spread.low < 2.0 < spread.high <= 2.2
    single = ratio_ci([1.0], [2.0])
    assert single.ratio == 0.5 and math.isnan(single.low)


def test_unstable_reason_by_hand() -> None:
    """CV above the bound, on either side, or a ratio CI wider than half the ratio: named; otherwise ""."""
    from harness.stats.intervals import RatioCI, unstable_reason

    calm = mean_ci([10.0, 10.5, 9.5])  # sd 0.5, CV 5%
    wild = mean_ci([10.0, 60.0, 10.0, 60.0])  # mean 35, sd 28.87: CV 82%
    assert unstable_reason(calm) == ""
    assert unstable_reason(wild, what="x") == "x vary by 82% of their mean (CV; at most 25%)"
    assert unstable_reason(calm, wild, base_what="stock").startswith("stock vary by 82%")
    narrow = RatioCI(2.0, 1.6, 2.4, 5, 5)  # width 0.8 = 40% of the ratio
    wide = RatioCI(2.0, 1.0, 3.2, 5, 5)  # 110%
    assert unstable_reason(calm, calm, narrow) == ""
    assert "[1.00, 3.20] is 110% of the ratio wide (at most 50%)" in unstable_reason(calm, calm, wide)
    assert unstable_reason(mean_ci([10.0]), mean_ci([3.0]), RatioCI(3.3, math.nan, math.nan, 1, 1)) == ""
