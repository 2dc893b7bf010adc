"""`--moe-cache auto` (issue 24, item 1): the plan chosen from the model's and the machine's facts.

- the decision on fake facts (fits in RAM -> off; bigger than RAM -> the file tier with ram= from the limit; a GPU;
  a tiny limit, repacked experts, no mmap -> one line): tests/cpp/test_expert_auto.cpp;
- with the real build: a model that fits stays off (the output is stock's) and says why; under a fake machine whose
  memory cgroup is smaller than the model (LLAMA_MOE_CACHE_MACHINE_ROOT), auto runs the file tier with the logged
  plan's slots, the same as the spec it names; the keys after `auto` override the plan's; without mmap it is one line
  naming the flag; `--moe-cache auto` is the same as the variable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from harness.core.project import Build
from harness.tools.synth import SynthSpec, write_synth_model

ROOT = Path(__file__).resolve().parents[1]
OUR_SRC = ROOT / "src"
MiB = 2**20


def test_expert_auto_unit(tmp_path: Path, policy_sources: list[Path]) -> None:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "test_expert_auto"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{OUR_SRC / 'llama'}", f"-I{OUR_SRC / 'include'}",
                    str(ROOT / "tests" / "cpp" / "test_expert_auto.cpp"), *map(str, policy_sources), "-o",
                    str(exe)], check=True, capture_output=True, text=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all expert auto tests passed" in res.stdout


def _fake_machine(root: Path, limit: int) -> Path:
    """A fake /proc and /sys: 16 GiB available, this process in a v2 cgroup whose parent is limited to `limit`."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text("MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n")
    (root / "proc" / "self" / "cgroup").write_text("0::/job/run\n")
    (root / "sys" / "fs" / "cgroup" / "job" / "run").mkdir(parents=True)
    (root / "sys" / "fs" / "cgroup" / "job" / "memory.max").write_text(f"{limit}\n")
    (root / "sys" / "fs" / "cgroup" / "job" / "memory.current").write_text("0\n")
    return root


def _run(build: Build, model: Path, text: Path, tmp: Path, env: dict[str, str], *extra: str) -> tuple[int, str, bytes]:
    logits = tmp / "logits.bin"
    logits.unlink(missing_ok=True)
    args = [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "128", "-b", "128",
            "--chunks", "2", "-t", "2", "-ub", "1", "-lv", "4", "--kl-divergence-base", str(logits), *extra]
    base = {k: v for k, v in os.environ.items() if k not in ("LLAMA_MOE_CACHE", "LLAMA_MOE_CACHE_MACHINE_ROOT")}
    res = subprocess.run(args, env={**base, **env}, capture_output=True, text=True, timeout=600)
    return res.returncode, res.stdout + res.stderr, logits.read_bytes() if logits.exists() else b""


def _auto_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if "llama_expert_cache: auto: " in ln]
    assert len(lines) == 1, out[-3000:]
    return lines[0].split("llama_expert_cache: auto: ", 1)[1]


@pytest.mark.build
def test_a_model_that_fits_stays_off(patched_build: Build, synth_text_file: Path, tmp_path: Path) -> None:
    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    rc, out, stock = _run(patched_build, model, synth_text_file, tmp_path, {})
    assert rc == 0 and stock
    rc, out, logits = _run(patched_build, model, synth_text_file, tmp_path, {"LLAMA_MOE_CACHE": "auto"})
    assert rc == 0, out[-3000:]
    line = _auto_line(out)
    assert line.startswith("off: the model (") and "stock is as fast" in line, line
    assert logits == stock  # off is the stock graph
    # --moe-cache auto is the same
    rc, out, logits = _run(patched_build, model, synth_text_file, tmp_path, {}, "--moe-cache", "auto")
    assert rc == 0 and _auto_line(out).startswith("off: ") and logits == stock


