"""harness.orchestration.compare with a fake runner: run order, interleaving, resume, Ctrl-C, budget verification."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.core.records import Provenance, ResultsFile
from harness.core.sizes import Size
from harness.domain.catalogue import policy_cache_spec
from harness.domain.options import CompareOptions
from harness.orchestration.compare import DEFAULT_MODEL_NAME, compare, default_model, resolve_text, run_compare
from harness.orchestration.executor import Environment
from harness.orchestration.planner import plan_compare, plan_runs
from harness.orchestration.summary import verify_budget
from harness.parsers import BenchResult, PerplexityResult
from harness.parsers.cache_stats import CacheStats
from harness.parsers.gguf_model import ExpertTensor, ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.tools.requests import BenchRequest, BenchRun, PerplexityRequest, PerplexityRun, RunOutput
from harness.tools.runners import ToolCrashedError

MiB = 2**20
N_TOK = 200


def _info(layers: int = 4, first_dense: int = 0, n_expert: int = 8, k: int = 2) -> ModelInfo:
    moe = tuple(range(first_dense, layers))
    tensors = tuple(ExpertTensor(f"blk.{il}.ffn_{kind}_exps.weight", kind, "weight", "F16", (8, 8, n_expert),
                                 MiB * n_expert) for il in moe for kind in ("gate", "up", "down"))
    expert_bytes = sum(t.n_bytes for t in tensors)  # 3 MiB per expert per layer
    return ModelInfo(path="m.gguf", arch="qwen3moe", name="m", n_layers=layers, moe_layers=moe, n_expert=n_expert,
                     n_expert_used=k, n_expert_shared=0, gating="softmax", weights_norm=True, merged_gate_up=False,
                     expert_tensors=tensors, expert_bytes=expert_bytes, non_expert_bytes=10 * MiB,
                     file_bytes=expert_bytes + 10 * MiB, file_type="F16")


def _runs(out: Path) -> list[dict[str, object]]:
    """The run records (not the meta record) of a results folder."""
    return [r for r in ResultsFile(out / "results.jsonl").read() if r["kind"] != "meta"]


class FakeEnv(Environment):
    def __init__(self, tmp: Path, gpu: str = "none", host: int = 1 << 40) -> None:
        self.tmp, self._gpu, self._host = tmp, gpu, host

    def builds(self) -> dict[str, Build]:
        return {n: Build(n, "cpu", self.tmp / n) for n in ("stock", "patched")}

    def provenance(self, builds: dict[str, Build], argv: tuple[str, ...], gpu: str) -> Provenance:
        return Provenance("llama-cpp-python-x", "0" * 64, "abc", {"stock/llama-bench": "11"}, "cpu", gpu, argv,
                          "2026-01-01T00:00:00+00:00", host="h", python="3")

    def gpu(self) -> str:
        return self._gpu

    def host_available_bytes(self) -> int:
        return self._host

    def default_threads(self) -> tuple[int, str]:
        return 3, "4 CPUs available to this process, 1-minute load average 1.0"


class FakeRunner:
    """Deterministic results: tokens/s by config, per-token NLL shifted by policy; records every call."""

    SHIFT = {"full": 0.0, "stock": 0.0, "quality": 0.001, "speed": 0.05, "fetch-all": 0.0}
    TPS = {"stock": 10.0, "quality": 25.0, "speed": 30.0, "fetch-all": 12.0}

    def __init__(self, interrupt_after: int | None = None, peak_mib: float | None = None) -> None:
        self.calls: list[str] = []
        self.interrupt_after = interrupt_after
        self.peak_mib = peak_mib
        self.dumps: dict[Path, NllDump] = {}

    def _tick(self, label: str) -> None:
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls.append(label)

    def _out(self) -> RunOutput:
        return RunOutput(("tool",), {}, 0, "", "", 0.1, self.peak_mib)

    def bench(self, build: Build, req: BenchRequest) -> BenchRun:
        config = req.label
        assert (config == "stock") == (req.cache is None)
        self._tick(f"bench:{build.name}:{config}")
        jitter = 1.0 + 0.01 * (len(self.calls) % 3)
        tps = self.TPS[config] * jitter
        res = tuple(BenchResult("c", "CPU", "", "m.gguf", 512, 512, 2, 99, req.placement.n_cpu_moe, p, g, 0,
                                (int((p + g) * 1e9 / (tps * (4 if p else 1))),), tps)
                    for p, g in ((req.n_prompt, 0), (0, req.n_gen)))
        return BenchRun(res, self._out())

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        config = req.label
        assert (config == "full") == (req.cache is not None and req.cache.mode == "off")
        self._tick(f"ppl:{build.name}:{config}")
        rng = np.random.default_rng(0)
        base = rng.uniform(1.0, 3.0, N_TOK)
        nll = base + self.SHIFT[config]
        if req.nll_dump is not None:
            self.dumps[req.nll_dump] = NllDump(2 * (N_TOK // 4 + 1), N_TOK // 4 + 1, 4,
                                               np.arange(N_TOK, dtype=np.int32), nll)
        ppl = float(np.exp(nll.mean()))
        stats = None if req.cache is None or req.cache.mode == "off" else CacheStats(0.1, 0.02, 1.5, "{}")
        return PerplexityRun(PerplexityResult(ppl, 0.1, 4, 512, 512, 1, (ppl,)), None, self._out(), stats)

    def load_nll(self, path: Path) -> NllDump:
        if path not in self.dumps:
            raise HarnessError(f"no dump {path}")
        return self.dumps[path]


@pytest.fixture
def setup(tmp_path: Path) -> tuple[CompareOptions, ModelInfo, FakeEnv]:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = CompareOptions(model=model, out=tmp_path / "out", policies=("quality", "speed"), text=text, runs=3,
                          argv=("harness", "compare"))
    return opts, _info(), FakeEnv(tmp_path)


def test_run_order_quality_first_then_abba_interleaving(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup
    runner = FakeRunner()
    run_compare(opts, runner, info, env=env)
    assert runner.calls == [
        "ppl:patched:full", "ppl:stock:stock", "ppl:patched:quality", "ppl:patched:speed",
        "bench:stock:stock", "bench:patched:quality", "bench:patched:speed",
        "bench:patched:speed", "bench:patched:quality", "bench:stock:stock",
        "bench:stock:stock", "bench:patched:quality", "bench:patched:speed",
    ]


def test_results_records_and_summary(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup
    res = run_compare(opts, FakeRunner(), info, env=env)
    everything = ResultsFile(opts.out / "results.jsonl").read()
    meta = everything[0]
    assert meta["kind"] == "meta" and meta["command"] == "compare"
    assert meta["options"]["policies"] == ["quality", "speed"] and meta["options"]["n_ctx"] == 512
    records = _runs(opts.out)
    assert len(records) == 13 and res.n_run == 13
    for rec in records:
        assert rec["schema_version"] == 1
        assert rec["provenance"]["pin"] == "llama-cpp-python-x" and rec["provenance"]["argv"] == ["harness", "compare"]
    bench = [r for r in records if r["kind"] == "bench"]
    assert all(len(t["samples_ns"]) == 1 for r in bench for t in r["tests"])
    # quality: paired deltas vs the full model; the shift of 0.05 nats is +5.13%, exactly (constant shift)
    q = {r.config: r for r in res.quality}
    assert q["speed"].delta is not None and q["speed"].delta.delta_pct == pytest.approx(100 * np.expm1(0.05))
    assert q["quality"].delta is not None and not q["quality"].delta.ci_contains_zero
    assert q["full"].delta is None and q["quality"].cache is not None
    assert q["quality"].cache.substitution_rate == pytest.approx(0.1)
    # speed: 3 samples per config and test; patched/stock ratio near 25/10
    tg = {r.config: r for r in res.speed if r.test == "tg128"}
    assert tg["stock"].tokens_per_s.n == 3
    assert tg["quality"].vs_stock is not None and tg["quality"].vs_stock.ratio == pytest.approx(2.5, rel=0.03)
    assert not res.budget.measurable and "no GPU" in res.budget.message
    assert any("CPU build" in n for n in res.notes)


def test_ctrl_c_keeps_finished_runs_and_resume_skips_them(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup
    first = FakeRunner(interrupt_after=6)
    res = run_compare(opts, first, info, env=env)
    assert res.interrupted and res.n_run == 6
    assert any("interrupted" in w for w in res.warnings)
    assert len(_runs(opts.out)) == 6
    second = FakeRunner()
    second.dumps = first.dumps  # the dumps the first run wrote are still on disk
    res2 = run_compare(opts, second, info, env=env)
    assert not res2.interrupted and res2.n_resumed == 6 and res2.n_run == 7
    assert second.calls[0] == "bench:patched:speed" and len(second.calls) == 7
    keys = [r["key"] for r in _runs(opts.out)]
    assert len(keys) == len(set(keys)) == 13
    assert sum(r["kind"] == "meta" for r in ResultsFile(opts.out / "results.jsonl").read()) == 1
    third = FakeRunner()
    third.dumps = first.dumps
    assert run_compare(opts, third, info, env=env).n_run == 0 and third.calls == []


def test_a_torn_last_line_is_redone(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup
    runner = FakeRunner(interrupt_after=2)
    run_compare(opts, runner, info, env=env)
    path = opts.out / "results.jsonl"
    path.write_text(path.read_text() + '{"schema_version": 1, "key": "ppl:qual')  # killed mid-write
    second = FakeRunner()
    second.dumps = runner.dumps
    res = run_compare(opts, second, info, env=env)
    assert second.calls[0] == "ppl:patched:quality"
    # the torn line is dropped before appending: the redone record is not glued to it (and lost)
    assert any("dropped the torn last line" in n for n in res.notes)
    assert not any("damaged record" in w for w in res.warnings)
    lines = path.read_text().splitlines()
    assert all(isinstance(json.loads(ln), dict) for ln in lines)  # no torn or glued line is left
    assert "ppl:quality" in {r["key"] for r in ResultsFile(path).read()}


def test_resume_refuses_results_of_another_configuration(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup
    run_compare(opts, FakeRunner(interrupt_after=1), info, env=env)
    changed = CompareOptions(**{**opts.__dict__, "n_ctx": 1024})
    with pytest.raises(HarnessError, match="different configuration"):
        run_compare(changed, FakeRunner(), info, env=env)


def test_a_crashed_run_propagates_and_keeps_earlier_records(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup

    class Crashing(FakeRunner):
        def bench(self, build: Build, req: BenchRequest) -> BenchRun:
            raise HarnessError("llama-bench exited with 1")

    with pytest.raises(HarnessError, match="exited with 1"):
        run_compare(opts, Crashing(), info, env=env)
    assert len(_runs(opts.out)) == 4  # the four quality runs


def test_stock_and_cache_off_must_agree(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup

    class Diverging(FakeRunner):
        SHIFT = {**FakeRunner.SHIFT, "stock": 0.01}

    res = run_compare(opts, Diverging(), info, env=env)
    assert any("must agree" in w for w in res.warnings)
    assert not any("must agree" in w for w in run_compare(
        CompareOptions(**{**opts.__dict__, "out": opts.out.parent / "o2"}), FakeRunner(), info, env=env).warnings)


def test_unknown_policy_and_missing_text(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup
    with pytest.raises(HarnessError, match="unknown policy nope"):
        run_compare(CompareOptions(**{**opts.__dict__, "policies": ("quality", "nope")}), FakeRunner(), info, env=env)
    with pytest.raises(HarnessError, match="cannot read the text"):
        run_compare(CompareOptions(**{**opts.__dict__, "text": Path("/nonexistent.txt")}), FakeRunner(), info,
                    env=env)


def test_budget_verified_from_measured_peaks(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, _ = setup
    gpu_env = FakeEnv(opts.model.parent, gpu="NVIDIA RTX 3090")
    budget_mib = plan_compare(info, None).budget_bytes / MiB  # 10 MiB + 25% of 96 MiB = 34 MiB
    res = run_compare(opts, FakeRunner(peak_mib=budget_mib - 1), info, env=gpu_env)
    assert res.budget.ok and "within the budget" in res.budget.message
    over = run_compare(CompareOptions(**{**opts.__dict__, "out": opts.out.parent / "o3"}),
                       FakeRunner(peak_mib=budget_mib + 5), info, env=gpu_env)
    assert len(over.budget.over) == 13 and "over the budget" in over.budget.message


def test_verify_budget_cases() -> None:
    budget = 100 * MiB
    v = verify_budget([("a", "stock", 90.0, "nvidia-smi"), ("b", "quality", 101.0, "memory breakdown"),
                       ("c", "speed", None, "")], budget, True)
    assert [c.key for c in v.over] == ["b"]
    assert "1 run over the budget of 100 MiB: b (101 MiB)" in v.message
    assert "1 run without a device-memory measurement: c" in v.message
    assert not v.ok
    assert verify_budget([("a", "stock", 100.5, "x")], budget, True, tolerance_mib=1).ok
    cpu = verify_budget([("a", "stock", None, "")], budget, False)
    assert not cpu.ok and "no GPU" in cpu.message and "CPU build" in cpu.message


def test_plan_compare_placements() -> None:
    info = _info(layers=6, first_dense=2)  # MoE layers 2..5, 24 MiB of experts each
    budget = Size(bytes=10 * MiB + 2 * 24 * MiB + MiB)  # room for two whole MoE layers
    p = plan_compare(info, budget)
    assert p.stock_gpu_moe_layers == 2
    assert p.stock.n_cpu_moe == 4  # experts of layers 0..3 on the CPU: MoE layers 2 and 3
    assert p.patched.n_cpu_moe == 6  # every expert tensor in host memory
    # 49 MiB for the cache: 4 slots of 12 MiB, less the spare slot (the engine's arithmetic): 3
    assert p.slots.slots_per_layer == 3 and p.host_expert_bytes_stock == 2 * 24 * MiB
    wide = _info(layers=6, first_dense=2, n_expert=16)  # 48 MiB of experts per MoE layer
    narrow = plan_compare(wide, Size(bytes=10 * MiB + 40 * MiB))  # no whole layer fits, 2 slots (+ spare) do
    assert narrow.stock.n_cpu_moe == 6 and narrow.stock_gpu_moe_layers == 0
    assert narrow.slots.slots_per_layer == 2
    whole = plan_compare(info, Size(bytes=1 << 30))
    assert whole.stock.n_cpu_moe == 0 and whole.patched.n_cpu_moe == 0 and whole.fits_whole_model
    assert whole.host_expert_bytes_patched == 0
    assert any("nothing is offloaded" in n for n in whole.notes)
    default = plan_compare(info, None)
    assert any("no --vram" in n for n in default.notes) and default.slots.slots_per_layer == 2
    assert any("admission no room" in n for n in default.notes)  # 2 slots for top-2
    assert not any("admission no room" in n for n in plan_compare(info, Size(fraction=0.5)).notes)
    ram = plan_compare(info, None, host_available_bytes=80 * MiB)
    assert any("patched" in n and "mmap" in n for n in ram.notes)
    assert not any(n.startswith("stock") and "mmap" in n for n in ram.notes)  # stock needs 72 MiB of host RAM


def test_plan_runs_without_text_has_no_quality_runs(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, _ = setup
    runs = plan_runs(CompareOptions(**{**opts.__dict__, "text": None, "runs": 1}), plan_compare(info, None))
    assert [r.key for r in runs] == ["bench:stock:0", "bench:quality:0", "bench:speed:0"]
    cache = runs[1].bench.cache if runs[1].bench else None
    assert cache is not None and cache.render().startswith("mode=engine,policy=quality,slots=2,stats=")


def test_patched_build_without_engine_mode_measures_stock_only(
        setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    opts, info, env = setup

    class NoEngine(FakeRunner):
        def bench(self, build: Build, req: BenchRequest) -> BenchRun:
            if req.cache is not None:
                self.calls.append(f"refused:{req.label}")
                raise ToolCrashedError("llama-bench exited with 1\n  last lines:\n    LLAMA_MOE_CACHE='mode=engine,"
                                       "policy=quality': bad value 'engine' for key 'mode' (accepted: off, emulate)")
            return super().bench(build, req)

    runner = NoEngine()
    res = run_compare(opts, runner, info, env=env)
    assert [c for c in runner.calls if c.startswith(("bench", "refused"))] == [
        "bench:stock:stock", "refused:quality", "bench:stock:stock", "bench:stock:stock"]
    assert any("no 'engine' mode" in n for n in res.notes)
    assert {r.config for r in res.speed} == {"stock"} and len(res.quality) == 4


def test_policy_specs_follow_the_documented_keys() -> None:
    assert policy_cache_spec("quality", "emulate", 16, None).render() == "mode=emulate,policy=quality,slots=16"
    assert policy_cache_spec("rule-0.15", "emulate", 16, "s.json").render() == (
        "mode=emulate,slots=16,stats=s.json,rule=threshold,tau=0.15,evict=lfu,admit=off")
    assert policy_cache_spec("substitute-all", "engine", 8, None).render() == (
        "mode=engine,slots=8,rule=substitute-all,evict=lfu,admit=off")


def test_default_model_and_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HarnessError, match="no default model.*--model"):
        default_model(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.gguf").write_bytes(b"GGUF")
    assert default_model(tmp_path) == tmp_path / "models" / "tiny.gguf"
    (tmp_path / "models" / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(HarnessError, match="several models"):
        default_model(tmp_path)
    (tmp_path / "models" / DEFAULT_MODEL_NAME).write_bytes(b"GGUF")  # several, the default among them
    assert default_model(tmp_path) == tmp_path / "models" / DEFAULT_MODEL_NAME
    (tmp_path / "eval" / "data").mkdir(parents=True)
    (tmp_path / "eval" / "data" / "heldout.txt").write_text("held out")
    assert resolve_text(None, None, tmp_path) == tmp_path / "eval" / "data" / "heldout.txt"
    monkeypatch.setenv("MOE_SUBST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: the import fails
    with pytest.raises(HarnessError, match="needs the 'datasets' package.*--text FILE"):
        resolve_text(None, "wikitext-2", tmp_path)
    with pytest.raises(HarnessError, match="unknown dataset"):
        resolve_text(None, "pile", tmp_path)
    with pytest.raises(HarnessError, match="cannot read the text"):
        resolve_text(tmp_path / "missing.txt", None, tmp_path)
    with pytest.raises(HarnessError, match="either --text or --dataset"):
        resolve_text(tmp_path / "t.txt", "wikitext-2", tmp_path)


def test_compare_entry_writes_the_report(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = CompareOptions(out=tmp_path / "out", model=synth_models["qwen3moe"], text=text, runs=1,
                          policies=("fetch-all",))
    res = compare(opts, runner=FakeRunner(), env=FakeEnv(tmp_path))
    assert res.options.model == synth_models["qwen3moe"] and res.plan.info.arch == "qwen3moe"
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.startswith("# harness compare") and "fetch-all" in report


class NoisyRunner(FakeRunner):
    """The speed policy's runs swing between 1x and 6x its speed (a busy machine); records every bench's threads."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int | None] = []
        self.n_speed = 0

    def bench(self, build: Build, req: BenchRequest) -> BenchRun:
        self.threads.append(req.threads)
        run = super().bench(build, req)
        if req.label != "speed":
            return run
        self.n_speed += 1
        f = 6.0 if self.n_speed % 2 else 1.0
        res = tuple(dataclasses.replace(r, samples_ns=tuple(int(ns / f) for ns in r.samples_ns), avg_ts=r.avg_ts * f)
                    for r in run.results)
        return BenchRun(res, run.output)


