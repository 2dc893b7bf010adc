"""Experiment B (harness composition, finding 3): the decision rule on hand-built results, the calibration search and
the calibration text; the C++ rule itself is unit tested in tests/cpp/test_expert_policy.cpp (test_band)."""

from __future__ import annotations

import pytest

from harness.domain.composition import Composition, MassLevel, finding3_verdict
from harness.orchestration.composition import band_items, calibration_text, search_light_edge
from harness.stats.intervals import DeltaPPL


def _delta(pct: float, low: float, high: float) -> DeltaPPL:
    return DeltaPPL(pct, low, high, 400.0, 400.0 * (1 + pct / 100), 16000, 32, 2000, 0)


def _comp(name: str, mass: float, rate: float) -> Composition:
    return Composition(name, "rule=band", 410.0, _delta(1.0, 0.5, 1.5), mass, rate, 0, 0.5)


def _level(m_heavy: float, m_light: float, pair: DeltaPPL | None, *, rate_heavy: float = 0.02,
           rate_light: float = 0.25) -> MassLevel:
    return MassLevel(0.3, m_heavy, 0.08, (), _comp("heavy lo=0.3", m_heavy, rate_heavy),
                     _comp("light hi=0.08", m_light, rate_light), pair)


def test_held_when_masses_match_and_heavy_hurts_more() -> None:
    v = finding3_verdict([_level(0.078, 0.076, _delta(26.0, 22.0, 31.0)),
                          _level(0.050, 0.052, _delta(9.0, 6.0, 12.0))])
    assert v.held is True
    assert "0.0780 (heavy) vs 0.0760 (light)" in v.evidence and "Held if" in v.evidence


def test_not_held_when_a_level_ci_is_not_above_zero() -> None:
    assert finding3_verdict([_level(0.078, 0.076, _delta(0.5, -0.2, 1.1))]).held is False
    # light hurting more (CI below 0) is also "did not hold"
    assert finding3_verdict([_level(0.078, 0.076, _delta(26.0, 22.0, 31.0)),
                             _level(0.05, 0.05, _delta(-3.0, -5.0, -1.0))]).held is False


def test_inconclusive_when_masses_differ_beyond_the_tolerance() -> None:
    # 0.078 vs 0.060: 26% of their mean apart; a large positive CI does not rescue it (the study's outcome)
    v = finding3_verdict([_level(0.078, 0.060, _delta(26.0, 22.0, 31.0))])
    assert v.held is None and "masses differ by 26%" in v.evidence
    # within a looser tolerance the same level decides
    assert finding3_verdict([_level(0.078, 0.060, _delta(26.0, 22.0, 31.0))], tolerance=0.3).held is True
    # one level out of tolerance makes the whole verdict inconclusive, even if another level held
    assert finding3_verdict([_level(0.078, 0.076, _delta(26.0, 22.0, 31.0)),
                             _level(0.05, 0.02, _delta(9.0, 6.0, 12.0))]).held is None


def test_inconclusive_without_the_composition_or_the_runs() -> None:
    # heavy substituting as many calls as light: not "few heavy vs many light"
    assert finding3_verdict([_level(0.078, 0.076, _delta(26.0, 22.0, 31.0), rate_heavy=0.3)]).held is None
    missing = MassLevel(0.3, 0.07, None, (), None, None, None, "the light band reaches mass 0.03 at most")
    v = finding3_verdict([missing])
    assert v.held is None and "reaches mass 0.03" in v.evidence
    assert finding3_verdict([]).held is None


def test_the_light_edge_search_matches_the_mass() -> None:
    calls: list[float] = []

    def mass(hi: float) -> float:  # a monotone stand-in for the light band's mass
        calls.append(hi)
        return 0.9 * hi ** 1.5

    edge, steps = search_light_edge(mass, 0.0782, 0.3, 0.1, 12)
    assert edge is not None and abs(mass(edge) - 0.0782) <= 0.05 * 0.0782
    assert steps[0].hi == 0.3 and len(steps) == len(calls) - 1
    # the light band cannot reach a heavy mass above its own at hi = lo
    edge, steps = search_light_edge(mass, 0.5, 0.3, 0.1, 12)
    assert edge is None and len(steps) == 1


def test_calibration_text_is_whole_lines_past_the_offset() -> None:
    text = "".join(f"line {i}\n" for i in range(100))
    cal = calibration_text(text, 203, 50)
    assert cal.startswith("line ") and cal.endswith("\n") and cal in text
    assert text.index(cal) <= 203 < text.index(cal) + len(cal) and len(cal) >= 50
    with pytest.raises(Exception, match="no calibration part"):
        calibration_text(text, 10_000, 50)


def test_band_items_render_the_rule() -> None:
    assert dict(band_items(lo=0.3)) == {"rule": "band", "lo": "0.3", "evict": "lfu", "admit": "off"}
    assert dict(band_items(hi=0.0797, evict="lru"))["hi"] == "0.0797"


def test_the_study_part_without_a_run() -> None:
    from harness.orchestration.study_parts import finding3
    from harness.report.study_parts import study_parts_markdown

    v = finding3(None, "not run (--no-composition)")
    assert v.held is None and v.finding.startswith("3. ") and v.evidence == "not run (--no-composition)"
    md = study_parts_markdown(None, "not run (--no-composition)", None, "not run: no llama-cpp-python")
    assert "## Experiment B" in md and "not run (--no-composition)" in md and "not run: no llama-cpp-python" in md
