"""harness.orchestration.sweep: the grid, the Pareto frontier, the mass hypothesis (hand-checked), the run with a
fake runner."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from test_compare import FakeEnv, FakeRunner, _info

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.domain.options import SweepGrid, SweepOptions
from harness.domain.plan import SweepPoint
from harness.domain.results import SweepRow
from harness.orchestration.sweep import grid_points, mass_hypothesis, run_sweep
from harness.parsers import PerplexityResult
from harness.parsers.cache_stats import CacheStats
from harness.parsers.nll_dump import NllDump
from harness.report.markdown import render_sweep_markdown
from harness.stats.frontier import pareto_front
from harness.stats.intervals import DeltaPPL
from harness.tools.requests import PerplexityRequest, PerplexityRun, RunOutput


def test_grid_points() -> None:
    info = _info(n_expert=16, k=2)
    pts = grid_points(SweepGrid(rules=("fetch-all", "threshold", "substitute-all"), taus=(0.1, 0.2),
                                admits=("off", "0.5"), fractions=(0.25, 0.5)), info)
    names = [p.name for p in pts]
    # per fraction: fetch-all once, threshold 2 taus x 2 admits, substitute-all 2 admits = 7
    assert len(pts) == 14 and len(set(names)) == 14
    assert names[0] == "fetch-all admit=off evict=lfu slots=4"
    assert "threshold tau=0.2 admit=0.5 evict=lfu slots=8" in names
    spec = next(p for p in pts if p.name == "threshold tau=0.1 admit=0.5 evict=lfu slots=4").cache("s.json")
    assert spec.render() == "mode=emulate,slots=4,stats=s.json,rule=threshold,tau=0.1,evict=lfu,admit=0.5"
    assert grid_points(SweepGrid(rules=("fetch-all",), fractions=(0.01,)), info)[0].slots == 2  # at least k
    # the anchors' rules at their defaults (tau applies to threshold only: zero keeps its own default)
    anchors = grid_points(SweepGrid(rules=("cache-route", "zero", "ser"), taus=(0.1,), admits=("off",),
                                    evicts=("classlru",), fractions=(0.5,)), info)
    assert [p.cache("s.json").render() for p in anchors] == [
        f"mode=emulate,slots=8,stats=s.json,rule={r},evict=classlru,admit=off" for r in ("cache-route", "zero", "ser")]
    with pytest.raises(HarnessError, match="unknown rule"):
        grid_points(SweepGrid(rules=("lottery",)), info)
    with pytest.raises(HarnessError, match="beta > 0"):
        grid_points(SweepGrid(admits=("sometimes",)), info)


def test_pareto_front_by_hand() -> None:
    pts = [("a", 1.0, 5.0), ("b", 2.0, 2.0), ("c", 3.0, 2.5), ("d", 4.0, 1.0), ("e", 2.0, 3.0), ("f", 1.0, 5.0)]
    # c is dominated by b; e by b; a and f tie (neither dominates the other)
    assert pareto_front(pts) == ("a", "f", "b", "d")


def _row(rule: str, mass: float, delta: float) -> SweepRow:
    p = SweepPoint(f"{rule} {mass}", rule, None, "off", "lfu", 0.25, 4)
    d = DeltaPPL(delta, delta - 0.1, delta + 0.1, 10.0, 10.0, 100, 4, 100, 0)
    return SweepRow(p, 10.0, d, 0.1, mass, 1.0, 1.0)


def test_mass_hypothesis_uses_first_choice_fetching_rules_only() -> None:
    rows = [_row("threshold", m, 2 * m + 0.1 * e) for m, e in ((0.01, 1), (0.02, -1), (0.03, 1), (0.05, -1),
                                                                 (0.08, 0))]
    rows += [_row("substitute-all", 0.5, -3.0), _row("drop", 0.4, 9.0)]  # excluded: they substitute first choices
    m = mass_hypothesis(rows)
    assert m.n_points == 5 and m.correlation is not None
    x = np.array([0.01, 0.02, 0.03, 0.05, 0.08])
    y = 2 * x + 0.1 * np.array([1, -1, 1, -1, 0])
    r = float(np.corrcoef(x, y)[0, 1])
    assert m.correlation.r == pytest.approx(r)
    half = 1.959963984540054 / math.sqrt(5 - 3)
    assert m.correlation.low == pytest.approx(math.tanh(math.atanh(r) - half))
    few = mass_hypothesis(rows[:3])
    assert few.correlation is None and "at least 4" in few.note


class SweepFake(FakeRunner):
    """NLL shift and substituted mass grow with tau (a known positive relation)."""

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        self.calls.append(req.label)
        tau = re.search(r"tau=([\d.]+)", req.label)
        mass = 0.0 if req.label in ("full",) or req.label.startswith("fetch-all") else (
            float(tau.group(1)) / 10 if tau else 0.2)
        base = np.random.default_rng(0).uniform(1.0, 3.0, 200)
        nll = base + mass
        if req.nll_dump is not None:
            self.dumps[req.nll_dump] = NllDump(102, 51, 4, np.arange(200, dtype=np.int32), nll)
        stats = None
        if req.cache is not None and req.cache.mode != "off":
            stats = CacheStats(mass, mass, 2.0 - mass, "{}", admissions=0, tokens=200)
        ppl = float(np.exp(nll.mean()))
        return PerplexityRun(PerplexityResult(ppl, 0.1, 4, 102, 102, 1, (ppl,)), None,
                             RunOutput(("t",), {}, 0, "", "", 0.1), stats)


def test_run_sweep_with_a_fake_runner(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = SweepOptions(out=tmp_path / "out", model=model, text=text,
                        grid=SweepGrid(rules=("fetch-all", "threshold", "substitute-all"), taus=(0.1, 0.2, 0.3),
                                       admits=("off",)), argv=("harness", "sweep"))
    runner = SweepFake()
    res = run_sweep(opts, runner, _info(), env=FakeEnv(tmp_path))
    assert runner.calls[0] == "full" and len(runner.calls) == 1 + 5
    assert [r.point.rule for r in res.rows] == ["fetch-all", "threshold", "threshold", "threshold", "substitute-all"]
    fa = res.rows[0]
    assert fa.delta is not None and fa.delta.delta_pct == 0.0
    t3 = res.rows[3]
    assert t3.delta is not None and t3.delta.delta_pct == pytest.approx(100 * math.expm1(0.03))
    # fetch-all + 3 thresholds = 4 first-choice-fetching points; delta = 100 (e^mass - 1): r just below 1
    assert res.mass.correlation is not None and res.mass.correlation.r == pytest.approx(1.0, abs=1e-4)
    assert res.frontier and all(n in [r.point.name for r in res.rows] for n in res.frontier)
    md = render_sweep_markdown(res)
    assert "## Mass hypothesis" in md and "Pearson r = 1.000" in md and "not a measurement" in md
    again = SweepFake()
    again.dumps = runner.dumps
    res2 = run_sweep(opts, again, _info(), env=FakeEnv(tmp_path))
    assert again.calls == [] and res2.n_resumed == 6


def test_reload_sweep(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    from test_report import _write_dump

    from harness.orchestration.sweep import reload_sweep

    class FileSweepFake(SweepFake):
        def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
            run = super().perplexity(build, req)
            if req.nll_dump is not None:
                _write_dump(req.nll_dump, self.dumps[req.nll_dump])
            return run

    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = SweepOptions(out=tmp_path / "out", model=synth_models["qwen3moe"], text=text,
                        grid=SweepGrid(rules=("fetch-all", "threshold"), taus=(0.1, 0.2, 0.3), admits=("off",)))
    from harness.parsers.gguf_model import read_model_info

    first = run_sweep(opts, FileSweepFake(), read_model_info(synth_models["qwen3moe"]), env=FakeEnv(tmp_path))
    assert len(first.rows) == 4
    again = reload_sweep(tmp_path / "out")
    assert [r.point.name for r in again.rows] == [r.point.name for r in first.rows]
    assert [r.delta for r in again.rows] == [r.delta for r in first.rows]
    assert again.mass.correlation == first.mass.correlation


@pytest.mark.build
def test_sweep_with_the_real_builds(patched_build: Build, synth_models: dict[str, Path], synth_text_file: Path,
                                    tmp_path: Path) -> None:
    from harness.orchestration.sweep import sweep

    opts = SweepOptions(out=tmp_path / "out", model=synth_models["qwen2moe"], text=synth_text_file,
                        grid=SweepGrid(rules=("fetch-all", "threshold", "first-choice"), taus=(0.1, 0.3),
                                       admits=("off",), fractions=(0.5,)), n_ctx=128, chunks=4, threads=2)
    res = sweep(opts)
    assert [r.point.rule for r in res.rows] == ["fetch-all", "threshold", "threshold", "first-choice"]
    fa = res.rows[0]
    assert fa.delta is not None and fa.delta.delta_pct == 0.0 and fa.substitution_rate == 0.0
    # a higher threshold substitutes more, and first-choice the most
    rates = [r.substitution_rate for r in res.rows]
    assert all(x is not None for x in rates)
    assert rates[1] <= rates[2] <= rates[3]  # type: ignore[operator]
    assert res.mass.n_points == 4 and res.mass.correlation is not None
    assert (tmp_path / "out" / "report.md").is_file()