def test_unstable_runs_are_marked_and_their_ratio_not_reported(setup: tuple[CompareOptions, ModelInfo, FakeEnv]
                                                               ) -> None:
    """A configuration whose runs vary far more than the machine allows a result (CV above 25%, or a ratio CI
    wider than half the ratio) is marked UNSTABLE in the table and the report, with its reason, and no ratio to
    stock is printed for it; stable configurations keep theirs."""
    from harness.report.markdown import render_compare_markdown
    from harness.report.tables import speed_cells

    opts, info, env = setup
    res = run_compare(opts, NoisyRunner(), info, env=env)
    rows = {(r.config, r.test): r for r in res.speed}
    for test in ("pp512", "tg128"):
        noisy, calm = rows[("speed", test)], rows[("quality", test)]
        assert "speed's" in noisy.unstable and "CV" in noisy.unstable, noisy
        assert speed_cells(noisy)[3] == "UNSTABLE (see warnings)"
        assert calm.unstable == "" and speed_cells(calm)[3].startswith("2.4"), speed_cells(calm)
        assert any(w.startswith(f"speed {test}: UNSTABLE, no ratio to stock reported") for w in noisy.warnings)
    md = render_compare_markdown(res)
    assert md.count("UNSTABLE (see warnings)") == 2 and "speed tg128: UNSTABLE" in md


