"""Prefetch (`prefetch=on`, issue 13 item 2), end to end on generated models with the built binaries.

Each MoE layer's route step applies the next MoE layer's router to its own input, and the predicted experts that
are not resident are admitted in the background before that layer decides the token (docs/expert-cache.md
"Prefetch"). Checked here:

- emulate fetch-all with prefetch computes exactly what stock computes (the residency changes, the values do not),
  on a plain router (qwen3moe), a sigmoid router with a selection bias (hy_v3) and a router bias (gpt-oss);
- quality with prefetch prefetches, and its residency differs from quality without it;
- the engine (one-token ubatches, and groups of three) takes emulate's decisions with prefetch, every prefetch is
  one background copy, and its bytes are counted;
- llama-moe-sim replays a prefetch run exactly (the trace, version 2, carries each token-layer's prediction), and
  refuses prefetch=on on a version-1 trace.
The policy's prefetch accounting on hand-made sequences: tests/cpp/test_expert_policy.cpp (test_prefetch).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.core.errors import BuildMissingError
from harness.core.project import Build
from harness.parsers.nll_dump import read_nll_dump_file
from harness.parsers.sim import SIM_TOOL
from harness.parsers.trace import ExpertTrace, read_expert_trace, trace_dtype, write_expert_trace
from harness.tools.synth import SynthSpec, synth_text, write_synth_model

ARCHS = ("qwen3moe", "hy_v3", "gpt-oss")  # a plain router; sigmoid with a selection bias; a router bias
N_EXPERT = 64
K = 8
N_LAYER = 4  # the first MoE layer is never predicted, and llama-perplexity's last layer decides only output tokens
N_CTX = 64
N_CHUNKS = 3
THREADS = "2"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("prefetch-models")
    return {arch: write_synth_model(SynthSpec(arch=arch, n_expert=N_EXPERT, n_expert_used=K, n_layer=N_LAYER, seed=3),
                                    out / f"{arch}.gguf") for arch in ARCHS}


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prefetch-text") / "text.txt"
    path.write_text(synth_text(12000, seed=1))
    return path


@dataclass
class Run:
    output: str
    logits: bytes
    nll: np.ndarray | None
    stats: dict[str, Any] | None


def run_ppl(build: Build, model: Path, text: Path, tmp: Path, spec: str | None = None, *, ubatch: int | None = None,
            env: dict[str, str] | None = None, nll_dump: bool = True) -> Run:
    """llama-perplexity, one sequence per batch; results from the files it writes (the stock build has no
    --nll-dump: nll_dump=False)."""
    tmp.mkdir(parents=True, exist_ok=True)
    stats, logits, nll = tmp / "stats.json", tmp / "logits.bin", tmp / "nll.bin"
    full_env = {**{k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}, **(env or {})}
    if spec is not None:
        full_env["LLAMA_MOE_CACHE"] = f"{spec},stats={stats}"
    args = [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(N_CTX), "-b", str(N_CTX),
            "--chunks", str(N_CHUNKS), "-t", THREADS, "--seed", "1", "--kl-divergence-base", str(logits)]
    if nll_dump:
        args += ["--nll-dump", str(nll)]
    if ubatch is not None:
        args += ["-ub", str(ubatch)]
    res = subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    return Run(out, logits.read_bytes(), read_nll_dump_file(nll).nll if nll_dump else None,
               json.loads(stats.read_text()) if spec is not None and stats.exists() else None)


def check_prefetch_counters(stats: dict[str, Any]) -> None:
    """prefetches = used + wasted + still resident unused; the first MoE layer is never predicted."""
    for s in [stats["total"], *stats["layers"]]:
        assert s["prefetch_used"] + s["prefetch_wasted"] <= s["prefetches"]
        assert s["prefetches"] <= s["evictions"] + stats["config"]["slots"]
        assert s["hits"] + s["misses"] + s["skips"] == s["calls"]
        assert s["fetches"] + s["substitutions"] + s["drops"] + s["host_computes"] == s["misses"]
    assert stats["layers"][0]["prefetches"] == 0
    assert stats["total"]["prefetches"] > 0 and stats["total"]["prefetch_used"] > 0


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
def test_emulate_fetch_all_with_prefetch_is_stock(arch: str, models: dict[str, Path], text: Path, tmp_path: Path,
                                                  stock_build: Build, patched_build: Build) -> None:
    model = models[arch]
    stock = run_ppl(stock_build, model, text, tmp_path / "stock", nll_dump=False)
    off = run_ppl(patched_build, model, text, tmp_path / "off", "mode=off")
    fa = run_ppl(patched_build, model, text, tmp_path / "fa", "mode=emulate,policy=fetch-all,slots=25%")
    pf = run_ppl(patched_build, model, text, tmp_path / "pf", "mode=emulate,policy=fetch-all,slots=25%,prefetch=on")
    assert len(stock.logits) > 1000
    assert pf.logits == stock.logits  # bit for bit
    assert pf.nll is not None and off.nll is not None and pf.nll.tobytes() == off.nll.tobytes()
    assert pf.stats is not None and fa.stats is not None
    assert pf.stats["config"]["prefetch"] is True and fa.stats["config"]["prefetch"] is False
    check_prefetch_counters(pf.stats)
    assert fa.stats["total"]["prefetches"] == 0
    # the residency changed: the same tokens hit and fetch differently
    assert (pf.stats["total"]["hits"], pf.stats["total"]["fetches"]) != (fa.stats["total"]["hits"],
                                                                          fa.stats["total"]["fetches"])
    assert pf.stats["total"]["calls"] == fa.stats["total"]["calls"]


@pytest.mark.build
def test_quality_with_prefetch_changes_the_residency(models: dict[str, Path], text: Path, tmp_path: Path,
                                                     patched_build: Build) -> None:
    model = models["qwen3moe"]
    q = run_ppl(patched_build, model, text, tmp_path / "q", "mode=emulate,policy=quality,slots=25%")
    pf = run_ppl(patched_build, model, text, tmp_path / "pf", "mode=emulate,policy=quality,slots=25%,prefetch=on")
    assert q.stats is not None and pf.stats is not None
    check_prefetch_counters(pf.stats)
    assert q.stats["total"]["prefetches"] == 0
    tq, tp = q.stats["total"], pf.stats["total"]
    assert (tq["hits"], tq["fetches"], tq["substitutions"]) != (tp["hits"], tp["fetches"], tp["substitutions"])
    # the layer before the first predicted one is untouched: layers are independent
    assert q.stats["layers"][0] == pf.stats["layers"][0]


@pytest.mark.build
@pytest.mark.parametrize(("arch", "policy", "ubatch"), [("qwen3moe", "quality", 1), ("hy_v3", "fetch-all", 1),
                                                        ("gpt-oss", "speed", 1), ("qwen3moe", "quality", 3)])
def test_engine_equals_emulate_with_prefetch(arch: str, policy: str, ubatch: int, models: dict[str, Path],
                                             text: Path, tmp_path: Path, patched_build: Build) -> None:
    """One-token ubatches: the engine prefetches at the predicting layer's step, a background copy (held back 100 us
    by the copy thread, so that a slot used or overwritten before its copy completed would show), and takes exactly
    emulate's decisions; groups of three tokens (slots=50%: group_max 4) prefetch token by token as emulate does.
    In llama-perplexity the last layer decides only the output tokens: with one-token ubatches the engine prefetches
    it only for them, as emulate does."""
    model = models[arch]
    spec = f"policy={policy},slots=50%,prefetch=on"
    emu = run_ppl(patched_build, model, text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=ubatch)
    eng = run_ppl(patched_build, model, text, tmp_path / "eng", f"mode=engine,async=thread,{spec}", ubatch=ubatch,
                  env={"LLAMA_MOE_CACHE_TEST_COPY_DELAY_US": "100"})
    assert emu.stats is not None and eng.stats is not None
    assert eng.stats["total"] == emu.stats["total"] and eng.stats["layers"] == emu.stats["layers"]
    check_prefetch_counters(eng.stats)
    t, e = eng.stats["total"], eng.stats["engine"]
    if ubatch == 1:
        assert eng.stats["layers"][-1]["prefetches"] > 0  # the last layer, for its output tokens
        # every prefetch is a background copy, as every admission is
        assert e["background_experts"] == t["admissions"] + t["prefetches"]
        pending = t["fetches"] + t["admissions"] + t["prefetches"] - e["copied_experts"]
        assert 0 <= pending <= e["deferred_experts"]
    per_expert = e["copy_bytes"] // max(1, e["copied_experts"]) if ubatch == 1 else None
    assert e["prefetch_bytes"] > 0 and e["prefetch_wasted_bytes"] <= e["prefetch_bytes"]
    if per_expert is not None:
        assert e["prefetch_bytes"] == t["prefetches"] * per_expert
        assert e["prefetch_wasted_bytes"] == t["prefetch_wasted"] * per_expert
    assert eng.nll is not None and emu.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.build
def test_engine_prefetch_refuses_async_off(models: dict[str, Path], text: Path, tmp_path: Path,
                                           patched_build: Build) -> None:
    env = {**os.environ, "LLAMA_MOE_CACHE": "mode=engine,policy=quality,async=off,prefetch=on"}
    res = subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(models["qwen3moe"]), "-f", str(text),
                          "-c", str(N_CTX), "--chunks", "1", "-t", THREADS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode != 0
    assert "prefetch=on copies the predicted experts in the background, and async=off" in res.stdout + res.stderr


# ---- the simulator ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim_tool(patched_build: Build) -> Path:
    try:
        return patched_build.tool(SIM_TOOL)
    except BuildMissingError as e:
        pytest.skip(str(e))


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    d = json.loads(json.dumps(doc))
    d["config"].pop("spec")
    d.pop("route_ns")
    d.pop("route_ns_per_token_layer")
    return d


def sim(tool: Path, trace: Path, spec: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tool), "--trace", str(trace), "--spec", spec, "--stats", str(out), "--verify", "-q"],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.build
@pytest.mark.parametrize(("arch", "spec"), [("qwen3moe", "policy=quality,slots=25%,prefetch=on"),
                                            ("hy_v3", "rule=threshold,tau=0.3,evict=classlru,slots=16,prefetch=on"),
                                            ("gpt-oss", "policy=speed,evict=lru,slots=12,prefetch=on")])
def test_simulator_equals_emulate_with_prefetch(arch: str, spec: str, models: dict[str, Path], text: Path,
                                                tmp_path: Path, patched_build: Build, sim_tool: Path) -> None:
    trace = tmp_path / "trace.bin"
    run = run_ppl(patched_build, models[arch], text, tmp_path / "emu",
                  f"mode=emulate,{spec},trace={trace},trace_top={N_EXPERT}")
    assert run.stats is not None
    check_prefetch_counters(run.stats)
    tr = read_expert_trace(trace)
    assert tr.version == 2 and tr.has_pred
    first = tr.records[tr.records["layer"] == 0]
    assert np.all(first["pred"] == -1)  # nothing predicts the first MoE layer
    assert np.any(tr.records["pred"] >= 0)
    res = sim(sim_tool, trace, spec, tmp_path / "sim.json")
    assert res.returncode == 0, res.stderr
    assert "verify: 0 of" in res.stderr and "differ in their actions, 0 more" in res.stderr
    assert comparable(json.loads((tmp_path / "sim.json").read_text())) == comparable(run.stats)


@pytest.mark.build
def test_simulator_prefetch_on_other_traces(models: dict[str, Path], text: Path, tmp_path: Path,
                                            patched_build: Build, sim_tool: Path) -> None:
    """Every version-2 trace carries the predictions, so a run without prefetch replays with it (a sweep); a
    version-1 trace replays without prefetch and is refused with it, in one line."""
    trace = tmp_path / "trace.bin"
    run_ppl(patched_build, models["qwen3moe"], text, tmp_path / "emu",
            f"mode=emulate,policy=fetch-all,slots=25%,trace={trace},trace_top={N_EXPERT}")
    res = sim(sim_tool, trace, "policy=fetch-all,slots=25%,prefetch=on", tmp_path / "on.json")
    assert res.returncode == 3, res.stderr  # decisions differ from the recorded run's, as they should
    assert json.loads((tmp_path / "on.json").read_text())["total"]["prefetches"] > 0
    # the same trace as version 1 (no prediction)
    t = read_expert_trace(trace)
    dt1 = trace_dtype(t.k, t.top_m, 1)
    rec1 = np.zeros(len(t.records), dtype=dt1)
    for name in dt1.names or ():
        rec1[name] = t.records[name]
    v1 = write_expert_trace(tmp_path / "v1.bin", ExpertTrace(1, t.n_layer, t.n_expert, t.k, t.top_m, t.n_slots, rec1))
    res = sim(sim_tool, v1, "policy=fetch-all,slots=25%", tmp_path / "v1.json")
    assert res.returncode == 0, res.stderr
    res2 = sim(sim_tool, trace, "policy=fetch-all,slots=25%", tmp_path / "v2.json")
    assert res2.returncode == 0, res2.stderr
    assert comparable(json.loads((tmp_path / "v1.json").read_text())) == \
        comparable(json.loads((tmp_path / "v2.json").read_text()))
    res = sim(sim_tool, v1, "policy=fetch-all,slots=25%,prefetch=on", tmp_path / "bad.json")
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "prefetch=on replays the predictions of a version-2 trace" in err[0], res.stderr


@pytest.mark.build
def test_prefetch_predicts_better_than_a_random_predictor(models: dict[str, Path], text: Path, tmp_path: Path,
                                                          patched_build: Build, sim_tool: Path) -> None:
    """`prefetch_used > 0` alone would pass a random predictor: a randomly chosen expert is used by some token now
    and then. The baseline here is one: the same trace, its predictions replaced by k distinct random experts
    wherever the engine predicted, replayed by llama-moe-sim (the engine's policy code) with prefetch=on. The
    engine's predictions (the next layer's router on this layer's input) must make clearly more of their
    prefetches used."""
    import dataclasses

    spec = "policy=fetch-all,slots=25%,prefetch=on"
    trace = tmp_path / "trace.bin"
    run = run_ppl(patched_build, models["qwen3moe"], text, tmp_path / "emu",
                  f"mode=emulate,{spec},trace={trace},trace_top={N_EXPERT}")
    assert run.stats is not None
    t = read_expert_trace(trace)
    rec = t.records.copy()
    predicted = rec["pred"][:, 0] >= 0
    rng = np.random.default_rng(0)
    rec["pred"][predicted] = np.argsort(rng.random((int(predicted.sum()), t.n_expert)), axis=1)[:, :t.k]
    random_trace = write_expert_trace(tmp_path / "random.bin", dataclasses.replace(t, records=rec))

    def used_share(path: Path, name: str) -> float:
        res = sim(sim_tool, path, spec, tmp_path / f"{name}.json")
        assert res.returncode in (0, 3), res.stderr  # 3: decisions other than the recorded run's (the random one)
        total = json.loads((tmp_path / f"{name}.json").read_text())["total"]
        assert total["prefetches"] > 0
        return float(total["prefetch_used"] / total["prefetches"])

    engine, chance = used_share(trace, "engine"), used_share(random_trace, "random")
    t_emu = run.stats["total"]
    assert engine == pytest.approx(t_emu["prefetch_used"] / t_emu["prefetches"])  # the replay is the run
    assert engine >= 2.5 * chance, (engine, chance)  # measured: 0.24 against 0.06



# ---- the file tier (host=file): prefetch may not slow the synchronous path (issue 23, item 3) ----------------------

def check_file_prefetch_counters(stats: dict[str, Any]) -> None:
    """host=file: the dropped prefetches are neither used nor wasted; every cancelled read is uncounted from the copies
    (one-token ubatches: copied = fetches + admissions + prefetches - cancelled + late, less the deferred pending)."""
    for s in [stats["total"], *stats["layers"]]:
        assert s["prefetch_used"] + s["prefetch_wasted"] + s["prefetch_dropped"] <= s["prefetches"]
        # a drop empties a slot without an eviction, which a later admission fills without one
        assert s["prefetches"] <= s["evictions"] + stats["config"]["slots"] + s["prefetch_dropped"]
        assert s["hits"] + s["misses"] + s["skips"] == s["calls"]
        assert s["fetches"] + s["substitutions"] + s["drops"] + s["host_computes"] == s["misses"]
    assert stats["layers"][0]["prefetches"] == 0
    assert stats["total"]["prefetches"] > 0 and stats["total"]["prefetch_used"] > 0
    t, e = stats["total"], stats["engine"]
    assert t["prefetch_dropped"] + e["prefetch_late"] <= e["prefetch_cancelled"] <= t["prefetches"]
    assert e["prefetch_late"] <= t["prefetch_used"]
    assert e["background_experts"] == t["admissions"] + t["prefetches"] - e["prefetch_cancelled"]
    pending = t["fetches"] + t["admissions"] + t["prefetches"] - e["prefetch_cancelled"] + e["prefetch_late"] - \
        e["copied_experts"]
    assert 0 <= pending <= e["deferred_experts"]
    # a route step waits for at most the one prefetch read started: at most once per predicted step
    predicted_steps = sum(s["token_layers"] for s in stats["layers"][1:])
    assert e["prefetch_waits"] <= predicted_steps
    assert e["fetch_wait_ns"] <= e["copy_ns"]


@pytest.mark.build
@pytest.mark.parametrize("tier", ["two tiers", "three tiers", "expert pack"])
def test_file_tier_fetch_all_with_prefetch_is_stock(tier: str, models: dict[str, Path], text: Path, tmp_path: Path,
                                                    stock_build: Build, patched_build: Build) -> None:
    """Engine, host=file, fetch-all with prefetch, one-token ubatches: bit-identical to stock whatever happens to the
    prefetch reads (here: every prefetch read held back 2 ms once started, so that most are cancelled), reading each
    tensor's slice from the model file, through a RAM tier (a cancelled read leaves the RAM slot as it was), or
    whole experts from an expert pack."""
    model = models["qwen3moe"]
    stock = run_ppl(stock_build, model, text, tmp_path / "stock", ubatch=1, nll_dump=False)
    spec = "mode=engine,policy=fetch-all,slots=25%,host=file,prefetch=on"
    if tier == "three tiers":
        spec += ",ram_slots=50%"
    elif tier == "expert pack":
        from harness.orchestration.pack import write_pack

        pack = write_pack(model, tmp_path / "model.moe-pack").path
        spec += f",pack={pack}"
    pf = run_ppl(patched_build, model, text, tmp_path / "pf", spec, ubatch=1,
                 env={"LLAMA_MOE_CACHE_TEST_PREFETCH_DELAY_US": "2000"})
    assert len(stock.logits) > 1000 and pf.logits == stock.logits  # bit for bit
    assert pf.stats is not None
    check_file_prefetch_counters(pf.stats)
    t, e = pf.stats["total"], pf.stats["engine"]
    assert t["admissions"] == 0 and t["substitutions"] == 0
    if tier == "expert pack":
        assert e["pack_reads"] == e["file_reads"] > 0
    if tier == "three tiers":
        assert t["file_loads"] > 0
        # every expert the policy placed came through the RAM tier, prefetches too (dropped ones included)
        assert t["ram_tier_loads"] + t["file_loads"] == t["fetches"] + t["admissions"] + t["prefetches"], t
    assert e["prefetch_cancelled"] > 0 and t["prefetch_dropped"] > 0  # the hook made reads late: some were dropped
    assert e["prefetch_waits"] > 0


@pytest.mark.build
@pytest.mark.parametrize("readers", [1, 2])
def test_file_tier_fetch_never_waits_for_a_prefetch(readers: int, models: dict[str, Path], text: Path,
                                                    tmp_path: Path, patched_build: Build) -> None:
    """Every prefetch read held back D = 100 ms once started (LLAMA_MOE_CACHE_TEST_PREFETCH_DELAY_US), one or two
    reader threads: a fetch that waited behind a prefetch read (queued before it, or in flight on every reader) would
    wait about D. The fetches' total wait (fetch_wait_ns) stays far below D per step (the old order, prefetches queued
    before the layer's own fetches, each reader taking one, made every step that prefetched wait about D for its
    fetches); a route step waits for a started prefetch read at most once and for at most about D; and the prefetch
    reads that ran (each D long) fit one after the other in the run's time: never two at once."""
    delay_s = 0.1
    model = models["qwen3moe"]
    spec = f"mode=engine,policy=fetch-all,slots=25%,host=file,readers={readers},prefetch=on"
    waited = 0  # route steps that met a started prefetch read, over the tries
    # A prefetch read starts only if a reader thread gets a core before the next layer's route step cancels it:
    # one compute thread leaves the other core to the readers. On a loaded machine a run may still start none
    # (seen once in CI with two compute threads: 178 prefetches, all cancelled); the claims below hold for every
    # run, and a run where no route step met a started read is tried again, up to three runs, one of which must.
    for attempt in range(3):
        tmp = tmp_path / f"pf{attempt}"
        tmp.mkdir()
        stats_path = tmp / "stats.json"
        env = {**{k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"},
               "LLAMA_MOE_CACHE": f"{spec},stats={stats_path}",
               "LLAMA_MOE_CACHE_TEST_PREFETCH_DELAY_US": str(int(delay_s * 1e6))}
        t0 = time.monotonic()
        res = subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c",
                              "16", "-b", "16", "-ub", "1", "--chunks", "1", "-t", "1"], env=env, capture_output=True,
                             text=True, timeout=600)
        wall_s = time.monotonic() - t0
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        stats = json.loads(stats_path.read_text())
        check_file_prefetch_counters(stats)
        t, e = stats["total"], stats["engine"]
        assert t["prefetches"] > 0 and t["fetches"] > 0
        steps = sum(s["token_layers"] for s in stats["layers"])
        assert e["fetch_wait_ns"] / 1e9 < steps * delay_s / 4, (e["fetch_wait_ns"], steps)
        assert e["prefetch_wait_ns"] / 1e9 <= e["prefetch_waits"] * delay_s * 1.5
        completed = e["background_experts"]  # fetch-all admits nothing: the prefetch reads not cancelled
        assert completed == t["prefetches"] - e["prefetch_cancelled"]
        assert completed * delay_s <= wall_s, (completed, wall_s)
        # a route step that waited for a started read (prefetch_waits) settled a read that was not cancelled
        assert e["prefetch_waits"] <= completed, e
        waited += e["prefetch_waits"]
        if e["prefetch_waits"] > 0:
            break
    assert waited > 0, "no route step met a started prefetch read in three runs: the waits above were not tested"


