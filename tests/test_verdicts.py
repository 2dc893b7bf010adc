"""harness.domain.verdicts: the study's pre-registered rules (docs/study-verdicts.md), each on hand-computed cases
where it holds, does not hold and is inconclusive."""

from __future__ import annotations

import math

from harness.domain.verdicts import (
    AdmissionPair,
    Arm,
    MassPoint,
    distinct_policies,
    family_mass,
    finding1_verdict,
    finding2_verdict,
    finding4_verdict,
    finding5_verdict,
    rank_weight_verdict,
)
from harness.stats.intervals import DeltaPPL, cluster_bootstrap_pearson, pearson_fisher


def _d(delta: float, low: float, high: float) -> DeltaPPL:
    return DeltaPPL(delta, low, high, 10.0, 10.0, 1000, 20, 2000, 0)


RULE = Arm("rule-0.15", 0.075, 0.01)


def test_finding1_holds_fails_and_is_inconclusive() -> None:
    light = Arm("lightest-first hi=0.12", 0.078, 0.009)  # 0.075 vs 0.078: 3.9% apart, within 10%
    s = _d(5.67, 4.0, 7.0)  # S/2 = 2.835, S/4 = 1.4175
    held = finding1_verdict(RULE, light, s, _d(5.3, 3.5, 7.1), _d(0.2, -0.1, 0.5))
    assert held.held is True and "against S/2 = +2.83" in held.evidence and "S/4 = +1.42" in held.evidence
    # 1b fails: the heavy extra substitutions carry less than half (P's CI high 2.5 < 2.835)
    assert finding1_verdict(RULE, light, s, _d(2.0, 1.5, 2.5), _d(0.2, -0.1, 0.5)).held is False
    # 1c fails: the rule loses more than lightest-first by more than S/4 (low 1.5 > 1.4175)
    assert finding1_verdict(RULE, light, s, _d(5.3, 3.5, 7.1), _d(2.0, 1.5, 2.5)).held is False
    # 1b's CI contains S/2: inconclusive; 1c's CI straddling S/4: inconclusive
    assert finding1_verdict(RULE, light, s, _d(3.0, 2.0, 4.0), _d(0.2, -0.1, 0.5)).held is None
    assert finding1_verdict(RULE, light, s, _d(5.3, 3.5, 7.1), _d(1.0, 0.5, 1.5)).held is None
    # a failed part outweighs an inconclusive one
    assert finding1_verdict(RULE, light, s, _d(2.0, 1.5, 2.5), _d(1.0, 0.5, 1.5)).held is False
    # counts 0.075 vs 0.09: 18% apart: inconclusive whatever the deltas
    far = finding1_verdict(RULE, Arm("l", 0.09, 0.01), s, _d(5.3, 3.5, 7.1), _d(0.2, -0.1, 0.5))
    assert far.held is None and "18% apart" in far.evidence
    assert finding1_verdict(RULE, None, s, None, None).held is None
    rank = finding1_verdict(RULE, light, s, _d(5.3, 3.5, 7.1), _d(-0.5, -0.8, -0.2))
    assert rank.held is True and "a rank effect" in rank.evidence


def test_rank_against_weight() -> None:
    heavy = Arm("heavy non-first lo=0.15", 0.01, 0.0020)
    light = Arm("light first hi=0.2", 0.004, 0.0021)  # 4.9% apart
    assert rank_weight_verdict(heavy, light, _d(1.0, 0.4, 1.6)).held is True
    assert rank_weight_verdict(heavy, light, _d(-1.0, -1.6, -0.4)).held is False
    assert rank_weight_verdict(heavy, light, _d(0.1, -0.4, 0.6)).held is None
    off = rank_weight_verdict(heavy, Arm("l", 0.004, 0.0025), _d(1.0, 0.4, 1.6))  # 22% apart
    assert off.held is None and "22% apart" in off.evidence
    none = rank_weight_verdict(None, None, None, note="heavy non-first substituted nothing")
    assert none.held is None and none.evidence.startswith("heavy non-first substituted nothing")


