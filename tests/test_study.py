"""harness.orchestration.study: the verdict rules on hand-built results, and the whole study with a fake runner."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_compare import FakeEnv, FakeRunner, _info
from test_sweep import SweepFake

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.domain.composition import Composition
from harness.domain.options import CompareOptions, SweepOptions
from harness.domain.plan import SweepPoint
from harness.domain.results import CompareResult, MassHypothesis, QualityRow, SweepResult, SweepRow
from harness.domain.verdicts import MatchedResult
from harness.orchestration.compare import run_compare
from harness.orchestration.study import policy_pairs, verdicts
from harness.parsers.cache_stats import CacheStats
from harness.parsers.nll_dump import NllDump
from harness.parsers.perplexity import PerplexityResult
from harness.stats.intervals import DeltaPPL
from harness.tools.runners import PerplexityRequest, PerplexityRun, RunOutput


def _d(delta: float, low: float, high: float) -> DeltaPPL:
    return DeltaPPL(delta, low, high, 10.0, 10.0, 1000, 20, 2000, 0)


def _q(config: str, delta: DeltaPPL, rate: float, fetches: float = 1.0) -> QualityRow:
    return QualityRow(config, 10.0, 0.1, delta, CacheStats(rate, rate / 10, fetches, "{}"))


def _sweep(mass: MassHypothesis, rows: tuple[SweepRow, ...] = ()) -> SweepResult:
    return SweepResult(SweepOptions(out=Path("o")), 10.0, rows, (), mass, Path("r"), 0, 0, False, ())


def _compare(tmp_path: Path, quality: tuple[QualityRow, ...]) -> CompareResult:
    model = tmp_path / "m.gguf"
    if not model.exists():  # written once: its mtime is in the fingerprint, and a second call resumes the first
        model.write_bytes(b"GGUF")
    base = run_compare(CompareOptions(out=tmp_path / "o", model=model, speed=False), FakeRunner(), _info(),
                       env=FakeEnv(tmp_path))
    return replace(base, quality=quality)


def _matched(*, q: DeltaPPL, r: DeltaPPL, light_rate: float = 0.078, light_first_mass: float = 0.0021) -> MatchedResult:
    rule = Composition("rule", "rule=threshold,tau=0.15", 10.0, None, 0.01, 0.075, 0, 0.15)
    light = Composition("lightest", "rule=band,hi=0.12", 10.0, None, 0.009, light_rate, 5, 0.12)
    heavy = Composition("heavy non-first", "rule=band,lo=0.15,min_rank=1", 10.0, None, 0.002, 0.01, 0, 0.4)
    first = Composition("light first", "rule=band,hi=0.2,max_rank=0", 10.0, None, light_first_mass, 0.004, 9, 0.2)
    return MatchedResult("calibration", rule, 0.12, (), light, q, heavy, 0.2, (), first, r)


def _rows(deltas: dict[str, tuple[float, float]]) -> tuple[SweepRow, ...]:
    """Sweep rows of the threshold rule over tau, admission off and on with the same mass and delta."""
    out = []
    for fam, (mass, delta) in deltas.items():
        tau = float(fam.split("=")[1])
        for admit in ("off", "0.5"):
            out.append(SweepRow(SweepPoint(f"threshold tau={tau:g} admit={admit}", "threshold", tau, admit, "lfu",
                                           0.25, 4), 10.0, _d(delta, delta - 0.2, delta + 0.2), mass, mass, 1.0, None))
    return tuple(out)


def test_verdicts_held_on_the_studys_numbers(tmp_path: Path) -> None:
    # the study's Qwen3-Next numbers: 0.15 rule 7.5% substituted, +0.35%; substitute-all 8.5%, +5.67%
    quality = (_q("rule-0.15", _d(0.35, 0.1, 0.6), 0.075, 2.0), _q("substitute-all", _d(5.67, 4.0, 7.0), 0.085, 0.0),
               _q("quality", _d(0.1, -0.1, 0.3), 0.074, 2.1), _q("speed", _d(0.4, 0.1, 0.7), 0.2, 0.5))
    pairs = {"substitute-all vs rule-0.15": _d(5.3, 3.5, 7.1), "quality vs rule-0.15": _d(-0.25, -0.4, -0.1),
             "speed vs rule-0.15": _d(0.05, -0.2, 0.3)}
    rows = _rows({"tau=0.05": (0.01, 0.5), "tau=0.1": (0.02, 1.1), "tau=0.25": (0.04, 1.9), "tau=0.4": (0.08, 4.0)})
    v = verdicts(_compare(tmp_path, quality), pairs, _sweep(MassHypothesis(None, 8, ""), rows), None,
                 _matched(q=_d(0.2, -0.1, 0.5), r=_d(1.0, 0.4, 1.6)))
    assert [x.held for x in v] == [True, True, True, True, True]
    assert "substitutes 7.5% of calls, lightest-first 7.8%" in v[0].evidence
    assert "4 families, 8 points without fetch-all" in v[2].evidence and "cluster bootstrap" in v[2].evidence
    assert "the earlier rule, 4 distinct policies" in v[2].evidence


def test_verdicts_that_did_not_hold_or_could_not_be_tested(tmp_path: Path) -> None:
    # the rule loses as much as substitute-all; rank over weight; mass goes down with delta; admission does
    # nothing; speed-first hurts
    quality = (_q("rule-0.15", _d(2.0, 1.0, 3.0), 0.04), _q("substitute-all", _d(4.0, 3.0, 5.0), 0.08),
               _q("quality", _d(2.0, 1.0, 3.0), 0.04), _q("speed", _d(3.0, 2.5, 3.5), 0.1))
    pairs = {"substitute-all vs rule-0.15": _d(0.5, 0.2, 0.8), "quality vs rule-0.15": _d(0.0, -0.2, 0.2),
             "speed vs rule-0.15": _d(1.0, 0.5, 1.5)}
    rows = _rows({"tau=0.05": (0.01, 2.0), "tau=0.1": (0.02, 1.5), "tau=0.25": (0.04, 1.6), "tau=0.4": (0.08, 0.5)})
    v = verdicts(_compare(tmp_path, quality), pairs, _sweep(MassHypothesis(None, 8, ""), rows), None,
                 _matched(q=_d(0.2, -0.1, 0.5), r=_d(-1.0, -1.6, -0.4)))
    assert [x.held for x in v] == [False, False, False, None, False]
    # the counts or the masses do not match: inconclusive, whatever the deltas
    far = verdicts(_compare(tmp_path, quality), pairs, _sweep(MassHypothesis(None, 8, ""), rows), None,
                   _matched(q=_d(0.2, -0.1, 0.5), r=_d(-1.0, -1.6, -0.4), light_rate=0.12, light_first_mass=0.004))
    assert [x.held for x in far[:2]] == [None, None]
    (tmp_path / "x").mkdir()
    none = verdicts(_compare(tmp_path / "x", ()), {}, _sweep(MassHypothesis(None, 0, "")), None)
    assert [x.held for x in none] == [None, None, None, None, None]


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


class MatchedFake(SweepFake):
    """SweepFake with the study's matched runs: substitution rate and mass by the band's spec (monotone in hi), and
    an NLL shift per run; `first_shift` is the light first choices' shift (0.01: weight over rank; 0.08: rank)."""

    SHIFTS = {"rule-0.15": 0.015, "substitute-all": 0.2, "quality": 0.012, "speed": 0.015}
    RATES = {"speed": 0.02}  # speed-first: more substituted, fewer fetched, the same NLL as the rule

    def __init__(self, first_shift: float = 0.01, max_rank: bool = True) -> None:
        super().__init__()
        self.first_shift, self.max_rank = first_shift, max_rank

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        label = req.label
        hi = re.search(r"hi=([\d.]+)", label)
        if "rule=band" in label and "min_rank=1" in label:
            rate, mass, shift = 0.01, 0.02, 0.05
        elif "max_rank" in label and not self.max_rank:  # a build whose band has no max_rank
            raise HarnessError("LLAMA_EXPERT_CACHE: unknown key 'max_rank'")
        elif "rule=band" in label and "max_rank=0" in label and hi:
            rate, mass, shift = float(hi.group(1)) * 0.02, float(hi.group(1)) * 0.04, self.first_shift
        elif label.startswith("light hi=") and hi:  # lightest-first (Experiment B's run name)
            rate, mass, shift = float(hi.group(1)) * 0.5, float(hi.group(1)) * 0.1, 0.01
        elif label.startswith("rule=threshold,tau=0.15") or label in self.SHIFTS:
            shift = self.SHIFTS.get(label, 0.015)
            rate = mass = self.RATES.get(label, shift)
        else:
            return super().perplexity(build, req)
        self.calls.append(label)
        nll = np.random.default_rng(0).uniform(1.0, 3.0, 200) + shift
        if req.nll_dump is not None:
            self.dumps[req.nll_dump] = NllDump(102, 51, 4, np.arange(200, dtype=np.int32), nll)
        ppl = float(np.exp(nll.mean()))
        return PerplexityRun(PerplexityResult(ppl, 0.1, 4, 102, 102, 1, (ppl,)), None,
                             RunOutput(("t",), {}, 0, "", "", 0.1),
                             CacheStats(rate, mass, 2.0 - rate, "{}", admissions=0, tokens=200))