@pytest.mark.build
def test_a_model_bigger_than_the_limit_runs_the_file_tier(patched_build: Build, synth_text_file: Path,
                                                          tmp_path: Path) -> None:
    """144 MiB of experts under a (fake) 130 MiB memory cgroup: the file tier, ram= the limit less 10%, the plan's
    slots; the spec it names, given by hand, takes the same decisions; the user's keys after auto win."""
    from harness.parsers.cache_plan import parse_cache_plan

    model = write_synth_model(SynthSpec(n_layer=2, n_expert=48, n_expert_used=4, n_embd=256, n_ff_exp=512),
                              tmp_path / "m.gguf")
    env = {"LLAMA_MOE_CACHE_MACHINE_ROOT": str(_fake_machine(tmp_path / "machine", 130 * MiB))}
    stats = tmp_path / "auto.json"
    rc, out, auto_logits = _run(patched_build, model, synth_text_file, tmp_path,
                                {**env, "LLAMA_MOE_CACHE": f"auto,vram_reserve=16M,stats={stats}"})
    assert rc == 0, out[-3000:]
    line = _auto_line(out)
    m = re.match(r"(mode=engine,policy=quality,host=file,ram=(\d+)M,vram_reserve=16M),stats=\S+: the model \(", line)
    assert m, line
    assert int(m[2]) == (130 * MiB - 130 * MiB // 100 * 10) >> 20  # the limit less the 10% margin, in whole MiB
    assert "the memory cgroup /job (v2, limit 130.0 MiB" in line and "runs from the file tier" in line, line
    assert "policy quality (no tuned profile)" in line
    slots = int(re.search(r"file tier: (\d+) of 48 experts per layer", line)[1])  # type: ignore[index]
    plan = parse_cache_plan(out)
    assert plan.key == "ram" and plan.budget == int(m[2]) * MiB and plan.slots == slots
    cfg = json.loads(stats.read_text())["config"]
    assert (cfg["slots"], cfg["host"], cfg["policy"]) == (slots, "file", "quality")
    # the spec the line names, by hand: the same decisions, the same output
    hand = tmp_path / "hand.json"
    rc, out, hand_logits = _run(patched_build, model, synth_text_file, tmp_path,
                                {**env, "LLAMA_MOE_CACHE": f"{m[1]},stats={hand}"})
    assert rc == 0 and hand_logits == auto_logits
    assert json.loads(hand.read_text())["total"] == json.loads(stats.read_text())["total"]
    # the user's policy wins and the line says so
    rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path,
                      {**env, "LLAMA_MOE_CACHE": "auto,vram_reserve=16M,policy=speed"})
    assert rc == 0 and "policy=speed" in _auto_line(out) and "policy speed (given)" in _auto_line(out)
    # without mmap the file tier cannot read the experts: one line naming the flag
    rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path,
                      {**env, "LLAMA_MOE_CACHE": "auto,vram_reserve=16M"}, "--load-mode", "none")
    lines = [ln for ln in out.splitlines() if "auto: the model" in ln]
    assert rc != 0 and len(lines) == 1 and "load it with mmap" in lines[0], out[-3000:]
    # a limit too small for even k slots: stock, as stock would run (issue 35: it was refused), one line saying what
    # is needed; the output is stock's
    env = {"LLAMA_MOE_CACHE_MACHINE_ROOT": str(_fake_machine(tmp_path / "tiny", 40 * MiB))}
    rc, out, tiny_logits = _run(patched_build, model, synth_text_file, tmp_path, {**env, "LLAMA_MOE_CACHE": "auto"})
    lines = [ln for ln in out.splitlines() if "auto: off: the model" in ln]
    assert rc == 0 and len(lines) == 1 and "even that needs at least" in lines[0], out[-3000:]
    assert "runs stock" in lines[0] and "-ub" in lines[0]
    rc, out, stock_logits = _run(patched_build, model, synth_text_file, tmp_path,
                                 {**env, "LLAMA_MOE_CACHE": "mode=off"})
    assert rc == 0 and tiny_logits == stock_logits


