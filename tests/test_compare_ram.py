"""`harness compare --ram SIZE`: stock and patched under one RAM limit, every run inside a memory cgroup.

With fake runners (the pattern of tests/test_compare.py): the plan and its budget terms, the run matrix (cgroup,
--repack 0, host=file and the plan's slots in every patched run), the verdict from the cgroup's peaks, the option
errors, the cgroup removed on Ctrl-C.
With the real builds (marker `build`), skipped where this machine has no writable memory cgroup: one small
end-to-end comparison on a generated model, both builds measured inside the cgroup, the cgroup gone afterwards."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
from test_compare import FakeEnv, FakeRunner, _info

from harness.cli.app import build_parser, main
from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.core.records import ResultsFile
from harness.core.sizes import Size
from harness.domain.options import CompareOptions
from harness.domain.plan import ENGINE_RESERVE, kv_cache_bytes, ram_budget_terms
from harness.orchestration.compare import compare, run_compare
from harness.orchestration.planner import plan_compare_ram
from harness.parsers.gguf_model import ModelInfo, read_model_info
from harness.report.markdown import render_compare_markdown
from harness.report.terminal import render_compare_text
from harness.tools.cgroup import CgroupError, MemoryCgroup
from harness.tools.requests import BenchRequest, BenchRun, PerplexityRequest, PerplexityRun, RunOutput
from harness.tools.synth import SynthSpec, write_synth_model

MiB = 2**20
GiB = 2**30
LIMIT = 420 * MiB  # the default reserve (256 MiB) and the runtime's baseline (48 MiB) with room for slots


class FakeCgroup(MemoryCgroup):
    """No kernel: records that it was entered and removed."""

    def __init__(self, limit: int) -> None:  # noqa: D107 - no super(): nothing is made
        self.limit, self.version, self.path = limit, 1, Path("/fake/cgroup")
        self.limit_file, self.peak_file = "memory.limit_in_bytes", "memory.max_usage_in_bytes"
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.path = None


class RamEnv(FakeEnv):
    def __init__(self, tmp: Path, host: int = 64 * GiB, fail: str | None = None) -> None:
        super().__init__(tmp, host=host)
        self.fail = fail
        self.cgroups: list[FakeCgroup] = []

    def memory_cgroup(self, limit: int) -> MemoryCgroup:
        if self.fail:
            raise CgroupError(self.fail)
        self.cgroups.append(FakeCgroup(limit))
        return self.cgroups[-1]


class RamRunner(FakeRunner):
    """FakeRunner that keeps every request and reports a peak in the request's cgroup (None: not measured)."""

    def __init__(self, peak: int | None = 100 * MiB, interrupt_after: int | None = None) -> None:
        super().__init__(interrupt_after=interrupt_after)
        self.peak = peak
        self.requests: list[BenchRequest | PerplexityRequest] = []

    def _ram(self, out: RunOutput, req: BenchRequest | PerplexityRequest) -> RunOutput:
        self.requests.append(req)
        if req.cgroup is None:
            return out
        return dataclasses.replace(out, peak_ram_bytes=self.peak, ram_limit_bytes=req.cgroup.limit,
                                   peak_ram_source="cgroup v1 memory.max_usage_in_bytes")

    def bench(self, build: Build, req: BenchRequest) -> BenchRun:
        run = super().bench(build, req)
        return dataclasses.replace(run, output=self._ram(run.output, req))

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        run = super().perplexity(build, req)
        return dataclasses.replace(run, output=self._ram(run.output, req))


def _kv_info() -> ModelInfo:
    return dataclasses.replace(_info(), kv_bytes_per_cell=1000)


@pytest.fixture
def ram_setup(tmp_path: Path) -> tuple[CompareOptions, ModelInfo, RamEnv]:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = CompareOptions(model=model, out=tmp_path / "out", policies=("quality", "fetch-all"), text=text, runs=2,
                          ram=Size(bytes=LIMIT), n_prompt=300, n_gen=16, argv=("harness", "compare", "--ram"))
    return opts, _kv_info(), RamEnv(tmp_path)