def test_distinct_policies_merge_admission_pairs_and_matching_masses() -> None:
    """The earlier rule, still reported beside finding 2's verdict."""
    pts = [MassPoint("fetch-all", "off", 0.0, 0.0), MassPoint("fetch-all", "0.5", 0.0, 0.0),
           MassPoint("tau=0.05", "off", 0.010, 0.5), MassPoint("tau=0.05", "0.5", 0.008, 0.7),
           MassPoint("tau=0.15", "off", 0.030, 1.0), MassPoint("tau=0.15", "0.5", 0.026, 1.2),
           MassPoint("tau=0.4", "off", 0.060, 2.0), MassPoint("tau=0.4", "0.5", 0.056, 2.2),
           MassPoint("first-choice", "off", 0.061, 2.1), MassPoint("first-choice", "0.5", 0.057, 2.3)]
    d = distinct_policies(pts)
    # tau=0.4 (0.058) and first-choice (0.059) are 1.7% apart: one policy; 5 families, 4 distinct points
    assert d.groups == (("fetch-all",), ("tau=0.05",), ("tau=0.15",), ("tau=0.4", "first-choice"))
    assert math.isclose(d.points[1][0], 0.009) and math.isclose(d.points[1][1], 0.6)
    assert math.isclose(d.points[3][0], 0.0585) and math.isclose(d.points[3][1], 2.15)
    assert d.correlation is not None and d.correlation.n == 4 and d.correlation.r > 0.99
    assert distinct_policies([p for p in pts if p.family != "tau=0.15"]).correlation is None  # three points


def _fams(rows: list[tuple[float, float]], *, both: bool = True) -> list[MassPoint]:
    """Families t0, t1, ... with admission off at (mass, delta) and on at a slightly lower mass and higher delta."""
    out = [MassPoint("fetch-all", "off", 0.0, 0.0)]
    for i, (m, dl) in enumerate(rows):
        out.append(MassPoint(f"t{i}", "off", m, dl))
        if both:
            out.append(MassPoint(f"t{i}", "0.5", 0.9 * m, dl + 0.1))
    return out


def test_finding2_by_families_without_the_anchor() -> None:
    f = family_mass(_fams([(0.01, 0.5), (0.02, 0.9), (0.04, 1.8), (0.08, 3.9), (0.1, 4.6)]))
    assert f.families == ("t0", "t1", "t2", "t3", "t4") and f.n_points == 10  # fetch-all left out
    c = f.correlation
    assert c is not None and c.n == 10 and c.r > 0.99 and c.low > 0.9 and "5 clusters" in c.method
    v = finding2_verdict(f)
    assert v.held is True and "5 families, 10 points without fetch-all" in v.evidence
    # mass goes down while delta goes up: did not hold
    neg = family_mass(_fams([(0.01, 2.0), (0.02, 1.5), (0.04, 1.6), (0.08, 0.5)]))
    assert neg.correlation is not None and neg.correlation.r < 0 and finding2_verdict(neg).held is False
    # three families (whatever fetch-all adds): inconclusive
    three = family_mass(_fams([(0.01, 0.5), (0.02, 0.9), (0.04, 1.8)]))
    assert three.correlation is None and "3 families" in three.note and finding2_verdict(three).held is None


def test_a_same_mass_counterexample_is_not_averaged_away() -> None:
    """The cold studymoe case: cache-route at tau 0.1's mass with several times its delta. The earlier rule merges
    the two into one point; by families the resampled r's lower end falls below 0: inconclusive."""
    rows = [(0.01, 0.3), (0.02, 1.13), (0.021, 4.05), (0.04, 1.9), (0.06, 2.6)]
    pts = _fams(rows)
    f = family_mass(pts)
    assert f.correlation is not None and f.correlation.r > 0 and f.correlation.low < 0
    assert finding2_verdict(f, distinct=distinct_policies(pts)).held is None
    assert ("t1", "t2") in distinct_policies(pts).groups  # averaged into one point there