@pytest.mark.build
def test_the_file_tier_counts_what_the_process_holds(patched_build: Build, synth_text_file: Path,
                                                     tmp_path: Path) -> None:
    """With what the process holds known (RssAnon at context creation, a fake 12 MiB here), the file tier's plan
    counts that, less the context, and 8 MiB of growth in place of the fixed 48 MiB runtime (studymoe in 92 MiB: 372
    slots of 512 where the constant left 145): the line writes it as runtime=, the engine plans with it (its budget's
    baseline, the same slots), and the spec the line names, given by hand, takes the same decisions."""
    from harness.parsers.cache_plan import parse_cache_plan

    model = write_synth_model(SynthSpec(n_layer=2, n_expert=48, n_expert_used=4, n_embd=256, n_ff_exp=512),
                              tmp_path / "m.gguf")
    machine = _fake_machine(tmp_path / "machine", 130 * MiB)
    rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path,
                      {"LLAMA_MOE_CACHE_MACHINE_ROOT": str(machine), "LLAMA_MOE_CACHE": "auto,vram_reserve=16M"})
    assert rc == 0, out[-3000:]
    fixed = parse_cache_plan(out)
    assert fixed.baseline == 48 * MiB  # held unknown (no proc/self/status): the constant, no runtime=
    assert "runtime=" not in _auto_line(out)
    (machine / "proc" / "self" / "status").write_text("Name:\tllama-perplexity\nRssAnon:\t   12288 kB\n")
    stats = tmp_path / "auto.json"
    rc, out, auto_logits = _run(patched_build, model, synth_text_file, tmp_path,
                                {"LLAMA_MOE_CACHE_MACHINE_ROOT": str(machine),
                                 "LLAMA_MOE_CACHE": f"auto,vram_reserve=16M,stats={stats}"})
    assert rc == 0, out[-3000:]
    line = _auto_line(out)
    m = re.match(r"(mode=engine,policy=quality,host=file,ram=117M,runtime=(\d+)M,vram_reserve=16M),stats=\S+: ", line)
    assert m, line
    plan = parse_cache_plan(out)
    assert plan.baseline == int(m[2]) * MiB and plan.baseline == -(-(12 * MiB - plan.context + 8 * MiB) // MiB) * MiB
    slots = int(re.search(r"file tier: (\d+) of 48 experts per layer", line)[1])  # type: ignore[index]
    assert plan.slots == slots and slots > fixed.slots, (slots, fixed.slots)
    hand = tmp_path / "hand.json"
    rc, out, hand_logits = _run(patched_build, model, synth_text_file, tmp_path,
                                {"LLAMA_MOE_CACHE_MACHINE_ROOT": str(machine),
                                 "LLAMA_MOE_CACHE": f"{m[1]},stats={hand}"})
    assert rc == 0 and parse_cache_plan(out).slots == slots and hand_logits == auto_logits
    assert json.loads(hand.read_text())["total"] == json.loads(stats.read_text())["total"]


@pytest.mark.build
def test_near_the_fit_auto_measures_whether_stock_fits(patched_build: Build, synth_text_file: Path,
                                                        tmp_path: Path) -> None:
    """Issue 35's band: the mapped weights fit beside what the process holds (a fake 12 MiB), the estimate with the
    compute buffers and logits (vram_reserve=16M) does not. Auto touches the weights and counts what stayed resident
    (the fake limit is not enforced, so all of it): stock, the line saying it was measured, stock's output. Below the
    band (the weights and the held memory above the limit) nothing is measured: the file tier."""
    model = write_synth_model(SynthSpec(n_layer=2, n_expert=48, n_expert_used=4, n_embd=256, n_ff_exp=512),
                              tmp_path / "m.gguf")
    def env(limit: int) -> dict[str, str]:
        machine = _fake_machine(tmp_path / f"m{limit}", limit)
        (machine / "proc" / "self" / "status").write_text("Name:\tllama-perplexity\nRssAnon:\t   12288 kB\n")
        return {"LLAMA_MOE_CACHE_MACHINE_ROOT": str(machine), "LLAMA_MOE_CACHE": "auto,vram_reserve=16M"}

    rc, out, stock = _run(patched_build, model, synth_text_file, tmp_path, {"LLAMA_MOE_CACHE": "mode=off"})
    assert rc == 0 and stock, out[-3000:]
    rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path, env(1024 * MiB))
    m = re.match(r"off: the model \((\d+\.\d) MiB with the 12\.0 MiB this process holds", _auto_line(out))
    assert rc == 0 and m, _auto_line(out)
    estimate = float(m[1]) * MiB  # the weights, 12 MiB held and 16 MiB of vram_reserve
    for limit, measured in ((int(estimate - 8 * MiB), True), (int(estimate - 16 * MiB - 4 * MiB), False)):
        rc, out, logits = _run(patched_build, model, synth_text_file, tmp_path, env(limit))
        assert rc == 0, out[-3000:]
        line = _auto_line(out)
        near = [ln for ln in out.splitlines() if "auto: near the fit: " in ln]
        if measured:
            assert line.startswith("off: ") and "measured, all" in line and "stock is as fast" in line, line
            assert len(near) == 1 and re.search(r"near the fit: (\d+\.\d) of \1 MiB", near[0]), near
            assert logits == stock
        else:
            assert "runs from the file tier" in line and "measured" not in line and not near, line


