"""harness.orchestration.simulate and llama-moe-sim.

- Pure: policy specs, the replay summary parser, the cost model applied to simulated statistics on a
  hand-computed case (with a fake runner), the table, calibration from synthetic measurements.
- Build: the simulator's statistics JSON equals the engine's (emulate mode in llama-perplexity) for the same
  trace, spec and residency, exactly, for several presets and custom rules (admission, LRU, drop), several
  archs, and an initial-residency profile; --verify; the tool's errors; run_simulate end to end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness.core.errors import BuildMissingError, HarnessError
from harness.core.project import Build
from harness.domain.costmodel import Profile, TokenWork, estimate, load_profile_file, profile_json
from harness.orchestration.simulate import (
    ToolSimRunner,
    check_residency,
    parse_calibration_runs,
    residency_slots,
    run_calibrate,
    run_simulate,
    sim_spec,
)
from harness.parsers import ParseError
from harness.parsers.gguf_model import ModelInfo, read_model_info
from harness.parsers.sim import SIM_TOOL, SimRun, parse_sim_output, parse_sim_summary
from harness.parsers.trace import synthetic_trace, write_expert_trace
from harness.report.simulate import render_simulate
from harness.tools.synth import SynthSpec, synth_text, write_synth_model

P = Profile(name="hand", description="test", vram_bytes=24 * 2**30, vram_bw_gbs=1000.0, h2d_bw_gbs=20.0,
            fetch_latency_us=10.0, layer_roundtrip_us=50.0, layer_fixed_us=20.0, cpu_bw_gbs=40.0)

# 4 MoE layers of 8 experts (2 per token) of 1 MB each, 1 GB of other weights
INFO = ModelInfo(path="hand.gguf", arch="qwen3moe", name="hand", n_layers=4, moe_layers=(0, 1, 2, 3), n_expert=8,
                 n_expert_used=2, n_expert_shared=0, gating="softmax", weights_norm=True, merged_gate_up=False,
                 expert_tensors=(), expert_bytes=32_000_000, non_expert_bytes=1_000_000_000,
                 file_bytes=1_032_000_000, file_type="f32")

SUMMARY = ("llama-moe-sim: replayed 98304 token-layer decisions (48 MoE layers) x 5 in 0.412000 s: "
           "1.193 million decisions/s (2 threads, 0.800000 s CPU)\n")


def test_specs_and_residencies() -> None:
    assert sim_spec("quality", "25%") == "policy=quality,slots=25%"
    assert sim_spec("rule-0.15", "16") == "rule=threshold,tau=0.15,evict=lfu,admit=off,slots=16"
    assert check_residency(" 12.5% ") == "12.5%"
    assert [residency_slots(r, 64) for r in ("25%", "10%", "12.5%", "0.1%", "100%", "12")] == [16, 6, 8, 1, 64, 12]
    assert residency_slots("2.5%", 100) == 3  # half away from zero, as lround
    for bad in ("25 %", "abc", "-3", "0.25"):
        with pytest.raises(HarnessError, match="bad residency"):
            check_residency(bad)
    with pytest.raises(HarnessError, match="unknown policy"):
        sim_spec("fastest", "25%")


def test_parse_summary() -> None:
    s = parse_sim_summary("llama_expert_cache: ...\n" + SUMMARY)
    assert (s.decisions, s.n_moe_layers, s.repeat, s.threads) == (98304, 48, 5, 2)
    assert s.seconds == pytest.approx(0.412) and s.decisions_per_s == pytest.approx(1.193e6)
    assert s.cpu_seconds == pytest.approx(0.8) and s.decisions_per_cpu_s == pytest.approx(98304 * 5 / 0.8)
    with pytest.raises(ParseError):
        parse_sim_summary("llama-moe-sim: error: no trace\n")


def counters(tokens: int, token_layers: int, fetches: int, admissions: int, hit_rate: float) -> dict[str, Any]:
    return {"calls": token_layers * 2, "hits": 0, "misses": 0, "fetches": fetches, "substitutions": 10, "drops": 0,
            "host_computes": 0, "skips": 0, "admissions": admissions, "evictions": 0, "subst_first_choice": 0,
            "forced_substitutions": 0,
            "token_layers": token_layers, "token_layers_with_subst": 5, "ram_tier_loads": 0, "file_loads": 0,
            "prefetches": 0, "prefetch_used": 0, "prefetch_wasted": 0, "prefetch_dropped": 0,
            "max_subst_weight": 0.1,
            "subst_mass_sum": 2.0, "tokens": tokens, "substituted_mass": 2.0 / token_layers,
            "fetches_per_token": fetches / tokens, "drop_mass_sum": 0.0, "hit_rate": hit_rate,
            "miss_rate": 1 - hit_rate, "substitution_rate": 10 / (token_layers * 2),
            "mass_hist": [token_layers] + [0] * 19}


def stats_doc(policy: str, slots: int, layers: list[tuple[int, int, int]], hit_rate: float = 0.8) -> dict[str, Any]:
    """layers: (tokens decided, fetches, admissions) per MoE layer."""
    per = [counters(t, t, f, a, hit_rate) for t, f, a in layers]
    tl = sum(t for t, _, _ in layers)
    total = counters(tl // len(layers), tl, sum(f for _, f, _ in layers), sum(a for _, _, a in layers), hit_rate)
    return {"schema": "moe-subst/expert-cache-stats", "schema_version": 1,
            "config": {"spec": "", "mode": "emulate", "policy": policy, "slots": slots, "n_expert": 8,
                       "n_expert_used": 2},
            "total": total, "layers": [{"layer": i, **c} for i, c in enumerate(per)]}


class FakeSimRunner:
    def __init__(self, docs: dict[str, dict[str, Any]]) -> None:
        self.docs = docs
        self.specs: list[str] = []

    def simulate(self, trace: Path, spec: str) -> SimRun:
        self.specs.append(spec)
        return parse_sim_output(spec, json.dumps(self.docs[spec]), SUMMARY)


@pytest.fixture()
def hand_trace(tmp_path: Path) -> Path:
    return write_expert_trace(tmp_path / "t.bin", synthetic_trace(n_layer=4, n_expert=8, k=2, n_tokens=5, top_m=8))


def test_cost_model_on_simulated_statistics_hand_computed(hand_trace: Path) -> None:
    runner = FakeSimRunner({  # 100 tokens, every layer decides all of them
        "policy=quality,slots=25%": stats_doc("quality", 2, [(100, 20, 5), (100, 10, 10), (100, 10, 5), (100, 10, 5)]),
        "policy=fetch-all,slots=25%": stats_doc("fetch-all", 2, [(100, 50, 0)] * 4),
    })
    rows = run_simulate(hand_trace, INFO, ["quality"], ["25%"], P, runner)
    assert runner.specs == ["policy=quality,slots=25%", "policy=fetch-all,slots=25%"]  # the baseline is added
    q, fa = rows
    assert (q.policy, fa.policy, q.slots, q.residency) == ("quality", "fetch-all", 2, "25%")
    # fetch-all: resident 1 GB + 2 experts x 4 layers x 1 MB = 1.008 ms, + 4 layers x 20 us = 1.088 ms;
    # fetches 2 x 1 MB at 20 GB/s = 0.1 ms + 2 x 10 us; round trips 4 x 50 us = 0.2 ms.  1.408 ms
    assert fa.est_ms_per_token == pytest.approx(1.408)
    # quality: 0.5 fetches = 0.025 + 0.005 ms; 0.25 admissions/token (0.0125 ms of copies) hide behind compute
    assert q.admissions_per_token == pytest.approx(0.25)
    assert q.est_ms_per_token == pytest.approx(1.318)
    # stock in the same memory (1 GB + 2 slots x 4 layers x 1 MB): 1 MoE layer's 8 experts fit; 1.002 ms +
    # 0.08 ms; 3 CPU layers: 3 round trips (0.15 ms) + 3 x 2 experts x 1 MB at 40 GB/s (0.15 ms).  1.382 ms
    assert q.stock_gpu_moe_layers == 1
    assert q.est_stock_ms == pytest.approx(1.382)
    assert q.est_speedup_vs_fetch_all == pytest.approx(1.408 / 1.318)
    assert q.est_speedup_vs_stock == pytest.approx(1.382 / 1.318)
    assert fa.est_speedup_vs_fetch_all == pytest.approx(1.0)
    assert q.replay_decisions_per_s == pytest.approx(1.193e6)
    assert (q.hit_rate, q.fetches_per_token, q.substitution_rate) == (0.8, 0.5, 0.0125)
    # every layer decided every token: the per-layer sum is the engine's total rate
    assert q.fetches_per_token == pytest.approx(runner.docs["policy=quality,slots=25%"]["total"]["fetches_per_token"])

    text = render_simulate(rows)
    assert "ESTIMATES from the cost model (profile hand)" in text
    assert "ms/tok (EST)" in text and "1.318" in text and f"{1.408 / 1.318:.2f}x" in text
    md = render_simulate(rows, markdown=True)
    assert md.startswith("| policy |") and "- ms/token and speed-ups are ESTIMATES" in md


def test_run_simulate_checks_the_model(hand_trace: Path) -> None:
    runner = FakeSimRunner({})
    other = dataclasses.replace(INFO, n_expert=16)
    with pytest.raises(HarnessError, match="8 experts, 2 per token; hand.gguf has 16, 2 per token"):
        run_simulate(hand_trace, other, ["quality"], ["25%"], P, runner)
    three = dataclasses.replace(INFO, moe_layers=(0, 1, 2))
    runner = FakeSimRunner({"policy=fetch-all,slots=25%": stats_doc("fetch-all", 2, [(100, 50, 0)] * 4)})
    with pytest.raises(HarnessError, match="records for 4 MoE layers"):
        run_simulate(hand_trace, three, ["fetch-all"], ["25%"], P, runner)
    runner = FakeSimRunner({})
    with pytest.raises(HarnessError, match="unknown policy"):
        run_simulate(hand_trace, INFO, ["quality", "nope"], ["25%"], P, runner)
    with pytest.raises(HarnessError, match="bad residency"):
        run_simulate(hand_trace, INFO, ["quality"], ["25%", "x"], P, runner)
    assert runner.specs == []  # checked before anything runs


def test_residencies_out_of_range_are_refused(hand_trace: Path) -> None:
    """Above 100% or at most 0% is an error naming the range, not clamped to all experts or to one slot."""
    runner = FakeSimRunner({})
    for bad in ("200%", "100.5%", "0%", "0.0%"):
        with pytest.raises(HarnessError, match=rf"residency {bad} is out of range: .* above 0% and at most 100%"):
            run_simulate(hand_trace, INFO, ["quality"], ["25%", bad], P, runner)
    with pytest.raises(HarnessError, match="is 0 slots per layer; this model needs between 2 .* and 8"):
        run_simulate(hand_trace, INFO, ["quality"], ["0"], P, runner)
    assert runner.specs == []


def test_default_residencies_too_small_for_k_are_skipped(hand_trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 experts, 2 per token: the default 10% is 1 slot, skipped with a note; 25% and 50% run. A user's
    residency that small is an error naming the minimum; when no default is feasible, one error."""
    from harness.orchestration import simulate as sim
    from harness.parsers import gguf_model

    monkeypatch.setattr(gguf_model, "read_model_info", lambda path: INFO)
    docs = {f"policy={p},slots={r}": stats_doc(p, s, [(100, 50, 0)] * 4)
            for p in ("quality", "fetch-all") for r, s in (("25%", 2), ("50%", 4))}
    runner = FakeSimRunner(docs)
    result = sim.simulate(sim.SimulateOptions(hand_trace, Path("hand.gguf"), ("quality",)), runner)
    assert [(r.policy, r.residency) for r in result.rows] == [
        ("quality", "25%"), ("fetch-all", "25%"), ("quality", "50%"), ("fetch-all", "50%")]
    assert result.notes == (
        f"the trace {hand_trace} carries no fingerprint of the model it was recorded on (an older trace): that it was "
        "recorded on hand.gguf is not checked",
        "residency 10% skipped: 1 slots per layer, fewer than the 2 experts used per token")

    runner = FakeSimRunner({})
    with pytest.raises(HarnessError, match=r"residency 10% is 1 slots per layer; this model needs between 2 "
                                           r"\(experts used per token: 25% of 8\) and 8"):
        sim.simulate(sim.SimulateOptions(hand_trace, Path("hand.gguf"), ("quality",), ("10%", "25%")), runner)
    wide = dataclasses.replace(INFO, n_expert=64, n_expert_used=40)  # 50% = 32 slots < 40
    monkeypatch.setattr(gguf_model, "read_model_info", lambda path: wide)
    with pytest.raises(HarnessError, match=r"none of the default residencies \(10%, 25%, 50%\) gives this model "
                                           r"enough slots per layer: it needs between 40 .* and 64"):
        sim.simulate(sim.SimulateOptions(hand_trace, Path("hand.gguf"), ("quality",)), runner)
    assert runner.specs == []


