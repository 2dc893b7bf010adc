"""harness.orchestration.frontier (`harness frontier`): the families' points and the grid's checks, the table of the
fewest bytes per token within a bound, the Pareto marking and the presets' check on hand-built rows, the bytes and
the cost model's host-compute term of a row, the run with a fake runner (resumed), the CLI and the plots."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_compare import FakeEnv, _info
from test_sweep import SweepFake

from harness.cli import main
from harness.core.errors import HarnessError
from harness.domain.costmodel import cache_work, estimate, load_profile
from harness.domain.options import FrontierGrid, FrontierOptions
from harness.domain.plan import SweepPoint
from harness.domain.results import FrontierRow, QualityRow
from harness.orchestration import frontier as fr
from harness.parsers.cache_stats import CacheStats
from harness.report.markdown import render_frontier_markdown
from harness.stats.intervals import DeltaPPL


def _d(delta: float) -> DeltaPPL:
    return DeltaPPL(delta, delta - 0.2, delta + 0.2, 10.0, 10.0, 100, 4, 100, 0)


def _r(family: str, name: str, delta: float | None, sync: float, bg: float = 0.0, ms: float | None = 1.0,
       fraction: float = 0.25, preset: str | None = None) -> FrontierRow:
    p = SweepPoint(name, "threshold", None, "off", "lfu", fraction, 4, family, preset)
    return FrontierRow(p, 10.0, _d(delta) if delta is not None else None, 0.5, 0.1, 0.05, sync / 1000, sync, bg, 0.0,
                       ms)


# ---- the points and the grid's checks ------------------------------------------------------------------------

def test_points_of_every_family() -> None:
    info = _info(n_expert=16, k=2)
    pts = fr.frontier_points(FrontierGrid(fractions=(0.25, 0.5)), info)
    names = [p.name for p in pts]
    assert len(names) == len(set(names))
    by_family = {f: [p for p in pts if p.family == f and p.slots == 4] for f in
                 ("ours", "fetch-all", "cache-route", "zero", "ser", "host", "combos")}
    # ours: 2 presets + 4 taus x 2 admits less tau 0.15 admit 0.5 (= quality) + first-choice admit off
    assert len(by_family["ours"]) == 2 + 7 + 1
    assert [len(by_family[f]) for f in ("fetch-all", "cache-route", "zero", "ser", "host", "combos")] == \
        [3, 8, 6, 8, 3, 3]
    assert len(pts) == 2 * 41 and {p.slots for p in pts} == {4, 8}
    q = next(p for p in pts if p.name == "quality slots=4")
    assert q.preset == "quality" and q.cache("s.json").render() == "mode=emulate,policy=quality,slots=4,stats=s.json"
    cr = next(p for p in pts if p.name == "cache-route j=2 m=8 alpha=0.5 admit=off evict=lfu slots=8")  # m=4k
    assert cr.cache(None).render() == "mode=emulate,slots=8,rule=cache-route,evict=lfu,admit=off,j=2,m=8,alpha=0.5"
    z = next(p for p in pts if p.name.startswith("zero tau=0.1 renorm=on"))
    assert z.cache(None).render() == "mode=emulate,slots=4,rule=zero,tau=0.1,evict=lfu,admit=off,renorm=on"
    h = next(p for p in pts if p.name == "substitute-all light=host admit=off evict=classlru slots=4")
    assert h.cache(None).render().endswith("rule=substitute-all,evict=classlru,admit=off,light=host")
    # one family, one residency
    only = fr.frontier_points(FrontierGrid(families=("ser",), fractions=(0.25,), kmins=(1,), ts=(0.2,),
                                           renorms=("on",)), info)
    assert [p.name for p in only] == ["ser kmin=1 t=0.2 renorm=on admit=off evict=lfu slots=4"]


@pytest.mark.parametrize(("grid", "message"), [
    (FrontierGrid(j=(3,)), "j=3 is outside the accepted range [0, 2]"),
    (FrontierGrid(m=("1",)), "m=1 is outside the accepted range [2, 16]"),  # a window smaller than k
    (FrontierGrid(m=("17",)), "m=17 is outside the accepted range [2, 16]"),
    (FrontierGrid(m=("wide",)), "m='wide' is not accepted: a window of router ranks in [2, 16]"),
    (FrontierGrid(m=("9k",)), "m=18 is outside the accepted range [2, 16]"),
    (FrontierGrid(alpha=(1.5,)), "alpha=1.5 is outside the accepted range [0, 1]"),
    (FrontierGrid(alpha=(-0.1,)), "alpha=-0.1 is outside the accepted range [0, 1]"),
    (FrontierGrid(kmins=(0,)), "kmin=0 is outside the accepted range [1, 2]"),
    (FrontierGrid(ts=(2.0,)), "t=2 is outside the accepted range [0, 1]"),
    (FrontierGrid(zero_taus=(-1.0,)), "zero tau=-1 is outside the accepted range [0, 1]"),
    (FrontierGrid(renorms=("maybe",)), "renorm='maybe' is not accepted: use off, on"),
    (FrontierGrid(evicts=("fifo",)), "evict='fifo' is not accepted: use lfu, lru, classlru"),
    (FrontierGrid(admits=("sometimes",)), "admit='sometimes' is not accepted: use off, on, or a beta > 0"),
    (FrontierGrid(fractions=(1.5,)), "residency 150% is outside the accepted range (0, 100]%"),
    (FrontierGrid(families=("ours", "colibri")), "unknown family colibri: use ours, fetch-all"),
])
def test_a_bad_grid_is_one_line_naming_the_key_and_the_range(grid: FrontierGrid, message: str) -> None:
    with pytest.raises(HarnessError) as e:
        fr.frontier_points(grid, _info(n_expert=16, k=2))
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- the table, the frontier, the presets -------------------------------------------------------------------

def test_bound_table_fewest_bytes_within_each_bound() -> None:
    rows = [
        _r("ours", "a", 0.2, 3000), _r("ours", "b", 0.45, 1000, bg=500), _r("ours", "c", 0.9, 400),
        _r("ours", "d", 1.2, 10),  # within no bound
        _r("ours", "e", 0.3, 100, fraction=0.125),  # another residency
        _r("zero", "z1", 0.8, 50, bg=0), _r("zero", "z2", 0.8, 20, bg=30, ms=0.5),  # tie on bytes: the faster
        _r("zero", "z3", 0.8, 50, ms=0.9),
        _r("ser", "s", 2.5, 0), _r("ser", "s2", None, 0),  # never within a bound (and one without a delta)
    ]
    cells = {(c.family, c.bound): c.row.point.name if c.row else None
             for c in fr.bound_table(rows, ["ours", "zero", "ser"], [0.25])}
    assert cells == {("ours", 0.5): "b", ("ours", 1.0): "c", ("zero", 0.5): None, ("zero", 1.0): "z2",
                     ("ser", 0.5): None, ("ser", 1.0): None}
    lower = fr.bound_table(rows, ["ours"], [0.125])
    assert [(c.bound, c.row.point.name if c.row else None) for c in lower] == [(0.5, "e"), (1.0, "e")]
    assert rows[1].bytes_moved == 1500


def test_frontier_marking_and_the_presets_check() -> None:
    rows = [
        _r("fetch-all", "fa", 0.0, 9000, ms=0.5),
        _r("ours", "quality", 0.6, 900, ms=0.31, preset="quality"),
        _r("ours", "speed", 1.4, 500, ms=0.30, preset="speed"),
        _r("zero", "z", 0.5, 800, ms=0.30),  # dominates both presets (faster or as fast, lower delta)
        _r("ser", "s", 3.0, 100, ms=0.2),
        _r("ours", "quality8", 0.9, 900, ms=0.4, fraction=0.125, preset="quality"),
        _r("zero", "z8", 1.0, 300, ms=0.35, fraction=0.125),
    ]
    time_front = fr.fronts(rows, lambda r: r.est_ms_per_token)
    assert time_front == {0.25: ("s", "z", "fa"), 0.125: ("z8", "quality8")}
    bytes_front = fr.fronts(rows, lambda r: r.bytes_moved)
    assert bytes_front[0.25] == ("s", "speed", "z", "fa")
    assert [r.point.name for r in fr.dominators(rows, rows[1])] == ["z"]
    checks = fr.preset_checks(rows, time_front, [0.25, 0.125])
    got = [(c.preset, c.fraction, c.on_frontier, c.dominated_by) for c in checks]
    assert got == [("quality", 0.25, False, ("z",)), ("speed", 0.25, False, ("z",)),
                   ("quality", 0.125, True, ()), ("speed", 0.125, False, ())]
    assert checks[3].name == ""  # speed did not run at 12.5%


def test_a_rows_bytes_and_the_cost_models_host_compute_term() -> None:
    info = _info(n_expert=16, k=2)
    bpe = info.bytes_per_expert
    host_pt = SweepPoint("h", "first-choice", None, "off", "classlru", 0.25, 4, "host", None, (("light", "host"),))
    adm_pt = SweepPoint("a", "threshold", 0.15, "0.5", "lfu", 0.25, 4, "ours")
    quality = [QualityRow("h", 10.0, 0.1, _d(0.0), CacheStats(0.0, 0.0, 0.5, "", tokens=100, admissions=0,
                                                             host_computes=300)),
               QualityRow("a", 10.0, 0.1, _d(0.4), CacheStats(0.3, 0.1, 1.5, "", tokens=100, admissions=50))]
    h, a = fr.frontier_rows([host_pt, adm_pt], quality, info, "rtx3090")
    assert (h.sync_bytes, h.background_bytes, h.host_computes_per_token) == (0.5 * bpe, 0.0, 3.0)
    assert (a.sync_bytes, a.background_bytes, a.bytes_moved) == (1.5 * bpe, 0.5 * bpe, 2.0 * bpe)
    p = load_profile("rtx3090")
    no_host = estimate(p, cache_work(info, 0.5)).ms_per_token
    host_ms = (3.0 * bpe / (p.cpu_bw_gbs * 1e9) + 3.0 * p.host_expert_us * 1e-6) * 1e3
    assert h.est_ms_per_token == pytest.approx(no_host + host_ms)  # host computes: no bytes moved, but time
    assert host_ms > 0


# ---- the run, the report, the CLI, the plots ------------------------------------------------------------------

def _opts(tmp_path: Path, fractions: tuple[float, ...] = (0.5, 0.25)) -> FrontierOptions:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    text = tmp_path / "t.txt"
    text.write_text("text")
    grid = FrontierGrid(families=("ours", "fetch-all", "zero"), fractions=fractions, taus=(0.1, 0.15),
                        admits=("off",), evicts=("lru",), zero_taus=(0.2,), renorms=("off",))
    return FrontierOptions(out=tmp_path / "out", model=model, text=text, grid=grid, argv=("harness", "frontier"))


def test_run_frontier_with_a_fake_runner_and_resume(tmp_path: Path) -> None:
    opts = _opts(tmp_path)
    runner = SweepFake()  # NLL shift = tau / 10 where the name has a tau, 0.2 otherwise, 0 for fetch-all
    res = fr.run_frontier(opts, runner, _info(), env=FakeEnv(tmp_path))
    # per residency: quality, speed, 2 thresholds admit=off, first-choice admit=off, fetch-all lru, zero = 7
    assert runner.calls[0] == "full" and len(runner.calls) == 1 + 2 * 7
    assert {r.point.slots for r in res.rows} == {4, 2} and len(res.rows) == 14
    t1 = next(r for r in res.rows if r.point.name == "threshold tau=0.1 admit=off evict=lfu slots=4")
    assert t1.delta is not None and t1.delta.delta_pct == pytest.approx(100 * math.expm1(0.01))
    assert t1.sync_bytes == pytest.approx((2.0 - 0.01) * _info().bytes_per_expert)
    assert set(res.frontier) == {0.5, 0.25} and all(res.frontier.values())
    assert len(res.table) == 2 * 3 * 2 and {c.family for c in res.table} == {"ours", "fetch-all", "zero"}
    fa = next(c for c in res.table if c.family == "fetch-all" and c.fraction == 0.5 and c.bound == 0.5)
    assert fa.row is not None and fa.row.delta is not None and fa.row.delta.delta_pct == 0.0
    md = render_frontier_markdown(res)
    assert "## 50.0% resident" in md and "at <= +0.5% delta PPL: fewest bytes/token" in md
    assert "not a measurement" in md and "Presets on the frontier" in md
    again = SweepFake()
    again.dumps = runner.dumps
    res2 = fr.run_frontier(opts, again, _info(), env=FakeEnv(tmp_path))
    assert again.calls == [] and res2.n_resumed == 15
    assert [r.delta for r in res2.rows] == [r.delta for r in res.rows]


def test_cli_parses_the_grid_and_refuses_a_bad_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[FrontierOptions] = []

    def fake(opts: FrontierOptions, progress: object = None) -> object:
        seen.append(opts)
        raise HarnessError("stop here")

    monkeypatch.setattr(fr, "frontier", fake)
    assert main(["frontier", "--out", str(tmp_path / "o"), "--families", "ours,cache-route", "--residency", "25,10",
                 "--j", "1,3", "--m", "auto,24", "--alpha", "0.25", "--kmin", "2", "--t", "0.2"]) == 2
    g = seen[0].grid
    assert (g.families, g.fractions, g.j, g.m, g.alpha, g.kmins, g.ts) == (
        ("ours", "cache-route"), (0.25, 0.1), (1, 3), ("auto", "24"), (0.25,), (2,), (0.2,))
    assert FrontierGrid() == FrontierGrid(**{f: getattr(g, f) for f in ("taus", "admits", "evicts", "zero_taus",
                                                                          "renorms")}, j=(1, 2), m=("auto", "4k"),
                                          alpha=(1.0, 0.5), kmins=(1, 2), ts=(0.1, 0.3))
    assert FrontierGrid().m == ("auto", "4k")
    capsys.readouterr()
    monkeypatch.undo()
    assert main(["frontier", "--out", str(tmp_path / "o2"), "--j", "one"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "harness: error: --j: not a comma-separated list of integers: 'one'"


def test_cli_a_grid_outside_the_models_range_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = Path(__file__).resolve().parents[1] / "models" / "tinymoe-f16.gguf"
    if not model.is_file():
        pytest.skip("the trained model is not in this checkout")
    text = tmp_path / "t.txt"
    text.write_text("text")
    assert main(["frontier", "--model", str(model), "--text", str(text), "--out", str(tmp_path / "o"),
                 "--alpha", "1,1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("harness: error: frontier grid: alpha=1.5 is outside the accepted range [0, 1] (a substitute's "
                   "weight scale)")


def test_frontier_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from harness.report.plots import write_frontier_plots

    res = fr.run_frontier(_opts(tmp_path, (0.5, 0.125)), SweepFake(), _info(n_expert=16), env=FakeEnv(tmp_path))
    paths = write_frontier_plots(res, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["frontier-12_5pct.png", "frontier-12_5pct.svg", "frontier-50pct.png",
                                             "frontier-50pct.svg"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_harness_report_rerenders_a_frontier_folder(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    from test_report import _write_dump

    from harness.core.project import Build
    from harness.parsers.gguf_model import read_model_info
    from harness.tools.requests import PerplexityRequest, PerplexityRun

    class FileFake(SweepFake):
        def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
            run = super().perplexity(build, req)
            if req.nll_dump is not None:
                _write_dump(req.nll_dump, self.dumps[req.nll_dump])
            return run

    text = tmp_path / "t.txt"
    text.write_text("text")
    model = synth_models["qwen3moe"]
    opts = FrontierOptions(out=tmp_path / "out", model=model, text=text,
                           grid=FrontierGrid(families=("ours", "ser"), fractions=(0.5,), taus=(0.1,), admits=("off",),
                                             kmins=(1,), ts=(0.2,), renorms=("on",)))
    first = fr.run_frontier(opts, FileFake(), read_model_info(model), env=FakeEnv(tmp_path))
    assert [r.point.name for r in first.rows] == ["quality slots=8", "speed slots=8",
                                                  "threshold tau=0.1 admit=off evict=lfu slots=8",
                                                  "first-choice admit=off evict=lfu slots=8",
                                                  "ser kmin=1 t=0.2 renorm=on admit=off evict=lfu slots=8"]
    assert main(["report", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert md == render_frontier_markdown(first)


def test_the_anchors_are_named_configurations_of_the_catalogue() -> None:
    from harness.domain.catalogue import check_policies, policy_cache_spec

    check_policies(["upstream", "cache-route", "zero", "ser", "drop-light"])
    assert policy_cache_spec("drop-light", "emulate", 16, None).render() == "mode=emulate,policy=drop-light,slots=16"
    assert policy_cache_spec("quality-prefetch", "engine", 16, None).render() == (
        "mode=engine,policy=quality,slots=16,prefetch=on")
    assert policy_cache_spec("upstream", "engine", 16, None).render() == (
        "mode=engine,slots=16,rule=fetch-all,evict=classlru,admit=off")
    assert policy_cache_spec("ser", "emulate", 8, None).render() == "mode=emulate,slots=8,rule=ser,evict=lfu,admit=off"
