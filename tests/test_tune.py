"""harness tune (harness.domain.tune, harness.orchestration.tune): the search space, the bisection and the choice,
the bound, the machine's cost profile (hand-computed), the profile file's round trip and its refusal of another
model, the run with fake runners (the search's emulate runs, resumption), and one end-to-end run on the trained
model with a tiny grid."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_compare import FakeEnv, _info

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.domain.costmodel import load_profile
from harness.domain.tune import (
    FETCH_ALL,
    MachineFacts,
    ModelIdentity,
    Rung,
    SimPoint,
    SpeedCheck,
    TuneChoice,
    TuneGrid,
    TuneOptions,
    TuneProfile,
    best_per_rung,
    bisect_chain,
    chain_rungs,
    check_profile_model,
    compute_ms_span,
    grid_verdict,
    is_stable,
    machine_profile,
    parse_tune_profile,
    pick_fastest,
    profile_locations,
    profile_to_json,
    speed_cv,
    stability_line,
    tune_cache_dir,
    tune_candidates,
    tuned_policy,
    within_bound,
    within_error,
)
from harness.orchestration.tune import TuneEnvironment, read_profile_for, run_tune
from harness.parsers import BenchResult, PerplexityResult
from harness.parsers.cache_stats import CacheStats
from harness.parsers.nll_dump import NllDump
from harness.parsers.sim import SimRun
from harness.parsers.trace import synthetic_trace, write_expert_trace
from harness.report.tune import render_tune_markdown, summary_lines
from harness.stats.intervals import DeltaPPL, MeanCI, mean_ci
from harness.tools.requests import BenchRequest, BenchRun, PerplexityRequest, PerplexityRun, RunOutput

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "models" / "tinymoe-f16.gguf"


# ---- the search space -------------------------------------------------------------------------------------------

def test_candidates_cover_the_grid() -> None:
    info = _info(n_expert=16, k=2)
    grid = TuneGrid(fractions=(0.25, 0.5), taus=(0.1, 0.2), zero_taus=(0.2,), admits=("off", "0.5"),
                    evicts=("lfu", "lru"), prefetch=("off", "on"))
    cands = tune_candidates(grid, info)
    # per residency: fetch-all (admission moot) 2 evicts x 2 prefetch = 4; threshold x2, first-choice, zero: 4 rungs
    # x 2 admits x 2 evicts x 2 prefetch = 32
    assert len(cands) == 2 * (4 + 32) and len({c.name for c in cands}) == len(cands)
    assert {c.slots for c in cands} == {4, 8}
    assert all(c.admit == "off" for c in cands if c.rung.exact)
    c = next(c for c in cands if c.rung.rule == "threshold" and c.rung.tau == 0.2 and c.admit == "0.5"
             and c.evict == "lru" and c.prefetch == "on" and c.slots == 4)
    assert c.policy == "rule=threshold,tau=0.2,evict=lru,admit=0.5,prefetch=on"
    assert c.sim_spec() == c.policy + ",slots=4"
    off = next(c for c in cands if c.rung.rule == "zero" and c.prefetch == "off")
    assert "prefetch" not in off.policy  # the default is not written
    assert tune_candidates(TuneGrid(fractions=(0.01,)), info)[0].slots == 2  # at least k


@pytest.mark.parametrize(("grid", "match"), [
    (TuneGrid(fractions=()), "no residencies"),
    (TuneGrid(fractions=(1.5,)), "outside"),
    (TuneGrid(taus=(0.0,)), r"--taus value 0 is outside \(0, 1\]"),
    (TuneGrid(zero_taus=(2.0,)), "--zero-taus"),
    (TuneGrid(admits=("sometimes",)), "admission 'sometimes'"),
    (TuneGrid(evicts=("fifo",)), "--evicts fifo"),
    (TuneGrid(prefetch=("maybe",)), "--prefetch maybe"),
])
def test_a_bad_grid_is_one_line(grid: TuneGrid, match: str) -> None:
    with pytest.raises(HarnessError, match=match):
        tune_candidates(grid, _info())


def test_chains_start_with_fetch_all_and_grow_in_loss() -> None:
    g = TuneGrid(taus=(0.4, 0.1), zero_taus=(0.3, 0.1))
    sub = chain_rungs(g, "substitute")
    assert [r.name for r in sub] == ["fetch-all", "threshold tau=0.1", "threshold tau=0.4", "first-choice"]
    assert [r.level for r in sub] == [0, 1, 2, 3]
    assert [r.name for r in chain_rungs(g, "drop")] == ["fetch-all", "zero tau=0.1", "zero tau=0.3"]
    assert [r.name for r in chain_rungs(replace(g, first_choice=False), "substitute")][-1] == "threshold tau=0.4"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 13])
def test_bisection_finds_every_boundary_in_few_calls(n: int) -> None:
    rungs = [FETCH_ALL] + [Rung("substitute", "threshold", i / 100, i) for i in range(1, n)]
    for boundary in range(n):
        calls: list[int] = []

        def passes(r: Rung, b: int = boundary, calls: list[int] = calls) -> bool:
            calls.append(r.level)
            return r.level <= b

        assert bisect_chain(rungs, passes) == boundary
        assert 0 not in calls  # fetch-all is exact: never run
        assert len(calls) <= 1 + (math.ceil(math.log2(n - 1)) if n > 2 else 0)


def _point(rung: Rung, est_ms: float, fraction: float = 0.25, evict: str = "lfu", lost: float | None = None,
           prefetch: str = "off") -> SimPoint:
    from harness.domain.tune import Candidate

    return SimPoint(Candidate(rung, "off", evict, prefetch, fraction, 4), 1.0, 0.0,
                    0.1 * rung.level if lost is None else lost, 0.5, est_ms)


def test_best_per_rung_and_pick_fastest() -> None:
    g = TuneGrid(taus=(0.1, 0.2), zero_taus=(0.2,))
    t1, t2, fc = chain_rungs(g, "substitute")[1:]
    z = chain_rungs(g, "drop")[1]
    pts = [_point(FETCH_ALL, 10.0), _point(t1, 8.0), _point(t1, 7.5, evict="lru"), _point(t2, 6.0), _point(fc, 4.0),
           _point(z, 5.0), _point(z, 1.0, fraction=0.5)]
    best = best_per_rung(pts, 0.25)
    assert best[t1].candidate.evict == "lru" and best[z].est_ms == 5.0
    # within 1% of a rung's fastest estimate, the knobs that lose the least gate weight stand for it
    near = best_per_rung([_point(z, 5.0, lost=0.3), _point(z, 5.04, lost=0.2, prefetch="on"),
                          _point(z, 5.1, lost=0.1, evict="lru")], 0.25)
    assert near[z].candidate.prefetch == "on" and near[z].lost_mass == 0.2
    # boundaries: substitute at t2 (index 2), drop at z (index 1): of t1, t2 and z, z is the fastest (5.0 ms)
    asked: list[str] = []

    def ok(r: Rung) -> bool:
        asked.append(r.name)
        return True

    assert pick_fastest(best, {"substitute": 2, "drop": 1}, g, ok).candidate.rung == z
    # a rung that fails against the chain's order is dropped, the next fastest tried
    asked.clear()
    def not_z(r: Rung) -> bool:
        asked.append(r.name)
        return r != z

    got = pick_fastest(best, {"substitute": 2, "drop": 1}, g, not_z)
    assert got.candidate.rung == t2 and asked == ["zero tau=0.2", "threshold tau=0.2"]
    # nothing passes: fetch-all, exact, without a run
    assert pick_fastest(best, {"substitute": 3, "drop": 1}, g, lambda r: False).candidate.rung == FETCH_ALL


def test_the_bound_is_on_the_point_estimate() -> None:
    d = DeltaPPL(0.9, 0.2, 1.6, 10.0, 10.09, 100, 4, 100, 0)
    assert within_bound(d, 1.0) and not within_bound(d, 0.5)
    assert within_bound(replace(d, delta_pct=1.0), 1.0)
    assert not within_bound(None, 1.0) and not within_bound(replace(d, delta_pct=float("nan")), 1.0)
    assert not within_bound(d, 1.0, strict=True) and within_bound(d, 1.6, strict=True)  # on the CI's upper end


# ---- a measured speed ---------------------------------------------------------------------------------------------

def test_speed_cv_and_the_stability_rule_by_hand() -> None:
    assert speed_cv([90.0, 100.0, 110.0]) == pytest.approx(0.1)  # sd 10 of a mean of 100
    assert is_stable([90.0, 100.0, 110.0]) and not is_stable([80.0, 100.0, 120.0])  # 10% is stable, 20% is not
    assert math.isnan(speed_cv([5.0])) and not is_stable([5.0])  # one process: the spread is unknown
    c = SpeedCheck("decode", (80.0, 100.0, 120.0), first=(10.0, 100.0))
    assert c.rerun and not c.stable and c.cv == pytest.approx(0.2) and c.ci.mean == pytest.approx(100.0)
    line = stability_line([c], again=False)
    assert "decode: CV 20.0% over 3 runs" in line and "above 10%" in line and "measuring again" in line
    assert "\n" not in line and "UNSTABLE" in stability_line([c], again=True)


def test_compute_ms_span_by_hand() -> None:
    # 90, 100, 110 t/s: mean 100, sd 10, 95% CI 100 +/- t(0.975, 2) 10 / sqrt(3) = 100 +/- 24.841
    ms, fast, slow = compute_ms_span([90.0, 100.0, 110.0])
    assert ms == pytest.approx(10.0) and fast == pytest.approx(1000 / 124.841, rel=1e-4)
    assert slow == pytest.approx(1000 / 75.159, rel=1e-4)
    assert compute_ms_span([100.0, 100.0]) == (10.0, 10.0, 10.0)
    assert compute_ms_span([50.0]) == (20.0, 20.0, 20.0)
    # the CI's lower end below 0 (1 and 100 t/s): the slowest process stands for it
    assert compute_ms_span([1.0, 100.0])[2] == pytest.approx(1000.0)


def test_within_the_measurement_error_the_lower_loss_is_chosen() -> None:
    g = TuneGrid(taus=(0.1, 0.2), zero_taus=(0.2,))
    t1, t2 = chain_rungs(g, "substitute")[1:3]

    def pt(rung: Rung, est: float, span: tuple[float, float] | None, lost: float) -> SimPoint:
        return replace(_point(rung, est, lost=lost), est_span=span)

    asked: list[str] = []

    def ok(r: Rung) -> bool:
        asked.append(r.name)
        return True

    def pick(*pts: SimPoint, passes: Any = ok) -> Rung:
        return pick_fastest({p.candidate.rung: p for p in pts}, {"substitute": 2}, g, passes).candidate.rung

    # no interval: the fastest, however close
    assert pick(pt(t1, 10.0, None, 0.1), pt(t2, 9.9, None, 0.2)) == t2
    # spans that overlap: as fast as the measurement can tell, so the one that loses less
    assert pick(pt(t1, 10.0, (9.0, 11.0), 0.1), pt(t2, 9.5, (8.5, 10.5), 0.2)) == t1
    assert within_error(pt(t1, 10.0, (9.0, 11.0), 0.1), pt(t2, 9.5, (8.5, 10.5), 0.2))
    # spans apart: the fastest
    assert pick(pt(t1, 12.0, (11.5, 12.5), 0.1), pt(t2, 9.5, (8.5, 10.5), 0.2)) == t2
    # fetch-all within the error loses nothing: taken without a check; a lower-loss rung that fails is passed over
    asked.clear()
    assert pick(pt(FETCH_ALL, 10.4, (9.4, 11.4), 0.0), pt(t2, 9.5, (8.5, 10.5), 0.2)) == FETCH_ALL
    assert asked == ["threshold tau=0.2"]
    got = pick(pt(t1, 10.0, (9.0, 11.0), 0.1), pt(t2, 9.5, (8.5, 10.5), 0.2), passes=lambda r: r != t1)
    assert got == t2


def test_within_the_error_the_lower_measured_loss_wins_over_the_lower_gate_weight() -> None:
    """Issue 37: the zero rule lost less gate weight than the threshold rule and cost more (+0.49% against +0.25%):
    with measured losses, the measured one decides, and every rung within the error is checked."""
    g = TuneGrid(taus=(0.1,), zero_taus=(0.1,), first_choice=False)
    t = chain_rungs(g, "substitute")[1]
    z = chain_rungs(g, "drop")[1]
    deltas = {t: 0.25, z: 0.49}
    asked: list[str] = []

    def ok(r: Rung) -> bool:
        asked.append(r.name)
        return True

    pts = {t: replace(_point(t, 10.0, lost=0.2), est_span=(9.0, 11.0)),
           z: replace(_point(z, 9.95, lost=0.1), est_span=(8.9, 11.0))}
    bounds = {"substitute": 1, "drop": 1}
    # by gate weight (no measured loss given): z is the fastest and loses the least weight: z
    assert pick_fastest(pts, bounds, g, ok).candidate.rung == z
    # by the measured loss: t, checked although it loses more gate weight
    asked.clear()
    assert pick_fastest(pts, bounds, g, ok, deltas.get).candidate.rung == t
    assert sorted(asked) == ["threshold tau=0.1", "zero tau=0.1"]
    # the measured loss the other way round: z stays
    assert pick_fastest(pts, bounds, g, ok, {t: 0.6, z: 0.49}.get).candidate.rung == z
    # spans apart: the fastest, whatever it costs within the bound
    far = {**pts, t: replace(pts[t], est_ms=14.0, est_span=(13.5, 14.5))}
    assert pick_fastest(far, bounds, g, ok, deltas.get).candidate.rung == z


# ---- the machine ------------------------------------------------------------------------------------------------

FACTS = MachineFacts(cpus=2, mem_total=24 << 30, mem_available=16 << 30, gpus=(), disk_path="/m.gguf",
                     disk_expert_bytes=3 << 20, disk_read_bytes=1 << 20, disk_readers=4, disk_direct=True,
                     disk_expert_us=2000.0, disk_gbs=(3 << 20) / 2000e-6 / 1e9, host_copy_gbs=8.0,
                     compute_ms_per_token=10.0)


def test_machine_profile_by_hand() -> None:
    info = _info()  # 4 layers, 4 MoE layers, k=2, 3 MiB per expert, 10 MiB of other weights
    base = load_profile("cpu-disk")
    prof, src = machine_profile(FACTS, info, base, "file")
    resident = 10 * 2**20 + 2 * 3 * 2**20 * 4
    fixed_ms = 4 * base.layer_fixed_us * 1e-3
    assert prof.vram_bw_gbs == pytest.approx(resident / ((10.0 - fixed_ms) * 1e-3) / 1e9)
    assert prof.cpu_bw_gbs == prof.vram_bw_gbs and prof.layer_fixed_us == base.layer_fixed_us
    assert prof.h2d_bw_gbs == pytest.approx(3 * 2**20 / 2e-3 / 1e9) and prof.fetch_latency_us == 0.0
    assert prof.layer_roundtrip_us == base.layer_roundtrip_us and prof.vram_bytes == 24 << 30
    assert "O_DIRECT" in src["h2d_bw_gbs"] and "measured" in src["vram_bw_gbs"]
    # the cost model then charges a fetch exactly the measured time per expert
    from harness.domain.tune import estimate_ms
    assert estimate_ms(prof, info, 1.0, 0.0) - estimate_ms(prof, info, 0.0, 0.0) == pytest.approx(2.0)
    ram, _ = machine_profile(FACTS, info, base, "ram")
    assert ram.h2d_bw_gbs == 8.0
    # a decode faster than the base's fixed time per layer: the fixed time is scaled to half of it
    fast, src2 = machine_profile(replace(FACTS, compute_ms_per_token=0.4), info, base, "file")
    assert fast.layer_fixed_us == pytest.approx(50.0) and "half" in src2["layer_fixed_us"]
    gpu, src3 = machine_profile(replace(FACTS, gpus=("GPU 0",)), info, load_profile("rtx3090"), "ram")
    assert gpu.vram_bw_gbs == load_profile("rtx3090").vram_bw_gbs and "not measured" in src3["h2d_bw_gbs"]


# ---- the profile file -------------------------------------------------------------------------------------------

IDENTITY = ModelIdentity("m", "m.gguf", 1234, "00000000deadbeef", 16, 2, 4)


def _profile(**kw: Any) -> TuneProfile:
    choice = TuneChoice("25%", 0.25, 4, 16, "rule=zero,tau=0.2,evict=lfu,admit=off", "mode=engine,slots=4,...", 0.2,
                        -0.1, 0.5, 120.0, 80.0, 100.0)
    other = replace(choice, residency="12.5%", fraction=0.125, slots=2,
                    policy="rule=threshold,tau=0.1,evict=lru,admit=0.5")
    p = TuneProfile(IDENTITY, 1.0, "point estimate", "file", FACTS, {"name": "tuned"}, (choice, other),
                    "/t.txt", 512, 32, "2026-12-02T00:00:00+00:00", {"pin": "x"})
    return replace(p, **kw)


def test_profile_round_trip() -> None:
    p = _profile()
    text = profile_to_json(p)
    assert parse_tune_profile(text, "p.json") == p
    d = json.loads(text)
    assert d["schema"] == "moe-subst/tune-profile" and d["schema_version"] == 1
    assert d["model"]["fingerprint"] == "00000000deadbeef" and d["bound"]["max_delta_ppl_pct"] == 1.0
    assert "stability" not in d
    # the speeds measured and their stability: written, read back; one process' CV (unknown) is null, not NaN
    speeds = (SpeedCheck("decode in memory, cache off", (100.0, 80.0, 120.0), (10.0, 100.0)),
              SpeedCheck("decode with the engine, x", (50.0,)))
    text = profile_to_json(_profile(speeds=speeds))
    assert parse_tune_profile(text, "p.json").speeds == speeds
    st = json.loads(text)["stability"]
    assert st["stable"] is False and st["cv_warn"] == 0.1 and "NaN" not in text
    assert st["speeds"][0]["cv"] == pytest.approx(0.2) and st["speeds"][0]["rerun"] is True
    assert st["speeds"][0]["first_tokens_per_s"] == [10.0, 100.0] and st["speeds"][1]["cv"] is None
    # informational: a damaged stability object is not read (auto does not read it either), the profile is
    assert parse_tune_profile(_damage(json.loads(text), "stability.speeds", 3), "p.json").speeds == ()


def _damage(d: dict[str, Any], path: str, value: Any) -> str:
    cur = d
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur[int(k)] if k.isdigit() else cur[k]
    if value is _DEL:
        del cur[keys[-1]]
    else:
        cur[int(keys[-1]) if keys[-1].isdigit() else keys[-1]] = value
    return json.dumps(d)


_DEL = object()


@pytest.mark.parametrize(("path", "value", "match"), [
    ("schema", "other", "not a tuned profile"),
    ("schema_version", 2, "schema_version 2"),
    ("model.fingerprint", _DEL, "model lacks fingerprint"),
    ("choices", [], "choices is not a non-empty list"),
    ("choices.0.delta_pct", "big", "not a finite number"),
    ("choices.0.policy", "mode=engine,rule=zero", "not a policy's spec keys"),
    ("machine", 3, "machine is not an object"),
    ("bound", None, "bound or text"),
    ("bound.on", "vibes", "bound.on is 'vibes'"),
])
def test_a_damaged_profile_is_one_line(path: str, value: Any, match: str) -> None:
    text = _damage(json.loads(profile_to_json(_profile())), path, value)
    with pytest.raises(HarnessError, match=match):
        parse_tune_profile(text, "p.json")
    with pytest.raises(HarnessError, match="not JSON"):
        parse_tune_profile("{", "p.json")


def test_a_profile_of_another_model_is_refused() -> None:
    p = _profile()
    check_profile_model(p, IDENTITY, "p.json")
    for other in (replace(IDENTITY, file_bytes=1235), replace(IDENTITY, fingerprint="00000000deadbeee")):
        with pytest.raises(HarnessError, match="is of another model"):
            check_profile_model(p, other, "p.json")


def test_profile_locations_and_the_choice_auto_takes(tmp_path: Path) -> None:
    beside, keyed, legacy = profile_locations(Path("/models/q.gguf"), Path("/c"), "00000000deadbeef")
    assert beside == Path("/models/q.gguf.moe-tune.json")
    assert keyed == Path("/c/tune/q.gguf.00000000deadbeef.moe-tune.json")
    assert legacy == Path("/c/tune/q.gguf.moe-tune.json")
    home = Path("/home/u")
    assert tune_cache_dir({}, home) == Path("/home/u/.cache/moe-subst")
    assert tune_cache_dir({"XDG_CACHE_HOME": "/x"}, home) == Path("/x/moe-subst")
    assert tune_cache_dir({"XDG_CACHE_HOME": "/x", "MOE_SUBST_CACHE": "/m"}, home) == Path("/m")
    # what auto does with it: the entry with the most slots at or below those planned; none, or no profile: quality
    assert tuned_policy(None, 4) == ("", "policy quality (no tuned profile)")
    pol, why = tuned_policy(_profile(), 3, "p.json")
    assert pol == "rule=threshold,tau=0.1,evict=lru,admit=0.5" and "at 12.5%" in why and "point estimate" in why
    assert tuned_policy(_profile(), 4)[0] == "rule=zero,tau=0.2,evict=lfu,admit=off"
    pol, why = tuned_policy(_profile(), 1, "p.json")
    assert pol == "" and "more than the 1 slots planned" in why
    # read_profile_for: beside the model first, then the cache folder (keyed, then name-only); another model's is
    # refused
    model = tmp_path / "m.gguf"
    assert read_profile_for(model, IDENTITY, tmp_path / "cache") is None
    (tmp_path / "cache" / "tune").mkdir(parents=True)
    (tmp_path / "cache" / "tune" / "m.gguf.moe-tune.json").write_text(profile_to_json(_profile(bound_pct=0.25)))
    got = read_profile_for(model, IDENTITY, tmp_path / "cache")
    assert got is not None and got[1].name == "m.gguf.moe-tune.json" and got[0].bound_pct == 0.25
    (tmp_path / "cache" / "tune" / "m.gguf.00000000deadbeef.moe-tune.json").write_text(profile_to_json(_profile()))
    got = read_profile_for(model, IDENTITY, tmp_path / "cache")
    assert got is not None and got[1].name == "m.gguf.00000000deadbeef.moe-tune.json" and got[0].bound_pct == 1.0
    (tmp_path / "m.gguf.moe-tune.json").write_text(profile_to_json(_profile(bound_pct=0.5)))
    got = read_profile_for(model, IDENTITY, tmp_path / "cache")
    assert got is not None and got[0].bound_pct == 0.5 and got[1].parent == tmp_path
    with pytest.raises(HarnessError, match="another model"):
        read_profile_for(model, replace(IDENTITY, fingerprint="1" * 16), tmp_path / "cache")


# ---- the run, with fakes ----------------------------------------------------------------------------------------

N_TOK = 400


def _loss(label: str) -> float:
    """Per-token NLL shift: grows with the threshold (0.05 per unit tau), first-choice 0.03, zero 0.02 per unit tau;
    the presets quality 0.008, speed 0.02; on --check-text ("check:" labels) 1.5 times as much."""
    if label.startswith("check:"):
        return 1.5 * _loss(label[len("check:"):])
    if label.startswith(("full", "trace", "fetch-all", "rule=fetch-all")):
        return 0.0
    if label.startswith("quality"):
        return 0.008
    if label.startswith("speed"):
        return 0.02
    tau = re.search(r"tau=([\d.]+)", label)
    if "rule=threshold" in label and tau:
        return 0.05 * float(tau.group(1))
    if "rule=zero" in label and tau:
        return 0.02 * float(tau.group(1))
    if "rule=first-choice" in label:
        return 0.03
    raise AssertionError(label)


class TuneFake:
    """`speeds`: per bench label, the tokens/s of its next processes in turn (warm-up first); then 100 t/s with the
    cache off, 50 with the engine."""

    def __init__(self, speeds: dict[str, list[float]] | None = None) -> None:
        self.calls: list[str] = []
        self.dumps: dict[Path, NllDump] = {}
        self.speeds = {k: list(v) for k, v in (speeds or {}).items()}

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        self.calls.append(req.label)
        extra = dict(req.cache.extra) if req.cache else {}
        if "trace" in extra:
            write_expert_trace(Path(extra["trace"]), synthetic_trace(n_layer=4, n_expert=16, k=2, n_tokens=8, top_m=8))
        nll = np.random.default_rng(0).uniform(1.0, 3.0, N_TOK) + _loss(req.label)
        if req.nll_dump is not None:
                self.dumps[req.nll_dump] = NllDump(2 * (N_TOK // 4 + 1), N_TOK // 4 + 1, 4,
                                               np.arange(N_TOK, dtype=np.int32), nll)
        ppl = float(np.exp(nll.mean()))
        return PerplexityRun(PerplexityResult(ppl, 0.1, 4, 102, 102, 1, (ppl,)), None,
                             RunOutput(("t",), {}, 0, "", "", 0.1), CacheStats(0.0, 0.0, 1.0, "{}", tokens=N_TOK))

    def bench(self, build: Build, req: BenchRequest) -> BenchRun:
        self.calls.append(f"bench:{req.label}")
        queue = self.speeds.get(req.label)
        tps = queue.pop(0) if queue else 100.0 if req.cache is None else 50.0
        res = (BenchResult("c", "CPU", "", "m.gguf", 512, 512, 2, 99, 0, 0, req.n_gen, 0,
                           (int(req.n_gen * 1e9 / tps),), tps),)
        return BenchRun(res, RunOutput(("t",), {}, 0, "", "", 0.1))

    def load_nll(self, path: Path) -> NllDump:
        return self.dumps[path]


class TuneSimFake:
    """Fetches per token fall with the rung's loss: fetch-all 10, threshold 10 - 20 tau, first-choice 1, zero
    10 - 15 tau; LRU 10% fewer; admission 5% fewer with 0.5 in the background; prefetch 1 more in the background.
    Lost gate weight per token-layer: fetch-all none, threshold and zero tau / 10, first-choice 0.05."""

    def __init__(self) -> None:
        self.specs: list[str] = []

    def simulate(self, trace: Path, spec: str) -> SimRun:
        self.specs.append(spec)
        kv = dict(item.split("=", 1) for item in spec.split(","))
        rule = {"quality": "threshold", "speed": "first-choice", "fetch-all": "fetch-all"}.get(
            kv.get("policy", ""), kv.get("rule", ""))
        tau = float(kv.get("tau", 0.15 if kv.get("policy") == "quality" else 0))
        fetches = {"fetch-all": 10.0, "threshold": 10 - 20 * tau, "first-choice": 1.0, "zero": 10 - 15 * tau}[rule]
        background = 0.0
        if kv.get("evict") == "lru":
            fetches *= 0.9
        if kv.get("admit", "off") != "off":
            fetches *= 0.95
            background += 0.5
        if kv.get("prefetch") == "on":
            background += 1.0
        lost = {"fetch-all": 0.0, "threshold": tau / 10, "first-choice": 0.05, "zero": tau / 10}[rule]
        layers = [{"layer": i, "token_layers": 100, "fetches": fetches * 100 / 4, "admissions": background * 100 / 4,
                   "prefetches": 0} for i in range(4)]
        doc = {"config": {"slots": int(kv["slots"]), "n_expert": 16},
               "total": {"tokens": 100, "token_layers": 400, "hit_rate": 0.5, "subst_mass_sum": 400 * lost,
                         "drop_mass_sum": 0.0}, "layers": layers}
        return SimRun(spec, CacheStats(0.0, 0.0, fetches, "{}"), doc, None)


class FakeTuneEnv(FakeEnv, TuneEnvironment):
    def __init__(self, tmp: Path, fingerprint: int = 0xDEADBEEF, writable: bool = True,
                 cache: Path | None = None) -> None:
        FakeEnv.__init__(self, tmp)
        self.cache = cache or tmp / "cache"
        self._fingerprint, self._writable = fingerprint, writable

    def machine(self, model: Path, readers: int, disk: bool) -> MachineFacts:
        return replace(FACTS, compute_ms_per_token=None, disk_readers=readers if disk else 0)

    def fingerprint(self, model: Path) -> int:
        return self._fingerprint

    def cache_dir(self) -> Path:
        return self.cache

    def writable(self, folder: Path) -> bool:
        return self._writable and super().writable(folder)


# the grid the fakes' expectations were written for (the default's taus before 0.065, 0.08 and zero 0.05 came in)
OLD_GRID = TuneGrid(taus=(0.05, 0.1, 0.15, 0.25, 0.4), zero_taus=(0.1, 0.2, 0.3))


def _fake_run(tmp_path: Path, env: FakeTuneEnv | None = None, runner: TuneFake | None = None,
              warn: Any = None, **kw: Any) -> tuple[Any, TuneFake, TuneSimFake]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    text = tmp_path / "t.txt"
    text.write_text("text")
    kw.setdefault("grid", OLD_GRID)
    opts = TuneOptions(out=tmp_path / "out", model=model, text=text, argv=("harness", "tune"), **kw)
    runner, sim = runner or TuneFake(), TuneSimFake()
    info = replace(_info(n_expert=16, k=2), file_bytes=1234)
    return run_tune(opts, runner, sim, info, env=env or FakeTuneEnv(tmp_path),
                    warn=warn if warn is not None else [].append), runner, sim


def test_two_models_of_one_file_name_keep_two_profiles(tmp_path: Path) -> None:
    """Two models called m.gguf in folders tune cannot write: both profiles go to the cache folder, keyed by the
    fingerprint, and each reads back for its own model (before the key, the second replaced the first)."""
    cache = tmp_path / "cache"
    one, _, _ = _fake_run(tmp_path / "a", FakeTuneEnv(tmp_path / "a", 0xA, writable=False, cache=cache))
    two, _, _ = _fake_run(tmp_path / "b", FakeTuneEnv(tmp_path / "b", 0xB, writable=False, cache=cache),
                          max_delta_pct=0.6)
    assert one.profile_path == cache / "tune" / "m.gguf.000000000000000a.moe-tune.json"
    assert two.profile_path == cache / "tune" / "m.gguf.000000000000000b.moe-tune.json"
    for res in (one, two):
        got = read_profile_for(res.opts.model, res.identity, cache)
        assert got is not None and got[1] == res.profile_path and got[0].bound_pct == res.opts.max_delta_pct


def test_run_tune_with_fakes(tmp_path: Path) -> None:
    res, runner, sim = _fake_run(tmp_path)
    # the trace run first (the full model), the decode rate (a warm-up and 5 processes), then the search's checks and
    # the presets
    assert runner.calls[:7] == ["full"] + ["bench:compute"] * 6
    checks = [c for c in runner.calls[2:] if "slots=" in c]
    # substitute chain: first-choice (fails), tau 0.15 (passes: 0.75%), tau 0.25 (fails); drop chain: zero 0.3
    # (passes); the choice is zero 0.3 (5.5 fetches, less with LRU and admission); then the three presets
    assert [c.split(",")[:2] for c in checks[:4]] == [["rule=first-choice", "evict=lru"],
                                                      ["rule=threshold", "tau=0.15"], ["rule=threshold", "tau=0.25"],
                                                      ["rule=zero", "tau=0.3"]]
    assert checks[4:] == ["quality slots=4", "speed slots=4"]  # fetch-all never substitutes: not run
    assert len(sim.specs) == len(tune_candidates(OLD_GRID, _info(n_expert=16, k=2))) + 3
    (choice,) = res.choices
    assert choice.policy == "rule=zero,tau=0.3,evict=lru,admit=0.5" and choice.slots == 4
    assert choice.spec == "mode=engine,slots=4,rule=zero,tau=0.3,evict=lru,admit=0.5,host=file"
    assert choice.delta_pct == pytest.approx(100 * math.expm1(0.006))
    assert choice.est_quality_tokens_per_s is not None
    assert choice.est_tokens_per_s > choice.est_quality_tokens_per_s > choice.est_fetch_all_tokens_per_s
    roles = {r.role: r for r in res.rows}
    assert roles["fetch-all"].delta is None and roles["fetch-all"].exact and roles["fetch-all"].passes
    assert roles["speed"].passes is False and roles["quality"].passes is True
    # the profile: next to the model (its folder is writable), and a copy in --out; it reads back for this model
    assert res.profile_path == tmp_path / "m.gguf.moe-tune.json"
    got = read_profile_for(tmp_path / "m.gguf", res.identity, tmp_path / "cache")
    assert got is not None and got[0].choices == res.choices and got[0].model.fingerprint == "00000000deadbeef"
    assert (tmp_path / "out" / "profile.moe-tune.json").read_text() == res.profile_path.read_text()
    assert len((tmp_path / "out" / "sim.jsonl").read_text().splitlines()) == res.n_simulated
    md = render_tune_markdown(res)
    assert "**tuned**" in md and "ESTIMATE" in md and "O_DIRECT" in md and "not run (`--measure`)" in md
    assert any("Residency 25%" in line for line in summary_lines(res))
    # resumed: the same out folder reruns no perplexity run (the bound may change: records are per configuration)
    again = TuneFake()
    again.dumps = runner.dumps
    opts2 = replace(res.opts, max_delta_pct=0.6)
    (tmp_path / "out" / "router.trace").unlink()  # not committed with the records: recorded again, not as a run
    res2 = run_tune(opts2, again, TuneSimFake(), replace(_info(n_expert=16, k=2), file_bytes=1234),
                    env=FakeTuneEnv(tmp_path))
    assert again.calls.pop(0) == "trace" and (tmp_path / "out" / "router.trace").is_file()
    # bisection below the recorded failures: only the rungs not run before (no full run, no preset, no decode run)
    assert [c.split(",")[:2] for c in again.calls] == [["rule=threshold", "tau=0.05"], ["rule=threshold", "tau=0.1"],
                                                       ["rule=zero", "tau=0.1"], ["rule=zero", "tau=0.2"]]
    assert res2.choices[0].delta_pct <= 0.6


def test_run_tune_check_text_judges_the_choice_out_of_sample(tmp_path: Path) -> None:
    """--check-text: the full model and then the choice and the quality preset on the other text, paired there; the
    bound judged there too (the fake's losses are 1.5x on it: zero tau=0.3, +0.60% where chosen, is +0.90% there,
    within 1%; at a 0.7% bound the choice passes where chosen and not there); the same text is refused."""
    other = tmp_path / "other.txt"
    tmp_path.mkdir(parents=True, exist_ok=True)
    other.write_text("other text")
    res, runner, _ = _fake_run(tmp_path, check_text=other)
    checks = [c for c in runner.calls if c.startswith("check:")]
    assert checks[0] == "check:full" and len(checks) == 3
    chosen, quality = res.out_of_sample
    assert chosen.role == "chosen" and quality.role == "quality" and chosen.policy == res.choices[0].policy
    assert chosen.delta is not None and chosen.delta.delta_pct == pytest.approx(100 * math.expm1(1.5 * 0.006))
    assert chosen.within_bound and quality.delta is not None
    assert quality.delta.delta_pct == pytest.approx(100 * math.expm1(1.5 * 0.008))
    lines = "\n".join(summary_lines(res))
    assert "### Out of sample" in lines and "other.txt" in lines
    tight, _, _ = _fake_run(tmp_path / "t", check_text=other, max_delta_pct=0.7)
    assert tight.choices[0].delta_pct <= 0.7
    chosen_t = next(c for c in tight.out_of_sample if c.role == "chosen")
    assert chosen_t.delta is not None and chosen_t.delta.delta_pct > 0.7 and not chosen_t.within_bound
    assert "**no**" in "\n".join(summary_lines(tight))
    with pytest.raises(HarnessError, match="is the text the choice is made on"):
        _fake_run(tmp_path / "same", check_text=tmp_path / "same" / "t.txt")


def test_run_tune_measure_and_errors(tmp_path: Path) -> None:
    res, runner, _ = _fake_run(tmp_path, measure=True, runs=2,
                               grid=TuneGrid(taus=(0.1,), zero_taus=(), admits=("off",), evicts=("lfu",),
                                             prefetch=("off",)))
    benches = [c for c in runner.calls if c.startswith("bench:") and c != "bench:compute"]
    assert len(benches) == 3 * 4  # the choice and three presets: a warm-up each, then interleaved, twice
    chosen = next(r for r in res.rows if r.role == "chosen")
    assert chosen.measured is not None and chosen.measured.mean == pytest.approx(50.0)
    assert res.choices[0].measured_tokens_per_s == pytest.approx(50.0)
    (tmp_path / "b").mkdir()
    with pytest.raises(HarnessError, match="--max-delta-ppl must be above 0"):
        _fake_run(tmp_path / "b", max_delta_pct=0.0)
    for kw in ({"measure_grid": 3}, {"measure": True, "measure_grid": -1}):
        with pytest.raises(HarnessError, match="--measure-grid"):
            _fake_run(tmp_path / "b", **kw)
    with pytest.raises(HarnessError, match="--runs 1: at least 2 processes"):
        _fake_run(tmp_path / "b", measure=True, runs=1)


def test_run_tune_measure_grid(tmp_path: Path) -> None:
    """--measure-grid 5: the 5 fastest estimated grid points within the bound are measured beside the choice: none of
    a rung the check found over the bound (first-choice, tau 0.25 in the fakes), none above a chain's boundary, not
    the choice again; the report says whether the choice is within 5% of the fastest measured."""
    res, runner, _ = _fake_run(tmp_path, measure=True, runs=2, measure_grid=5)
    grid = [r for r in res.rows if r.role == "grid"]
    chosen = next(r for r in res.rows if r.role == "chosen")
    assert len(grid) == 5 and chosen.name not in {r.name for r in grid}
    for r in grid:
        assert "first-choice" not in r.policy and "tau=0.25" not in r.policy and "tau=0.4" not in r.policy
        assert r.measured is not None and r.passes
        assert r.est_ms >= chosen.est_ms * 0.99  # the choice is its rung's best knobs, the fastest rung in the pool
    assert [r.est_ms for r in grid] == sorted(r.est_ms for r in grid)
    benches = [c for c in runner.calls if c.startswith("bench:") and c != "bench:compute"]
    assert len(benches) == 3 * (1 + 3 + 5)  # a warm-up and 2 processes each
    md = "\n".join(summary_lines(res))
    assert "fastest estimated grid points within the bound" in md and "**held**" in md  # every fake bench is 50 t/s


def _compute_calls(runner: TuneFake) -> int:
    return sum(1 for c in runner.calls if c == "bench:compute")


def test_the_decode_rate_is_a_warm_up_and_five_processes(tmp_path: Path) -> None:
    """The decode rate is the mean of 5 processes after a discarded warm-up (a cold first run, 1 t/s here, as the
    issue's 91.5 ms/token against 0.7 idle), stable: no warning, recorded in the profile and the report."""
    warnings: list[str] = []
    runner = TuneFake({"compute": [1.0, 100.0, 101.0, 99.0, 100.0, 100.0]})
    res, _, _ = _fake_run(tmp_path, runner=runner, warn=warnings.append)
    assert _compute_calls(runner) == 6 and warnings == []
    assert res.machine.compute_ms_per_token == pytest.approx(10.0)
    (check,) = res.speeds
    assert check.samples == (100.0, 101.0, 99.0, 100.0, 100.0) and check.stable and not check.rerun
    st = json.loads(res.profile_path.read_text())["stability"]
    assert st["stable"] is True and st["speeds"][0]["tokens_per_s"] == list(check.samples)
    md = render_tune_markdown(res)
    assert "## Measurement stability" in md and "| decode in memory, cache off | 5 |" in md and "UNSTABLE" not in md


def _warn_run(tmp_path: Path, speeds: dict[str, list[float]], **kw: Any) -> tuple[Any, TuneFake, list[str]]:
    warnings: list[str] = []
    runner = TuneFake(speeds)
    res, _, _ = _fake_run(tmp_path, runner=runner, warn=warnings.append, **kw)
    return res, runner, warnings


def test_an_unstable_decode_rate_is_measured_again(tmp_path: Path) -> None:
    """A first round whose CV is above 10%: one warning line naming it, the 5 processes again; the re-run, stable, is
    the measurement (the first round recorded beside it)."""
    first = [100.0, 50.0, 100.0, 50.0, 100.0]
    res, runner, warnings = _warn_run(tmp_path, {"compute": [1.0, *first, *[125.0] * 5]})
    assert _compute_calls(runner) == 11
    (line,) = warnings
    assert f"CV {speed_cv(first) * 100:.1f}% over 5 runs" in line and "measuring again" in line
    assert res.machine.compute_ms_per_token == pytest.approx(8.0)
    (check,) = res.speeds
    assert check.rerun and check.first == tuple(first) and check.stable
    assert any("measured again, stable" in n for n in res.notes) and res.stable
    # resumed: every process is recorded, none is run again
    again = TuneFake({"compute": [7.0] * 11})
    again.dumps = runner.dumps
    res2 = run_tune(res.opts, again, TuneSimFake(), replace(_info(n_expert=16, k=2), file_bytes=1234),
                    env=FakeTuneEnv(tmp_path), warn=[].append)
    assert _compute_calls(again) == 0 and res2.machine.compute_ms_per_token == pytest.approx(8.0)


def test_a_decode_rate_still_unstable_is_recorded_and_costs_no_quality(tmp_path: Path) -> None:
    """Unstable twice: a second line, the instability in the profile, the report and the summary; and with estimates
    the measurement cannot tell apart, the choice is the one that loses the least (fetch-all here, exact) instead of
    the fastest estimate (zero tau=0.3 with a stable rate, test_run_tune_with_fakes)."""
    wild = [200.0, 30.0, 200.0, 30.0, 100.0]
    res, runner, warnings = _warn_run(tmp_path, {"compute": [1.0, *wild, *wild]})
    assert _compute_calls(runner) == 11 and len(warnings) == 2
    assert "measuring again" in warnings[0] and "still unstable after a re-run" in warnings[1]
    assert f"CV {speed_cv(wild) * 100:.1f}%" in warnings[1] and warnings[1] in res.notes
    assert not res.stable and not res.speeds[0].stable
    d = json.loads(res.profile_path.read_text())
    assert d["stability"]["stable"] is False and d["stability"]["speeds"][0]["rerun"] is True
    assert "UNSTABLE" in render_tune_markdown(res) and "**UNSTABLE measurement**" in summary_lines(res)[2]
    (choice,) = res.choices
    assert choice.policy.startswith("rule=fetch-all") and choice.delta_pct == 0.0
    stable, _, _ = _fake_run(tmp_path / "stable")
    assert stable.choices[0].policy.startswith("rule=zero,tau=0.3")


def test_measure_warms_up_checks_and_measures_again(tmp_path: Path) -> None:
    """--measure: a warm-up process per configuration (discarded), --runs processes each (5 by default); one
    configuration unstable: one warning, every configuration measured again (the same conditions for all), the
    re-run's mean is the measured speed."""
    grid = TuneGrid(taus=(0.1,), zero_taus=(), admits=("off",), evicts=("lfu",), prefetch=("off",))
    res, runner, warnings = _warn_run(tmp_path, {"quality slots=4": [1.0, 90.0, 30.0, 90.0, 30.0, 90.0,
                                                                     *[80.0] * 5]}, measure=True, grid=grid)
    per = {c: runner.calls.count(c) for c in runner.calls if c.startswith("bench:") and "slots" in c}
    assert per and set(per.values()) == {1 + 5 + 5}  # all four, the re-run too
    (line,) = warnings
    assert "decode with the engine, quality slots=4: CV" in line
    rows = {r.role: r for r in res.rows}
    assert rows["quality"].measured is not None and rows["quality"].measured.mean == pytest.approx(80.0)
    assert rows["chosen"].measured is not None and rows["chosen"].measured.n == 5
    assert {c.what for c in res.speeds} >= {"decode in memory, cache off", "decode with the engine, quality slots=4"}
    assert res.stable and "5 processes after a discarded warm-up" in "\n".join(summary_lines(res))
    # a configuration unstable twice: its measured speed says so in the table
    res2, _, warnings2 = _warn_run(tmp_path / "b", {"speed slots=4": [1.0, *[90.0, 30.0] * 5]}, measure=True,
                                   runs=5, grid=grid)
    assert len(warnings2) == 2 and not res2.stable
    speed = next(r for r in res2.rows if r.role == "speed")
    assert speed.measured is not None and "UNSTABLE: CV" in "\n".join(summary_lines(res2))


def test_grid_verdict() -> None:
    def m(x: float) -> MeanCI:
        return mean_ci([x])

    assert grid_verdict(m(96.0), [m(100.0), m(80.0)]) == "held"
    assert grid_verdict(m(94.0), [m(100.0)]) == "did not hold"
    assert grid_verdict(m(120.0), [m(100.0)]) == "held"
    assert grid_verdict(None, [m(100.0)]) == "not measured" and grid_verdict(m(1.0), [None]) == "not measured"


def test_cli_help_names_the_options() -> None:
    from harness.cli.app import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["tune"]  # type: ignore[union-attr]
    text = sub.format_help()
    for opt in ("--max-delta-ppl", "--text", "--residency", "--measure", "--measure-grid", "--profile-out", "--host",
                "--readers"):
        assert opt in text


# ---- end to end on the trained model ------------------------------------------------------------------------------

@pytest.mark.build
def test_tune_the_trained_model(patched_build: Build, stock_build: Build, tmp_path: Path) -> None:
    """A tiny grid (one threshold, one zero tau, one speed knob) on 2 chunks: the machinery end to end, about a
    minute on 2 busy cores."""
    from harness.orchestration.tune import model_identity, tune
    from harness.parsers.gguf_model import read_model_info

    if not TRAINED.is_file():
        pytest.skip("no trained model")
    out = tmp_path / "out"
    opts = TuneOptions(out=out, model=TRAINED, text=ROOT / "eval" / "data" / "heldout.txt", n_ctx=256, chunks=2,
                       grid=TuneGrid(taus=(0.1,), zero_taus=(0.2,), admits=("0.5",), evicts=("lfu",),
                                     prefetch=("off",)),
                       profile_out=tmp_path / "tinymoe.moe-tune.json", threads=1)
    res = tune(opts)
    roles = {r.role: r for r in res.rows}
    assert set(roles) >= {"chosen", "quality", "speed", "fetch-all"}
    assert roles["fetch-all"].exact and roles["chosen"].passes
    # fetch-all at the residency never substitutes: exactly the full model's NLLs (the trace run: fetch-all with every
    # expert resident), which is why tune takes the trace run as the reference and does not run fetch-all
    from harness.tools.requests import CacheSpec, Placement
    from harness.tools.runners import ToolRunner

    runner = ToolRunner()
    req = opts.perplexity_request(TRAINED, opts.text or Path(), Placement(n_cpu_moe=999),
                                  cache=CacheSpec("emulate", "fetch-all", 16), nll_dump=tmp_path / "fa.bin", label="fa")
    runner.perplexity(patched_build, req)
    full, fa = runner.load_nll(out / "nll" / "full.bin"), runner.load_nll(tmp_path / "fa.bin")
    assert np.array_equal(full.tokens, fa.tokens) and np.array_equal(full.nll, fa.nll)
    assert res.machine.disk_gbs > 0 and res.machine.compute_ms_per_token is not None
    assert res.cost_profile.h2d_bw_gbs == res.machine.disk_gbs
    info = read_model_info(TRAINED)
    from harness.parsers.gguf_model import model_fingerprint

    mine = model_identity(info, TRAINED, model_fingerprint(TRAINED))
    prof = parse_tune_profile((tmp_path / "tinymoe.moe-tune.json").read_text(), "p")
    check_profile_model(prof, mine, "p")
    assert prof.choices[0].slots == 16 and prof.choices[0].n_expert == 64
    with pytest.raises(HarnessError, match="another model"):
        check_profile_model(prof, replace(mine, fingerprint="0" * 16), "p")
    assert (out / "report.md").is_file() and (out / "router.trace").is_file()


def test_disk_rate_reads_experts_as_the_engine_does() -> None:
    """harness.tools.machine on the trained model: one expert is its slice of each of its layer's expert tensors (the
    cost model's bytes per expert), read in slices of one tensor's expert; the rate is positive and finite."""
    from harness.parsers.gguf_model import read_model_info
    from harness.tools.machine import disk_rate, expert_slices

    if not TRAINED.is_file():
        pytest.skip("no trained model")
    info = read_model_info(TRAINED)
    n_expert, slices = expert_slices(TRAINED)
    assert n_expert == info.n_expert and sorted(slices) == list(info.moe_layers)
    size = TRAINED.stat().st_size
    assert all(off + n_expert * n <= size for s in slices.values() for off, n in s)
    r = disk_rate(TRAINED, readers=2, max_bytes=4 << 20)
    assert r.expert_bytes == info.bytes_per_expert and r.readers == 2
    assert r.read_bytes == max(info.bytes_per_expert_tensor.values())
    assert 0 < r.gbs < 1e3 and r.expert_s > 0
    with pytest.raises(HarnessError, match="at least 1"):
        disk_rate(TRAINED, readers=0)