@pytest.mark.build
def test_file_tier_quality_with_prefetch_max(models: dict[str, Path], text: Path, tmp_path: Path,
                                             patched_build: Build) -> None:
    """quality, host=file, prefetch=on with prefetch_max=2: at most 2 prefetches per layer and token, the counters add
    up; emulate admits the same budget (its copies idealised), and with the budget the engine prefetches no more than
    without it."""
    model = models["qwen3moe"]
    base = "policy=quality,slots=25%,host=file,prefetch=on"
    eng = run_ppl(patched_build, model, text, tmp_path / "eng", f"mode=engine,{base},prefetch_max=2", ubatch=1)
    emu = run_ppl(patched_build, model, text, tmp_path / "emu", f"mode=emulate,{base},prefetch_max=2", ubatch=1)
    assert eng.stats is not None and emu.stats is not None
    check_file_prefetch_counters(eng.stats)
    assert eng.stats["config"]["prefetch_max"] == 2 and emu.stats["config"]["prefetch_max"] == 2
    for st in (eng.stats, emu.stats):
        for layer in st["layers"]:
            assert layer["prefetches"] <= 2 * layer["token_layers"]
    assert emu.stats["total"]["prefetch_dropped"] == 0  # emulate's copies complete in time: nothing is dropped
    # where the engine dropped nothing its decisions are emulate's (the residency changes only by a drop)
    if eng.stats["total"]["prefetch_dropped"] == 0:
        assert eng.stats["total"] == emu.stats["total"]