def test_the_plan_is_the_engines_ram_formula() -> None:
    info = _kv_info()
    plan = plan_compare_ram(info, LIMIT, n_ctx=300)
    assert plan.ram is not None
    t = plan.ram.terms
    # all non-expert weights and the context in RAM, the engine's default reserve, the routed experts in the file
    assert (t.weights, t.reserve, t.context) == (info.non_expert_bytes, ENGINE_RESERVE, 512 * 1000)
    assert kv_cache_bytes(info, 256) == 256 * 1000 and kv_cache_bytes(info, 257) == 512 * 1000
    assert t.per_slot == info.bytes_per_expert * info.n_moe_layers == 3 * MiB * 4
    assert plan.ram.slots_per_layer == plan.slots.slots_per_layer == min(8, (LIMIT - t.fixed) // t.per_slot)
    assert plan.stock.n_gpu_layers == plan.patched.n_gpu_layers == 0  # both on the CPU
    # a given reserve is the engine's vram_reserve; a limit between the minimum and one slot more gives k slots
    small = ram_budget_terms(info, 10 * MiB, kv_cache_bytes(info, 512))
    assert plan_compare_ram(info, small.minimum, reserve_bytes=10 * MiB).slots.slots_per_layer == info.n_expert_used
    with pytest.raises(HarnessError, match=r"too small for this model: its weights in RAM \(the routed experts "
                                           r"excepted\).*the minimum is"):
        plan_compare_ram(info, small.minimum - 1, reserve_bytes=10 * MiB)


def test_every_run_is_inside_the_cgroup_stock_with_mmap_and_the_engine_from_the_file(
        ram_setup: tuple[CompareOptions, ModelInfo, RamEnv]) -> None:
    opts, info, env = ram_setup
    runner = RamRunner()
    announced: list[tuple[int, list[str]]] = []
    res = run_compare(opts, runner, info, env=env,
                      announce=lambda lines: announced.append((len(runner.calls), list(lines))))
    assert len(env.cgroups) == 1 and env.cgroups[0].closed and env.cgroups[0].limit == LIMIT
    assert len(runner.requests) == 4 + 2 * 3 and all(r.cgroup is env.cgroups[0] for r in runner.requests)
    for req in runner.requests:
        assert req.placement.n_gpu_layers == 0
        if isinstance(req, BenchRequest):
            assert req.extra_args == ("--repack", "0")
            if req.label == "stock":
                assert req.cache is None
            else:
                # the plan's slots (the quality runs' too), not ram=: the engine would size each context itself
                assert req.cache is not None and req.cache.slots == res.plan.slots.slots_per_layer
                spec = req.cache.render()
                assert spec.startswith(f"mode=engine,policy={req.label},slots={res.plan.slots.slots_per_layer},")
                assert spec.endswith(",host=file")
                assert "ram=" not in spec
        else:
            assert req.extra_args == ("--no-repack",)
    # the plan is announced before the first run, with the budget terms
    assert len(announced) == 1 and announced[0][0] == 0
    text = "\n".join(announced[0][1])
    for term in ("RAM limit: 420 MiB", "non-expert weights", "context 500 KiB (KV cache of 300 tokens, estimated)",
                 "reserve 256 MiB", "per slot 12 MiB", f"-> {res.plan.slots.slots_per_layer} of 8 slots per layer",
                 "stock: mmap, --repack 0", f"patched: mode=engine,host=file,slots={res.plan.slots.slots_per_layer}",
                 "quality runs"):
        assert term in text, term
    # verified budget: every run's peak in the cgroup next to the limit
    records = [r for r in ResultsFile(opts.out / "results.jsonl").read() if r["kind"] != "meta"]
    assert all(r["peak_ram_bytes"] == 100 * MiB and r["ram_limit_bytes"] == LIMIT for r in records)
    assert res.budget.memory == "RAM" and res.budget.ok and not res.budget.over
    assert "every run stayed inside the RAM limit of 420 MiB" in res.budget.message
    out = render_compare_text(res, width=200)
    assert "highest peak" in out and "100.0 MiB │ 420.0 MiB │          24%" in out
    assert not res.estimates and not any("CPU build" in n for n in res.notes)
    md = render_compare_markdown(res)
    assert "| configuration | runs | highest peak | limit | peak / limit |" in md
    assert "Every run's peak: ppl:full 100.0 MiB" in md and "(cgroup v1 memory.max_usage_in_bytes)" in md


@pytest.mark.parametrize("ram", [True, False])
def test_every_run_of_a_comparison_gets_the_same_slots(ram_setup: tuple[CompareOptions, ModelInfo, RamEnv],
                                                       ram: bool) -> None:
    """One comparison, one residency: every patched run with the cache on, quality (emulate) and speed (engine),
    is given the plan's slots per layer, under --ram as under --vram. (Before, --ram gave the speed runs ram=SIZE
    and no slots, so that the engine chose their residency for each context, and the quality runs the plan's.)"""
    opts, info, env = ram_setup
    if not ram:
        opts = dataclasses.replace(opts, ram=None, vram=Size(fraction=0.5))
    runner = RamRunner()
    res = run_compare(opts, runner, info, env=env)
    planned = res.plan.slots.slots_per_layer
    cached = [r for r in runner.requests if r.cache is not None and r.cache.mode != "off"]
    kinds = {(type(r).__name__, r.cache.mode) for r in cached if r.cache is not None}
    assert kinds == {("PerplexityRequest", "emulate"), ("BenchRequest", "engine")}
    assert len(cached) == 2 + 2 * 2  # two policies: a quality run each, and a speed run each per repetition
    slots = set()
    for r in cached:
        assert r.cache is not None
        items = dict(r.cache.items())
        assert not {"ram", "vram"} & items.keys(), items  # no budget key: the engine would choose its own slots
        slots.add(items.get("slots"))
    assert slots == {str(planned)}, slots


def test_a_run_without_a_peak_is_named(ram_setup: tuple[CompareOptions, ModelInfo, RamEnv]) -> None:
    opts, info, env = ram_setup
    res = run_compare(opts, RamRunner(peak=None), info, env=env)
    assert not res.budget.ok and "10 runs without a peak from the memory cgroup" in res.budget.message


def test_peaks_at_the_limit_are_explained(ram_setup: tuple[CompareOptions, ModelInfo, RamEnv]) -> None:
    opts, info, env = ram_setup
    res = run_compare(opts, RamRunner(peak=LIMIT), info, env=env)
    assert res.budget.ok and "10 of 10 runs peaked at the limit: there the kernel reclaimed page cache" in \
        res.budget.message


def test_the_cgroup_goes_on_ctrl_c(ram_setup: tuple[CompareOptions, ModelInfo, RamEnv]) -> None:
    opts, info, env = ram_setup
    res = run_compare(opts, RamRunner(interrupt_after=3), info, env=env)
    assert res.interrupted and env.cgroups[0].closed


def test_stale_cgroups_removed_are_in_the_notes(ram_setup: tuple[CompareOptions, ModelInfo, RamEnv]) -> None:
    opts, info, env = ram_setup
    line = "removed the stale memory cgroup moe-subst-compare-99 of a harness that was killed (pid 99)"

    class Cleaning(RamEnv):
        def memory_cgroup(self, limit: int) -> MemoryCgroup:
            cg = super().memory_cgroup(limit)
            cg.cleaned = (line,)
            return cg

    res = run_compare(opts, RamRunner(), info, env=Cleaning(opts.out.parent))
    assert line in res.notes


def test_a_different_limit_is_another_configuration(ram_setup: tuple[CompareOptions, ModelInfo, RamEnv]) -> None:
    opts, info, env = ram_setup
    run_compare(dataclasses.replace(opts, speed=False), RamRunner(), info, env=env)
    with pytest.raises(HarnessError, match="different configuration"):
        run_compare(dataclasses.replace(opts, speed=False, ram=Size(bytes=LIMIT + MiB)), RamRunner(), info, env=env)


@pytest.mark.parametrize(("change", "env_kw", "message"), [
    ({"vram": Size(bytes=GiB)}, {}, "pass either --vram (a device budget) or --ram"),
    ({"ram": Size(fraction=0.25)}, {}, "--ram must be an absolute size"),
    ({"bench_cache_mode": "emulate"}, {}, "--ram runs the patched build with mode=engine,host=file"),
    ({}, {"host": 2 * GiB + 299 * MiB}, "--ram 420 MiB is more than MemAvailable (2.29 GiB) less a 2 GiB margin"),
    ({}, {"fail": "no memory cgroup on this machine (...): run without --ram"}, "no memory cgroup on this machine"),
    ({"ram": Size(bytes=100 * MiB)}, {}, "too small for this model: its weights in RAM"),
])
def test_option_errors_are_one_line_and_run_nothing(ram_setup: tuple[CompareOptions, ModelInfo, RamEnv],
                                                    tmp_path: Path, change: dict[str, object],
                                                    env_kw: dict[str, object], message: str) -> None:
    opts, info, _ = ram_setup
    runner = RamRunner()
    env = RamEnv(tmp_path, **env_kw)  # type: ignore[arg-type]
    with pytest.raises(HarnessError) as e:
        run_compare(dataclasses.replace(opts, **change), runner, info, env=env)  # type: ignore[arg-type]
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert runner.calls == [] and not (opts.out / "results.jsonl").exists()


def test_the_cli_describes_and_checks_ram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    help_text = sub.choices["compare"].format_help()  # type: ignore[attr-defined]
    assert "--ram SIZE" in help_text and "memory cgroup" in help_text and "host=file" in help_text
    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    for args, message in ((["--ram", "25%"], "a size here must be absolute"),
                          (["--ram", "1G", "--vram", "1G"], "pass either --vram")):
        assert main(["compare", "--model", str(model), "--out", str(tmp_path / "o"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("harness: error: ") and message in err and "\n" not in err, err


# ---- end to end: the real builds inside a real memory cgroup ------------------------------------------------------

def _own_cgroups() -> list[Path]:
    """The compare cgroups of this process below its own memory cgroup."""
    try:
        probe = MemoryCgroup(64 * MiB, "moe-subst-probe")
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    assert probe.path is not None
    parent = probe.path.parent
    probe.close()
    return sorted(parent.glob(f"moe-subst-compare-{os.getpid()}"))


@pytest.mark.build
def test_compare_ram_end_to_end(stock_build: Build, patched_build: Build, synth_text_file: Path,
                                tmp_path: Path) -> None:
    assert _own_cgroups() == []
    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    info = read_model_info(model)
    reserve = 100 * MiB  # the process's own memory (libraries, compute buffers) counts against the limit
    terms = ram_budget_terms(info, reserve, kv_cache_bytes(info, 16))
    limit = terms.fixed + 8 * terms.per_slot  # exactly 8 of 16 slots by the harness's formula
    opts = CompareOptions(out=tmp_path / "out", model=model, text=synth_text_file, ram=Size(bytes=limit),
                          reserve_bytes=reserve, policies=("fetch-all", "quality"), runs=1, n_ctx=128, chunks=2,
                          n_prompt=16, n_gen=4, threads=2, argv=("pytest",))
    res = compare(opts)
    assert res.plan.slots.slots_per_layer == 8
    records = [r for r in ResultsFile(opts.out / "results.jsonl").read() if r["kind"] != "meta"]
    assert {r["key"] for r in records} == {"ppl:full", "ppl:stock", "ppl:fetch-all", "ppl:quality", "bench:stock:0",
                                           "bench:fetch-all:0", "bench:quality:0"}
    for r in records:  # stock and patched both ran inside the cgroup (peak > 0; <= limit is the kernel's doing: that
        # the limit binds the tools, page cache counted, is test_the_limit_binds_a_model_bigger_than_it)
        assert r["ram_limit_bytes"] == limit and 0 < r["peak_ram_bytes"] <= limit, r["key"]
        assert r["peak_ram_source"].startswith("cgroup v")
    bench = {r["config"]: r for r in records if r["kind"] == "bench"}
    assert "--repack" in bench["stock"]["argv"] and bench["stock"]["cache_spec"] is None
    for pol in ("fetch-all", "quality"):
        assert ",slots=8," in bench[pol]["cache_spec"] and bench[pol]["cache_spec"].endswith(",host=file")
        assert bench[pol]["engine_slots"] == 8  # the engine's ram= gives the plan's slots: one formula
    assert res.budget.memory == "RAM" and res.budget.ok, res.budget.message
    q = {r.config: r for r in res.quality}
    assert q["full"].ppl == q["stock"].ppl and q["fetch-all"].delta is not None
    assert q["fetch-all"].delta.delta_pct == 0.0
    assert not any("slots per layer from ram=" in w for w in res.warnings), res.warnings
    assert _own_cgroups() == []  # removed at the end
    # re-rendered later (harness report): the same verdict from the records
    from harness.orchestration.compare import reload_compare

    again = reload_compare(opts.out)
    assert again.plan.ram is not None and again.budget.memory == "RAM" and again.budget.ok


@pytest.mark.build
def test_the_limit_binds_a_model_bigger_than_it(stock_build: Build, patched_build: Build, tmp_path: Path) -> None:
    """What `peak <= limit` cannot show (the kernel enforces it): that the limit binds the benchmark, page cache
    counted. A 294 MiB model under a 170 MiB limit: stock llama-bench reads it through mmap, and its peak in the cgroup
    is the limit (the kernel reclaimed page cache there), where its anonymous memory is under 10 MiB; so the page
    cache was charged to the benchmark's cgroup, as compare --ram's premise needs (run_tool drops the model from the
    page cache first: pages cached elsewhere would not be charged). The engine runs to the end under the same limit
    with the plan's slots (its mmap'd weights are read ahead at load, so it also meets the limit and is reclaimed)."""
    try:
        MemoryCgroup(64 * MiB, "moe-subst-probe").close()
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    model = write_synth_model(SynthSpec(n_layer=6, n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=512),
                              tmp_path / "m.gguf")
    info = read_model_info(model)
    reserve = 32 * MiB
    terms = ram_budget_terms(info, reserve, kv_cache_bytes(info, 8))
    limit = terms.fixed + 8 * terms.per_slot
    assert info.file_bytes > 1.5 * limit  # the model does not fit: stock must be held to the limit
    opts = CompareOptions(out=tmp_path / "out", model=model, ram=Size(bytes=limit), reserve_bytes=reserve,
                          policies=("fetch-all",), runs=1, n_prompt=0, n_gen=8, threads=2, quality=False,
                          argv=("pytest",))
    res = compare(opts)
    peaks = {r["key"]: r["peak_ram_bytes"] for r in ResultsFile(opts.out / "results.jsonl").read()
             if r["kind"] == "bench"}
    assert set(peaks) == {"bench:stock:0", "bench:fetch-all:0"}
    assert limit - 2 * MiB <= peaks["bench:stock:0"] <= limit, (peaks, limit)  # held at the limit, cache counted
    assert res.plan.slots.slots_per_layer == 8 and res.budget.ok, res.budget.message
    assert "peaked at the limit: there the kernel reclaimed page cache" in res.budget.message


@pytest.mark.build
def test_a_sigkilled_compare_is_cleaned_up_by_the_next_run(stock_build: Build, patched_build: Build,
                                                          tmp_path: Path) -> None:
    """Before: SIGKILL of `harness compare --ram` left its moe-subst-compare-<pid> cgroup, and the llama-bench running
    in it, behind; the next run did not remove them. Now the next cgroup made beside it (the next compare --ram, or
    bench_tiers) removes the cgroup and ends what still runs in it, with a note."""
    import signal
    import subprocess
    import time

    try:
        probe = MemoryCgroup(64 * MiB, "moe-subst-probe")
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    assert probe.path is not None
    parent = probe.path.parent
    probe.close()
    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    argv = ["compare", "--model", str(model), "--ram", "1G", "--reserve", "100M", "--policies", "fetch-all", "--runs",
            "2", "--no-quality", "--n-prompt", "16", "--n-gen", "2048", "--threads", "1", "--out", str(tmp_path / "o")]
    harness = subprocess.Popen([sys.executable, "-m", "harness", *argv], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    cgroup = parent / f"moe-subst-compare-{harness.pid}"
    tools: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not tools and time.monotonic() < deadline and harness.poll() is None:
            try:
                tools = [int(x) for x in (cgroup / "cgroup.procs").read_text().split()]
            except OSError:
                pass
            time.sleep(0.02)
        assert tools, f"no tool ran in {cgroup}: {harness.poll()} {harness.stderr.read() if harness.stderr else ''}"
        harness.send_signal(signal.SIGKILL)
        harness.wait()
        assert cgroup.is_dir()  # what SIGKILL leaves behind (and, for a while, the running llama-bench)
        nxt = MemoryCgroup(64 * MiB, "moe-subst-probe")
        nxt.close()
        assert not cgroup.exists()
        lines = [line for line in nxt.cleaned if cgroup.name in line]
        assert len(lines) == 1 and lines[0].startswith(f"removed the stale memory cgroup {cgroup.name} of a harness "
                                                       f"that was killed (pid {harness.pid})"), nxt.cleaned
        assert not any(_alive(pid) for pid in tools)
    finally:  # the harness and its tools are this test's own processes
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        for pid in tools:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if cgroup.exists():
            for _ in range(50):
                try:
                    cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