def test_the_cluster_bootstrap_counts_clusters_not_points() -> None:
    """Ten copies of each of 4 noisy points: Fisher z counts 40 points and excludes 0; the clusters are 4."""
    base = [(0.01, 1.0), (0.02, 0.2), (0.04, 1.4), (0.08, 1.2)]
    x = [m for m, _ in base for _ in range(10)]
    y = [dl for _, dl in base for _ in range(10)]
    labels = [f"f{i}" for i in range(4) for _ in range(10)]
    fisher = pearson_fisher(x, y)
    boot = cluster_bootstrap_pearson(x, y, labels)
    assert math.isclose(fisher.r, boot.r) and fisher.low > 0 and boot.low < 0
    again = cluster_bootstrap_pearson(x, y, labels)
    assert (again.low, again.high) == (boot.low, boot.high)  # seeded


def test_admission_pairs_are_reported_within_each_tau() -> None:
    f = family_mass(_fams([(0.01 * 2 ** i, float(i)) for i in range(4)]))
    pairs = [AdmissionPair("tau=0.15", 0.030, 0.026, 1.0, 1.2, _d(0.2, -0.1, 0.5)),
             AdmissionPair("tau=0.4", 0.060, 0.061, 2.0, 1.9, None)]
    v = finding2_verdict(f, pairs)
    assert "in 1 of 2 pairs" in v.evidence and "on vs off +0.20% [95% CI -0.10, +0.50]" in v.evidence
    assert "tau=0.15: mass 0.0300 -> 0.0260, delta +1.00% -> +1.20%" in v.evidence


def test_finding4() -> None:
    assert finding4_verdict(_d(-0.5, -0.8, -0.2)).held is True
    assert finding4_verdict(_d(0.5, 0.2, 0.8)).held is False
    assert finding4_verdict(_d(-0.1, -0.4, 0.2)).held is None
    assert finding4_verdict(None).held is None
    a = _d(-0.5, -0.8, -0.2)
    assert finding4_verdict(a, _d(-2.0, -3.0, -1.0), _d(-0.3, -0.6, 0.0), topics_run=True).held is True
    # lower after changes, but less than elsewhere: not "most after topic changes"
    not_most = finding4_verdict(a, _d(-0.2, -0.3, -0.1), _d(-0.6, -0.9, -0.3), topics_run=True)
    assert not_most.held is False and "not larger after changes" in not_most.evidence
    assert finding4_verdict(a, _d(1.0, 0.5, 1.5), _d(0.0, -0.2, 0.2), topics_run=True).held is False
    assert finding4_verdict(a, _d(-1.0, -2.5, 0.5), _d(0.0, -0.2, 0.2), topics_run=True).held is None
    assert finding4_verdict(a, None, None, topics_run=True).held is None


def test_finding5() -> None:
    b = _d(-0.6, -0.9, -0.3)
    assert finding5_verdict(b, _d(0.1, -0.2, 0.4), 2.0, 1.5).held is True
    assert finding5_verdict(b, _d(0.6, 0.3, 0.9), 2.0, 1.5).held is False  # a significant increase
    assert finding5_verdict(b, _d(0.1, -0.2, 0.4), 2.0, 2.0).held is False  # speed-first does not fetch less
    assert finding5_verdict(_d(0.3, 0.1, 0.5), _d(0.1, -0.2, 0.4), 2.0, 1.5).held is False
    assert finding5_verdict(b, _d(0.3, -0.1, 0.7), 2.0, 1.5).held is None  # +0.7 not excluded
    assert finding5_verdict(_d(-0.1, -0.4, 0.2), _d(0.1, -0.2, 0.4), 2.0, 1.5).held is None
    assert finding5_verdict(b, _d(0.1, -0.2, 0.4), None, None).held is None
    assert finding5_verdict(None, None, None, None).held is None
    v = finding5_verdict(b, _d(0.1, -0.2, 0.4), 2.0, 1.5, quality_vs_full=_d(0.8, 0.5, 1.1),
                         speed_vs_full=_d(1.2, 0.9, 1.5))
    assert "against the full model quality-first +0.80%" in v.evidence and "the rule 2.00, speed-first 1.50" in \
        v.evidence