def test_the_whole_study_runs_the_matched_runs_and_applies_the_rules(tmp_path: Path,
                                                                     synth_models: dict[str, Path]) -> None:
    """With a fake runner: lightest-first at the rule's count (H bisected on the rate: 0.03 gives 0.015), rank
    against weight at matched mass (H = 0.5 gives heavy non-first's 0.02), every pre-registered verdict in the
    report; then the same with light first choices hurting more: rank, not weight, did not hold."""
    from harness.domain.options import StudyOptions
    from harness.orchestration.study import study

    text = tmp_path / "t.txt"
    text.write_text("text")
    calib = tmp_path / "calib.txt"
    calib.write_text("calibration line\n" * 10)
    opts = StudyOptions(out=tmp_path / "study", model=synth_models["qwen3moe"], text=text, topics=False,
                        frontier=False, generation=False, residency=0.5, calib_text=calib, argv=("harness", "study"))
    runner = MatchedFake()
    res = study(opts, runner=runner, env=FakeEnv(tmp_path))
    m = res.matched
    assert m is not None and m.lightest_hi == 0.0312 and m.light_first_hi == 0.5, res.matched_note
    assert [s.hi for s in m.rate_steps] == [1.0, 0.5, 0.25, 0.125, 0.0625, 0.0312]
    assert m.lightest is not None and m.lightest.spec == "rule=band,hi=0.0312"
    assert "light hi=0.0312" in runner.calls
    assert m.heavy_nonfirst is not None and m.heavy_nonfirst.spec == "rule=band,lo=0.15,min_rank=1"
    assert m.light_first is not None and m.light_first.spec == "rule=band,hi=0.5,max_rank=0"
    assert "rule=band,hi=0.5,max_rank=0,evict=lfu,admit=off" in runner.calls
    assert m.q is not None and m.q.delta_pct == pytest.approx(100 * np.expm1(0.005))
    assert m.r is not None and m.r.delta_pct == pytest.approx(100 * np.expm1(0.04))
    held = {v.finding.split(".")[0]: v.held for v in res.verdicts}
    assert [v.finding.split(".")[0] for v in res.verdicts] == ["1", "1 and 3", "2", "3", "4", "5"]
    assert held["1"] is True and held["1 and 3"] is True and held["4"] is True and held["5"] is True
    # Experiment B calibrates on --calib-text too; in this fake the light band never reaches the heavy mass
    assert held["3"] is None and "below the heavy band's 0.2000" in res.verdicts[3].evidence
    assert (tmp_path / "study" / "composition" / "calibration.txt").read_text() == calib.read_text()
    md = (tmp_path / "study" / "report.md").read_text()
    assert "(16 experts per layer, top-4)" in md and "Chunks: the first 32 chunks of 512 tokens" in md
    assert "## Matched runs" in md and "Calibration text: `calib.txt`" in md
    assert "- **1 and 3. weight, not rank" in md and ": held.**" in md
    assert "## Per domain\n\nno t-sources.json beside the text: no domains" in md
    # finding 2: cache-route and first-choice (both 0.2 here) one distinct policy; 7 admission pairs (5 taus,
    # first-choice, cache-route), each paired on the sweep's NLL dumps
    assert "7 families, 14 points without fetch-all (threshold tau=0.05," in md
    assert "the earlier rule, 7 distinct policies (fetch-all; threshold tau=0.05;" in md
    assert "; cache-route+first-choice)" in md
    assert "admission lowers the mass and raises delta-PPL in 0 of 7 pairs" in md
    assert "threshold tau=0.4: mass 0.0400 -> 0.0400, delta +4.08% -> +4.08%, on vs off +0.00%" in md
    again = MatchedFake()
    again.dumps = runner.dumps
    study(opts, runner=again, env=FakeEnv(tmp_path))
    assert again.calls == []  # everything resumed
    rank = MatchedFake(first_shift=0.08)
    other = study(replace(opts, out=tmp_path / "rank"), runner=rank, env=FakeEnv(tmp_path))
    v = next(x for x in other.verdicts if x.finding.startswith("1 and 3"))
    assert v.held is False and "heavy non-first vs light first choices -2.9" in v.evidence
    old = study(replace(opts, out=tmp_path / "old"), runner=MatchedFake(max_rank=False), env=FakeEnv(tmp_path))
    assert [x.held for x in old.verdicts[:2]] == [True, None]  # finding 1's runs stand without max_rank
    assert old.matched is not None and any("rank against weight not run" in n for n in old.matched.notes)
    skipped = study(replace(opts, out=tmp_path / "skip", matched=False), runner=MatchedFake(), env=FakeEnv(tmp_path))
    assert skipped.matched is None and [x.held for x in skipped.verdicts[:2]] == [None, None]
    assert "not run (--no-matched)" in (tmp_path / "skip" / "report.md").read_text()


def test_the_header_names_the_chunks_and_the_texts_domains(tmp_path: Path) -> None:
    from harness.orchestration.study import header_lines

    text = tmp_path / "held.txt"
    text.write_text("x")
    assert header_lines(text, 32, 512, None) == ("Chunks: the first 32 chunks of 512 tokens.",)
    (tmp_path / "held-sources.json").write_text(
        '[{"domain": "code", "source": "a", "chars": 300}, {"domain": "code", "source": "b", "chars": 100},'
        ' {"domain": "prose", "source": "c", "chars": 600}]')
    lines = header_lines(text, None, 512, _d(1.0, 0.5, 1.5))
    assert lines[0] == "Chunks: every chunk (the whole text) of 512 tokens, 20 chunks, 1000 scored tokens."
    assert lines[1].startswith("Domains of the text, in order (held-sources.json): code 2 documents, 400 characters "
                               "(40%), prose 1 documents, 600 characters (60%).")
    (tmp_path / "held-sources.json").write_text('[{"domain": "code"}]')
    assert header_lines(text, None, 512, None)[1].startswith("Domains: held-sources.json unreadable")