def test_cli_simulate_residency_errors_and_notes(hand_trace: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import main
    from harness.orchestration import simulate as sim
    from harness.parsers import gguf_model

    monkeypatch.setattr(gguf_model, "read_model_info", lambda path: INFO)
    assert main(["simulate", "--trace", str(hand_trace), "--model", "hand.gguf", "--residency", "200%"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("harness: error: residency 200% is out of range") and "\n" not in err
    docs = {f"policy={p},slots={r}": stats_doc(p, s, [(100, 50, 0)] * 4)
            for p in ("quality", "fetch-all") for r, s in (("25%", 2), ("50%", 4))}
    monkeypatch.setattr(sim, "ToolSimRunner", lambda build: FakeSimRunner(docs))
    monkeypatch.setattr("harness.core.project.get_build", lambda name: None)
    assert main(["simulate", "--trace", str(hand_trace), "--model", "hand.gguf", "--policies", "quality"]) == 0
    out, err = capsys.readouterr()
    assert "harness: note: residency 10% skipped" in err
    assert [ln.split()[0] for ln in out.splitlines()[2:6]] == ["quality", "fetch-all", "quality", "fetch-all"]


def test_a_trace_of_another_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a trace recorded on another model of the same shape was replayed with this model's sizes (2.48x where
    the right model gives 0.86x). Now a trace whose header carries a model fingerprint is checked against the model:
    another model's is one line; the same model's passes without a note; a trace without one gets a note."""
    from harness.cli import main
    from harness.orchestration.simulate import check_trace_model
    from harness.parsers.gguf_model import model_fingerprint
    from harness.parsers.trace import read_trace_header, synthetic_trace, write_expert_trace
    from harness.tools.synth import SynthSpec, write_synth_model

    a = write_synth_model(SynthSpec(seed=0), tmp_path / "a.gguf")
    b = write_synth_model(SynthSpec(seed=1), tmp_path / "b.gguf")  # the same shape, other weights
    fa, fb = model_fingerprint(a), model_fingerprint(b)
    assert fa != fb and fa == model_fingerprint(a) and 0 not in (fa, fb)
    spec = SynthSpec()
    t = synthetic_trace(n_layer=spec.n_layer, n_expert=spec.n_expert, k=spec.n_expert_used, n_tokens=8, seed=0)
    trace = write_expert_trace(tmp_path / "t.bin", dataclasses.replace(t, fingerprint=fa))
    assert read_trace_header(trace).fingerprint == fa
    assert check_trace_model(trace, a) == ()
    with pytest.raises(HarnessError) as e:
        check_trace_model(trace, b)
    assert str(e.value) == (f"the trace {trace} was recorded on another model than {b} (model fingerprint {fa:016x} "
                            f"in the trace, {fb:016x} of this model): pass the model the trace was recorded with")
    assert main(["simulate", "--trace", str(trace), "--model", str(b)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("harness: error: the trace ") and "another model" in err and "\n" not in err
    old = write_expert_trace(tmp_path / "old.bin", t)  # no fingerprint (0): as the engine wrote before it did
    (note,) = check_trace_model(old, b)
    assert "carries no fingerprint of the model it was recorded on" in note


def test_the_fingerprint_definition_by_hand(tmp_path: Path) -> None:
    """model_fingerprint as docs/expert-cache.md defines it, recomputed here from the tensors (what the engine's
    writer must compute the same way)."""
    import struct

    import gguf
    import numpy as np

    from harness.parsers.gguf_model import fnv1a64, model_fingerprint
    from harness.tools.synth import SynthSpec, write_synth_model

    assert fnv1a64(b"") == 0xCBF29CE484222325 and fnv1a64(b"a") == 0xAF63DC4C8601EC8C  # FNV-1a 64 test vectors
    path = write_synth_model(SynthSpec(n_layer=2, seed=4), tmp_path / "m.gguf")
    r = gguf.GGUFReader(str(path))
    t = {x.name: x for x in r.tensors}
    data = b""
    for il in (0, 1):
        data += struct.pack("<Q", il)
        for kind in ("gate", "up", "down"):
            x = t[f"blk.{il}.ffn_{kind}_exps.weight"]
            data += struct.pack("<4Q", *map(int, x.shape), int(x.tensor_type))
        router = t[f"blk.{il}.ffn_gate_inp.weight"]
        data += struct.pack("<Q", int(router.n_bytes)) + bytes(np.asarray(router.data).view(np.uint8).ravel()[:4096])
    assert model_fingerprint(path) == fnv1a64(data)


def test_per_token_rates_when_the_last_layer_decides_fewer_tokens(hand_trace: Path) -> None:
    # a llama-perplexity trace: the last layer decides only the 50 scored tokens of 100
    doc = stats_doc("fetch-all", 2, [(100, 50, 0), (100, 50, 0), (100, 50, 0), (50, 10, 0)])
    rows = run_simulate(hand_trace, INFO, ["fetch-all"], ["25%"], P,
                        FakeSimRunner({"policy=fetch-all,slots=25%": doc}))
    # what a decoder meets per token: not total fetches / tokens (160 / 100), which divides the last layer's
    # fetches by tokens it never decided
    assert rows[0].fetches_per_token == pytest.approx(0.5 * 3 + 10 / 50)


def test_calibration_from_measured_runs(tmp_path: Path) -> None:
    truth = dataclasses.replace(P, vram_bw_gbs=800.0, h2d_bw_gbs=22.0, fetch_latency_us=7.0,
                                layer_roundtrip_us=35.0, layer_fixed_us=12.0, cpu_bw_gbs=30.0)
    works = [TokenWork(n_layers=24, resident_bytes=1e9 + (24 - c) * 1e7, sync_layers=c, cpu_expert_bytes=c * 1e7)
             for c in (0, 4, 8, 16)]
    works += [TokenWork(n_layers=24, resident_bytes=1.24e9, fetch_bytes=f * 1e6, fetch_ops=o, sync_layers=24)
              for f, o in ((0, 0), (5, 5), (20, 12), (40, 30))]
    works += [TokenWork(n_layers=n, resident_bytes=0.5e9 * n / 12, sync_layers=n) for n in (12, 36)]
    lines = [json.dumps({"work": dataclasses.asdict(w), "ms": estimate(truth, w).ms_per_token, "label": f"r{i}"})
             for i, w in enumerate(works)]
    runs = tmp_path / "runs.jsonl"
    runs.write_text("\n".join(lines) + "\n\n")
    out = tmp_path / "fit.json"
    fit = run_calibrate(runs, P, out, name="fitted")
    for f in ("vram_bw_gbs", "h2d_bw_gbs", "fetch_latency_us", "layer_roundtrip_us", "layer_fixed_us", "cpu_bw_gbs"):
        assert getattr(fit, f) == pytest.approx(getattr(truth, f), rel=1e-3), f
    assert fit.name == "fitted"
    assert load_profile_file(out) == fit
    assert "calibrated" in json.loads(out.read_text())["sources"]
    (tmp_path / "p.json").write_text(profile_json(P))
    assert load_profile_file(tmp_path / "p.json") == P


def test_calibration_input_errors(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="runs:1: not a"):
        parse_calibration_runs("not json")
    with pytest.raises(HarnessError, match="work needs n_layers"):
        parse_calibration_runs('{"work": {"n_layers": 2}, "ms": 1}')
    with pytest.raises(HarnessError, match="work needs"):
        parse_calibration_runs('{"work": {"n_layers": 2, "resident_bytes": 1, "colour": 3}, "ms": 1}')
    with pytest.raises(HarnessError, match="ms > 0"):
        parse_calibration_runs('{"work": {"n_layers": 2, "resident_bytes": 1}, "ms": 0}')
    with pytest.raises(HarnessError, match="cannot read"):
        run_calibrate(tmp_path / "missing.jsonl", P, tmp_path / "o.json")
    with pytest.raises(HarnessError, match="lacks"):
        (tmp_path / "half.json").write_text('{"name": "x"}')
        load_profile_file(tmp_path / "half.json")


# ---- the built tool ---------------------------------------------------------------------------------------------

N_EXPERT, K, N_LAYER, N_CTX, CHUNKS = 64, 8, 3, 128, 6


@pytest.fixture(scope="module")
def sim_tool(patched_build: Build) -> Path:
    try:
        return patched_build.tool(SIM_TOOL)
    except BuildMissingError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def sim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synth_model(SynthSpec(arch="qwen3moe", n_expert=N_EXPERT, n_expert_used=K, n_layer=N_LAYER, seed=4),
                             tmp_path_factory.mktemp("sim-model") / "m.gguf")


@pytest.fixture(scope="module")
def sim_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim-text") / "text.txt"
    path.write_text(synth_text(20000, seed=3))
    return path


def engine_run(build: Build, model: Path, text: Path, spec: str, out: Path, *, trace_top: int | None = N_EXPERT,
               profile_out: bool = True) -> tuple[dict[str, Any], Path, Path]:
    """llama-perplexity in emulate mode, one sequence per batch; returns (stats, trace, profile_out)."""
    out.mkdir(parents=True, exist_ok=True)
    trace, stats, prof = out / "trace.bin", out / "engine.json", out / "engine.profile"
    full = f"mode=emulate,{spec},trace={trace},stats={stats}"
    if trace_top is not None:
        full += f",trace_top={trace_top}"
    if profile_out:
        full += f",profile_out={prof}"
    env = {**os.environ, "LLAMA_MOE_CACHE": full}
    res = subprocess.run([str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(N_CTX),
                          "-b", str(N_CTX), "--chunks", str(CHUNKS), "-t", "2"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(stats.read_text()), trace, prof


def sim_run(tool: Path, trace: Path, spec: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tool), "--trace", str(trace), "--spec", spec, "--stats", str(out), *args],
                          capture_output=True, text=True, timeout=300)


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """Everything but the spec string (which names the trace and stats files) and the host timings."""
    d = json.loads(json.dumps(doc))
    d["config"].pop("spec")
    d.pop("route_ns")
    d.pop("route_ns_per_token_layer")
    return d


SPECS = [
    "policy=quality,slots=25%",
    "policy=speed,slots=25%",
    "policy=fetch-all,slots=25%",
    "policy=quality,slots=12",
    "policy=speed,slots=50%",
    "rule=threshold,tau=0.3,evict=lru,admit=0.25,slots=20",
    "rule=substitute-all,evict=lfu,admit=on,halve=64,slots=16",
    "rule=drop,slots=25%",
    "policy=fetch-all,evict=lfu,halve=32,slots=9",
    "policy=quality,host=file,tau_file=0.3,slots=25%",  # the file tier's threshold
    "policy=quality,host=file,ram_slots=50%,tau_file=0.4,slots=25%",  # three tiers
    "policy=fetch-all,host=file,ram_slots=20,slots=12",
    # the anchors' policies (issue 13)
    "rule=cache-route,slots=25%",
    "rule=cache-route,j=2,m=12,alpha=0.5,admit=0.25,evict=lfu,slots=20",
    "rule=cache-route,j=0,light=host,slots=16",
    "rule=zero,slots=25%",
    "rule=zero,tau=0.1,renorm=on,evict=classlru,slots=16",
    "rule=ser,kmin=4,t=0.3,slots=25%",
    "rule=ser,kmin=2,t=0.5,renorm=on,evict=classlru,half_life=16,slots=20",
    "policy=fetch-all,evict=classlru,slots=25%",
    "policy=quality,evict=classlru,half_life=32,classes=4,slots=12",
    "policy=quality,light=host,slots=25%",
    "rule=drop,renorm=on,slots=25%",
    # Experiment B's compositions (finding 3): only heavy, or only light misses substituted
    "rule=band,lo=0.3,evict=lfu,slots=25%",
    "rule=band,hi=0.08,admit=0.5,slots=20",
    # band at ranks >= 1 only (min_rank, added through the rule and key tables): a first choice is never substituted
    "rule=band,lo=0.1,min_rank=1,evict=lfu,slots=25%",
    # band up to a rank (max_rank, issue 22): every first-choice miss, the light first choices only (hi=0.3: with
    # k = 8 a first choice weighs at least 1/8, and below 0.15 none misses on this model) and heavy non-first
    # choices at ranks 1 to 2
    "rule=band,lo=0,hi=1,max_rank=0,evict=lfu,slots=25%",
    "rule=band,lo=0,hi=0.3,max_rank=0,slots=20",
    "rule=band,lo=0.15,hi=1,min_rank=1,max_rank=2,slots=25%",
    # prefetch (issue 13 item 2): the trace carries each token-layer's prediction (layer 1 of 3 is predicted)
    "policy=quality,prefetch=on,slots=25%",
    "policy=fetch-all,evict=lfu,prefetch=on,slots=12",
]


@pytest.mark.build
@pytest.mark.parametrize("spec", SPECS)
def test_simulator_equals_engine(patched_build: Build, sim_tool: Path, sim_model: Path, sim_text: Path,
                                 tmp_path: Path, spec: str) -> None:
    engine, trace, engine_prof = engine_run(patched_build, sim_model, sim_text, spec, tmp_path)
    assert engine["total"]["token_layers"] > 0
    sim_prof = tmp_path / "sim.profile"
    res = sim_run(sim_tool, trace, f"{spec},profile_out={sim_prof}", tmp_path / "sim.json", "--verify")
    assert res.returncode == 0, res.stderr
    assert "0 of" in res.stderr and "differ in their actions, 0 more" in res.stderr
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert comparable(sim) == comparable(engine)
    assert sim_prof.read_text() == engine_prof.read_text()
    if engine["config"]["admit"]:
        assert engine["total"]["admissions"] > 0  # admission is exercised, not only configured
    t = engine["total"]  # the anchors' paths are exercised too
    if "light=host" in spec:
        assert t["host_computes"] > 0 and t["substitutions"] == 0
    if "rule=ser" in spec:
        assert t["skips"] > 0
    if "rule=zero" in spec:
        assert t["drops"] > 0
    if ("rule=cache-route" in spec or "rule=band" in spec) and "light=host" not in spec:
        assert t["substitutions"] > 0
    if "prefetch=on" in spec:
        assert t["prefetches"] > 0 and engine["layers"][1]["prefetches"] > 0
    if "min_rank=1" in spec:
        assert engine["config"]["band_min_rank"] == 1 and t["subst_first_choice"] == 0
    if "rule=band" in spec:  # no max_rank: the last rank, k - 1
        given = dict(kv.split("=") for kv in spec.split(",")).get("max_rank")
        assert engine["config"]["band_max_rank"] == (int(given) if given else engine["config"]["n_expert_used"] - 1)
    if "max_rank=0" in spec:  # only first choices substituted
        assert t["subst_first_choice"] == t["substitutions"] > 0


@pytest.mark.build
def test_simulator_equals_engine_with_an_initial_profile(patched_build: Build, sim_tool: Path, sim_model: Path,
                                                         sim_text: Path, tmp_path: Path) -> None:
    _, _, prof = engine_run(patched_build, sim_model, sim_text, "policy=fetch-all,slots=25%", tmp_path / "a")
    spec = f"policy=quality,slots=25%,profile={prof}"
    engine, trace, _ = engine_run(patched_build, sim_model, sim_text, spec, tmp_path / "b", profile_out=False)
    res = sim_run(sim_tool, trace, spec, tmp_path / "sim.json", "--verify")
    assert res.returncode == 0, res.stderr
    assert comparable(json.loads((tmp_path / "sim.json").read_text())) == comparable(engine)


@pytest.mark.build
@pytest.mark.parametrize("arch", ["qwen2moe", "hy_v3"])
def test_simulator_equals_engine_other_archs(patched_build: Build, sim_tool: Path, synth_models: dict[str, Path],
                                             sim_text: Path, tmp_path: Path, arch: str) -> None:
    spec = "policy=quality,slots=50%"
    engine, trace, _ = engine_run(patched_build, synth_models[arch], sim_text, spec, tmp_path, trace_top=None)
    n_expert = engine["config"]["n_expert"]
    assert n_expert <= 16  # the default trace_top keeps every score: exact
    res = sim_run(sim_tool, trace, spec, tmp_path / "sim.json", "--verify")
    assert res.returncode == 0, res.stderr
    assert comparable(json.loads((tmp_path / "sim.json").read_text())) == comparable(engine)


@pytest.mark.build
@pytest.mark.parametrize("arch", ["qwen3moe", "hy_v3", "glm4moe"])
def test_the_engine_writes_the_model_fingerprint(patched_build: Build, sim_tool: Path, sim_text: Path,
                                                 tmp_path: Path, arch: str) -> None:
    """Before: the engine wrote 0 at the header's offset 40, so no trace it recorded could be checked. Now its writer
    (llama-expert-fingerprint.cpp) computes the fingerprint docs/expert-cache.md defines, the harness's own
    (f16 experts; hy_v3: a merged gate_up; glm4moe: a leading dense layer and a NextN layer, left out), and
    llama-moe-sim --model replays a trace of that model without a word, refuses one of another model of the same
    shape in one line (exit 1), and warns, once, about a trace without a fingerprint."""
    from harness.orchestration.simulate import check_trace_model
    from harness.parsers.gguf_model import model_fingerprint
    from harness.parsers.trace import TRACE_FINGERPRINT_OFFSET, read_trace_header

    spec = SynthSpec(arch=arch, dtype="f16", seed=4)
    model = write_synth_model(spec, tmp_path / "m.gguf")
    other = write_synth_model(dataclasses.replace(spec, seed=5), tmp_path / "other.gguf")  # the same shape
    _, trace, _ = engine_run(patched_build, model, sim_text, "policy=fetch-all,slots=50%", tmp_path / "run",
                             trace_top=None, profile_out=False)
    fp = model_fingerprint(model)
    assert read_trace_header(trace).fingerprint == fp != model_fingerprint(other)
    assert check_trace_model(trace, model) == ()
    res = sim_run(sim_tool, trace, "policy=quality,slots=50%", tmp_path / "s.json", "--model", str(model))
    assert res.returncode == 0 and "fingerprint" not in res.stderr, res.stderr
    info = subprocess.run([str(sim_tool), "-t", str(trace), "--info"], capture_output=True, text=True, timeout=60)
    assert f"model fingerprint {fp:016x}" in info.stdout, info.stdout
    if arch != "qwen3moe":
        return
    res = sim_run(sim_tool, trace, "policy=quality,slots=50%", tmp_path / "e.json", "--model", str(other))
    assert res.returncode == 1 and not (tmp_path / "e.json").exists(), res.stderr
    assert res.stderr.strip() == (
        f"llama-moe-sim: error: the trace '{trace}' was recorded on another model than '{other}' (model fingerprint "
        f"{fp:016x} in the trace, {model_fingerprint(other):016x} of this model): pass the model the trace was "
        "recorded with")
    with pytest.raises(HarnessError, match="was recorded on another model"):
        check_trace_model(trace, other)
    old = tmp_path / "old.bin"  # as the engine wrote before: no fingerprint
    data = bytearray(trace.read_bytes())
    data[TRACE_FINGERPRINT_OFFSET:TRACE_FINGERPRINT_OFFSET + 8] = bytes(8)
    old.write_bytes(bytes(data))
    res = sim_run(sim_tool, old, "policy=quality,slots=50%", tmp_path / "o.json", "--model", str(other), "-q")
    warnings = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert res.returncode == 0 and (tmp_path / "o.json").exists(), res.stderr
    assert warnings == [f"llama-moe-sim: warning: the trace '{old}' carries no fingerprint of the model it was "
                        f"recorded on (an older trace): that it was recorded on '{other}' is not checked"], res.stderr
    res = sim_run(sim_tool, trace, "policy=quality", tmp_path / "n.json", "--model", str(sim_text))
    assert res.returncode == 1 and res.stderr.startswith("llama-moe-sim: error: --model: cannot read the model"), \
        res.stderr


@pytest.mark.build
def test_replay_under_other_specs_and_errors(patched_build: Build, sim_tool: Path, sim_model: Path, sim_text: Path,
                                             tmp_path: Path) -> None:
    _, trace, _ = engine_run(patched_build, sim_model, sim_text, "policy=fetch-all,slots=25%", tmp_path)
    # another policy on the same trace: decisions differ from the recorded ones (--verify exits 3)
    res = sim_run(sim_tool, trace, "policy=speed,slots=25%", tmp_path / "s.json", "--verify")
    assert res.returncode == 3, res.stderr
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["total"]["substitutions"] > 0 and doc["config"]["policy"] == "speed"
    assert doc["route_ns"] > 0
    # statistics on stdout by default, and the summary line on stderr
    res = subprocess.run([str(sim_tool), "-t", str(trace), "-s", "policy=quality,slots=16", "-q", "-j", "1",
                          "--repeat", "3"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["config"]["slots"] == 16
    s = parse_sim_summary(res.stderr)
    assert (s.repeat, s.threads, s.n_moe_layers) == (3, 1, N_LAYER)
    # errors: a bad spec, too few slots, not a trace, a truncated trace, a spec that turns the cache off
    for spec, msg in (("policy=quality,colour=red", "unknown key 'colour'"),
                      ("policy=quality,slots=4", "fewer than the 8 experts used per token"),
                      ("mode=off", "turns the cache off")):
        res = sim_run(sim_tool, trace, spec, tmp_path / "e.json")
        assert res.returncode == 2 and msg in res.stderr, res.stderr
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"hello, world" * 10)
    res = sim_run(sim_tool, bad, "policy=quality", tmp_path / "e.json")
    assert res.returncode == 1 and "not a router trace" in res.stderr
    bad.write_bytes(trace.read_bytes()[:-7])
    res = sim_run(sim_tool, bad, "policy=quality", tmp_path / "e.json")
    assert res.returncode == 1 and "truncated trace" in res.stderr
    res = subprocess.run([str(sim_tool), "-t", str(trace), "--info"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and f"n_expert {N_EXPERT}, k {K}, top_m {N_EXPERT}" in res.stdout


@pytest.mark.build
def test_run_simulate_end_to_end(patched_build: Build, sim_tool: Path, sim_model: Path, sim_text: Path,
                                 tmp_path: Path) -> None:
    engine, trace, _ = engine_run(patched_build, sim_model, sim_text, "policy=fetch-all,slots=25%", tmp_path)
    info = read_model_info(sim_model)
    rows = run_simulate(trace, info, ["quality", "speed"], ["25%", "50%"], "rtx3090", ToolSimRunner(patched_build))
    assert [(r.policy, r.residency) for r in rows] == [
        ("quality", "25%"), ("speed", "25%"), ("fetch-all", "25%"),
        ("quality", "50%"), ("speed", "50%"), ("fetch-all", "50%")]
    fa = rows[2]
    assert fa.fetches_per_token == pytest.approx(sum(la["fetches"] / la["token_layers"] for la in engine["layers"]))
    assert fa.est_speedup_vs_fetch_all == pytest.approx(1.0)
    for r in rows:
        assert r.profile == "rtx3090" and r.est_ms_per_token > 0 and r.replay_decisions_per_s
        if r.policy != "fetch-all":
            assert r.fetches_per_token < rows[2 if r.residency == "25%" else 5].fetches_per_token
    assert "ESTIMATES" in render_simulate(rows)


def test_cli_calibrate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import main

    truth = dataclasses.replace(P, h2d_bw_gbs=18.0, layer_roundtrip_us=70.0)
    works = [TokenWork(n_layers=4, resident_bytes=2e8, fetch_bytes=f * 1e6, fetch_ops=f, sync_layers=4)
             for f in (0, 5, 10, 20)]
    works += [TokenWork(n_layers=4, resident_bytes=2e8, sync_layers=s, cpu_expert_bytes=s * 1e7) for s in (1, 2, 3)]
    runs = tmp_path / "runs.jsonl"
    runs.write_text("".join(json.dumps({"work": dataclasses.asdict(w), "ms": estimate(truth, w).ms_per_token}) + "\n"
                            for w in works))
    base = tmp_path / "base.json"
    base.write_text(profile_json(P))
    out = tmp_path / "fit.json"
    assert main(["calibrate", str(runs), "--base", str(base), "-o", str(out), "--name", "mine"]) == 0
    assert "profile mine" in capsys.readouterr().out
    fit = load_profile_file(out)
    assert fit.h2d_bw_gbs == pytest.approx(18.0, rel=1e-6) and fit.layer_roundtrip_us == pytest.approx(70.0, rel=1e-6)
    assert main(["calibrate", str(tmp_path / "none.jsonl"), "-o", str(out)]) == 2


@pytest.mark.build
def test_cli_simulate(patched_build: Build, sim_tool: Path, sim_model: Path, sim_text: Path, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli import main

    _, trace, _ = engine_run(patched_build, sim_model, sim_text, "policy=fetch-all,slots=25%", tmp_path)
    assert main(["simulate", "--trace", str(trace), "--model", str(sim_model), "--residency", "25%",
                 "--policies", "quality,speed"]) == 0
    out = capsys.readouterr().out
    assert "ESTIMATES from the cost model (profile rtx3090)" in out
    assert [ln.split()[0] for ln in out.splitlines()[2:5]] == ["quality", "speed", "fetch-all"]
    assert main(["simulate", "--trace", str(trace), "--model", str(sim_model), "--residency", "5%"]) == 2
    assert "residency 5% is 3 slots per layer; this model needs between 8" in capsys.readouterr().err


@pytest.mark.build
def test_simulator_equals_engine_on_the_trained_model(patched_build: Build, sim_tool: Path, tmp_path: Path) -> None:
    from harness.core.project import project_root
    from harness.orchestration.compare import default_model

    try:
        model = default_model()
    except HarnessError as e:
        pytest.skip(str(e))
    text = project_root() / "eval" / "data" / "heldout.txt"
    if not text.is_file():
        pytest.skip(f"no {text}")
    short = tmp_path / "heldout-part.txt"
    short.write_text(text.read_text()[:40000])
    spec = "policy=quality,slots=25%"
    engine, trace, _ = engine_run(patched_build, model, short, spec, tmp_path, profile_out=False)
    res = sim_run(sim_tool, trace, spec, tmp_path / "sim.json", "--verify")
    assert res.returncode == 0, res.stderr  # no action differs (a substitute may, on a float tie of two scores)
    assert comparable(json.loads((tmp_path / "sim.json").read_text())) == comparable(engine)