def test_threads_default_to_the_free_cpus_and_are_named(setup: tuple[CompareOptions, ModelInfo, FakeEnv]) -> None:
    """No --threads: every run gets the CPUs free now (the environment's count), and the plan's notes say so;
    --threads N is used as given and named; --threads 0 is refused."""
    from dataclasses import replace

    opts, info, env = setup
    runner = NoisyRunner()
    res = run_compare(opts, runner, info, env=env)
    assert runner.threads and set(runner.threads) == {3}
    assert any(n.startswith("threads: 3 per run, no more than the machine has free (4 CPUs") for n in res.notes)
    runner = NoisyRunner()
    res = run_compare(replace(opts, threads=2, out=opts.out.parent / "out2"), runner, info, env=env)
    assert set(runner.threads) == {2} and "threads: 2 per run (--threads)" in res.notes
    with pytest.raises(HarnessError, match="--threads must be at least 1"):
        run_compare(replace(opts, threads=0, out=opts.out.parent / "out3"), runner, info, env=env)


@pytest.mark.parametrize(("cpus", "load", "want"), [(8, 0.0, 8), (8, 2.4, 6), (8, 2.6, 5), (2, 2.0, 1), (2, 7.0, 1),
                                                    (1, 0.0, 1)])
def test_threads_without_oversubscription(cpus: int, load: float, want: int) -> None:
    from harness.tools.runners import threads_without_oversubscription

    assert threads_without_oversubscription(cpus, load) == want