@pytest.mark.build
def test_near_the_fit_runs_the_file_tier(patched_build: Build, synth_text_file: Path, tmp_path: Path) -> None:
    """Issue 35: a model file of 98.6 MiB in a (fake) 130 MiB limit, 139 MiB with its context, compute buffers and
    runtime (the fixed estimate: the fake machine has no /proc/self/status, so what the process holds is unknown):
    near the fit, where stock's page cache thrashes (gen194 in 200 MiB: the file tier 8x stock at read_ahead_kb 8192),
    auto runs the file tier, its budget the limit less the margin; a model loaded without mmap there runs stock, the
    line giving the file tier's spec, which runs as given with mmap."""
    model = write_synth_model(SynthSpec(n_layer=2, n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=512),
                              tmp_path / "m.gguf")
    env = {"LLAMA_MOE_CACHE_MACHINE_ROOT": str(_fake_machine(tmp_path / "machine", 130 * MiB))}
    rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path,
                      {**env, "LLAMA_MOE_CACHE": "auto,vram_reserve=16M"})
    assert rc == 0, out[-3000:]
    line = _auto_line(out)
    assert line.startswith("mode=engine,policy=quality,host=file,ram=117M,vram_reserve=16M: the model (138.8 MiB"), line
    assert "runs from the file tier" in line and "and the runtime) is more than the 130.0 MiB" in line, line
    # -lm none (no mmap): stock, not refused; its output is stock's
    rc, out, stock = _run(patched_build, model, synth_text_file, tmp_path,
                          {**env, "LLAMA_MOE_CACHE": "mode=off"}, "-lm", "none")
    assert rc == 0 and stock, out[-3000:]
    rc, out, logits = _run(patched_build, model, synth_text_file, tmp_path,
                           {**env, "LLAMA_MOE_CACHE": "auto,vram_reserve=16M"}, "-lm", "none")
    assert rc == 0, out[-3000:]
    line = _auto_line(out)
    assert line.startswith("off: near the fit: the model file (98.6 MiB) fits in the 130.0 MiB"), line
    assert "and mmap" in line and "runs stock" in line and "`harness compare --ram 130M` measures both" in line
    assert logits == stock
    spec = re.search(r"--moe-cache (\S+)\)", line)
    assert spec and "host=file,ram=117M" in spec[1], line
    rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path,
                      {**env, "LLAMA_MOE_CACHE": f"{spec[1]},vram_reserve=16M"})
    assert rc == 0 and "llama_expert_cache: " in out, out[-3000:]


@pytest.mark.build
def test_the_plan_line_shows_at_the_tools_default_verbosity(patched_build: Build, synth_text_file: Path,
                                                            tmp_path: Path) -> None:
    """What auto chose, and why, in one line without -lv: llama-perplexity and llama-server log it (a warning);
    llama-cli, whose default verbosity is "error", prints it in its banner (from llama-server's /props, which carries
    it as moe_cache_auto)."""
    from test_midrun import llama_server

    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    base = {k: v for k, v in os.environ.items() if k not in ("LLAMA_MOE_CACHE", "LLAMA_MOE_CACHE_MACHINE_ROOT")}
    res = subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(model), "-f", str(synth_text_file),
                          "-c", "128", "--chunks", "1", "-t", "2", "--moe-cache", "auto"], env=base,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = _auto_line(res.stdout + res.stderr)
    assert line.startswith("off: the model (") and "stock is as fast" in line

    # (each run's own line: the memory facts move between runs)
    with llama_server(patched_build, model, "auto", tmp_path / "server.log") as server:
        line = _auto_line(server.log())
        assert line.startswith("off: the model (") and "stock is as fast" in line
        with urllib.request.urlopen(server.base + "/props", timeout=30) as r:
            assert json.loads(r.read())["moe_cache_auto"] == line

    res = subprocess.run([str(patched_build.tool("llama-cli")), "-m", str(model), "-p", "one two", "-n", "2", "-st",
                          "-t", "2", "--moe-cache", "auto"], env=base, capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    banner = [ln for ln in res.stdout.splitlines() if ln.startswith("moe-cache  : auto: ")]
    assert len(banner) == 1 and banner[0].startswith("moe-cache  : auto: off: the model (") and \
        "stock is as fast" in banner[0], res.stdout[-3000:]
    # without auto, no such line
    res = subprocess.run([str(patched_build.tool("llama-cli")), "-m", str(model), "-p", "one two", "-n", "2", "-st",
                          "-t", "2"], env=base, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                         cwd=tmp_path)
    assert res.returncode == 0 and "moe-cache  :" not in res.stdout
