"""harness.orchestration.study: the verdict rules on hand-built results, and the whole study with a fake runner."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
from test_compare import FakeEnv, FakeRunner, _info

from harness.domain.options import CompareOptions, SweepOptions
from harness.domain.results import CompareResult, MassHypothesis, QualityRow, SweepResult
from harness.orchestration.compare import run_compare
from harness.orchestration.study import policy_pairs, verdicts
from harness.parsers.cache_stats import CacheStats
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import Correlation, DeltaPPL


def _d(delta: float, low: float, high: float) -> DeltaPPL:
    return DeltaPPL(delta, low, high, 10.0, 10.0, 1000, 20, 2000, 0)


def _q(config: str, delta: DeltaPPL, rate: float, fetches: float = 1.0) -> QualityRow:
    return QualityRow(config, 10.0, 0.1, delta, CacheStats(rate, rate / 10, fetches, "{}"))


def _sweep(mass: MassHypothesis) -> SweepResult:
    return SweepResult(SweepOptions(out=Path("o")), 10.0, (), (), mass, Path("r"), 0, 0, False, ())


def _compare(tmp_path: Path, quality: tuple[QualityRow, ...]) -> CompareResult:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    base = run_compare(CompareOptions(out=tmp_path / "o", model=model, speed=False), FakeRunner(), _info(),
                       env=FakeEnv(tmp_path))
    return replace(base, quality=quality)


def test_verdicts_held_on_the_studys_numbers(tmp_path: Path) -> None:
    # the study's Qwen3-Next numbers: 0.15 rule 7.5% substituted, +0.35%; substitute-all 8.5%, +5.67%
    quality = (_q("rule-0.15", _d(0.35, 0.1, 0.6), 0.075, 2.0), _q("substitute-all", _d(5.67, 4.0, 7.0), 0.085, 0.0),
               _q("quality", _d(0.1, -0.1, 0.3), 0.074, 2.1), _q("speed", _d(0.4, 0.1, 0.7), 0.2, 0.5))
    pairs = {"substitute-all vs rule-0.15": _d(5.3, 3.5, 7.1), "quality vs rule-0.15": _d(-0.25, -0.4, -0.1),
             "speed vs rule-0.15": _d(0.05, -0.2, 0.3)}
    mass = MassHypothesis(Correlation(0.92, 0.7, 0.98, 10, 1e-4), 10, "")
    v = verdicts(_compare(tmp_path, quality), pairs, _sweep(mass), None)
    assert [x.held for x in v] == [True, True, True, True]
    assert "7.5% of calls against 8.5%" in v[0].evidence and "88% as many" in v[0].evidence
    assert "r = 0.920" in v[1].evidence


def test_verdicts_that_did_not_hold_or_could_not_be_tested(tmp_path: Path) -> None:
    # the rule loses as much as substitute-all per substitution; admission does nothing; speed-first hurts
    quality = (_q("rule-0.15", _d(2.0, 1.0, 3.0), 0.04), _q("substitute-all", _d(4.0, 3.0, 5.0), 0.08),
               _q("quality", _d(2.0, 1.0, 3.0), 0.04), _q("speed", _d(3.0, 2.5, 3.5), 0.1))
    pairs = {"substitute-all vs rule-0.15": _d(2.0, 1.0, 3.0), "quality vs rule-0.15": _d(0.0, -0.2, 0.2),
             "speed vs rule-0.15": _d(1.0, 0.5, 1.5)}
    v = verdicts(_compare(tmp_path, quality), pairs, _sweep(MassHypothesis(None, 2, "2 points: at least 4")), None)
    assert [x.held for x in v] == [False, None, False, False]
    assert v[1].evidence == "2 points: at least 4"
    (tmp_path / "x").mkdir()
    none = verdicts(_compare(tmp_path / "x", ()), {}, _sweep(MassHypothesis(None, 0, "")), None)
    assert [x.held for x in none] == [None, None, None, None]


def test_policy_pairs_are_paired_on_the_same_tokens() -> None:
    base = np.linspace(1, 2, 40)
    chunk_dump = NllDump(12, 6, 8, np.arange(40, dtype=np.int32), base)
    nll = {"rule-0.15": chunk_dump, "quality": NllDump(12, 6, 8, np.arange(40, dtype=np.int32), base - 0.01)}
    p = policy_pairs(nll, [("quality", "rule-0.15"), ("speed", "rule-0.15")])
    assert list(p) == ["quality vs rule-0.15"]
    assert abs(p["quality vs rule-0.15"].delta_pct - (np.exp(-0.01) - 1) * 100) < 1e-9


def test_the_whole_study_with_a_fake_runner_has_the_side_by_side_table(tmp_path: Path,
                                                                       synth_models: dict[str, Path]) -> None:
    """compare, sweep and the frontier (at the residency and half of it) on one fake runner; the report has the
    verdicts and the side-by-side table; a second study resumes everything and runs nothing."""
    from test_sweep import SweepFake

    from harness.domain.options import StudyOptions
    from harness.orchestration.study import study

    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = StudyOptions(out=tmp_path / "study", model=synth_models["qwen3moe"], text=text, topics=False,
                        residency=0.5, argv=("harness", "study"))
    runner = SweepFake()
    res = study(opts, runner=runner, env=FakeEnv(tmp_path))
    assert res.frontier is not None and res.frontier.options.grid.fractions == (0.5, 0.25)
    assert {r.point.slots for r in res.frontier.rows} == {8, 4}  # 16 experts, k = 4
    md = (tmp_path / "study" / "report.md").read_text()
    assert "## Verdicts" in md and "## The frontier, side by side" in md
    assert "### 50.0% resident (8 slots per layer)" in md and "### 25.0% resident (4 slots per layer)" in md
    assert "| family | at <= +0.5% delta PPL: fewest bytes/token | at <= +1% delta PPL: fewest bytes/token |" in md
    assert (tmp_path / "study" / "frontier" / "report.md").is_file()
    again = SweepFake()
    again.dumps = runner.dumps
    study(opts, runner=again, env=FakeEnv(tmp_path))
    assert again.calls == []
    skipped = study(StudyOptions(out=tmp_path / "study", model=synth_models["qwen3moe"], text=text, topics=False,
                                 frontier=False, residency=0.5), runner=again, env=FakeEnv(tmp_path))
    assert skipped.frontier is None and "not run (--no-frontier)" in (tmp_path / "study" / "report.md").read_text()
