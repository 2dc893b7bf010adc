"""What the process may really use (issue 26, item 1): ram= (and vram= on host memory) checked against the memory
cgroup limit and MemAvailable, with the process's own memory counted in the plan.

- the parsers of /proc and /sys text, and a plan checked against a fake machine: tests/cpp/test_expert_machine.cpp;
- the harness's plan has the engine's own terms (the runtime's baseline, the reader buffers): the same constants;
- a budget above a fake machine (LLAMA_MOE_CACHE_MACHINE_ROOT) is one line saying what would fit;
- in a small memory cgroup of its own, ram=16G is that one line, not an OOM kill (status 137); the budget the line
  suggests runs to the end in the same cgroup; without the check (the planted bug: no machine facts) the same run
  is killed; `--moe-cache auto` there plans the file tier from the cgroup's limit and runs to the end. Skipped where
  no memory cgroup can be made.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.core.project import Build
from harness.domain.plan import ENGINE_READERS, READ_ALIGN, RUNTIME_BASELINE, ram_budget_terms, reader_buffer_bytes
from harness.tools.synth import SynthSpec, write_synth_model

ROOT = Path(__file__).resolve().parents[1]
OUR_SRC = ROOT / "src"
MiB = 2**20
LIMIT = 150 * MiB  # the cgroup
MARGIN = 1 << 30  # MemAvailable must exceed the cgroup's limit by this much (never starve the machine)


def test_expert_machine_unit(tmp_path: Path, policy_sources: list[Path]) -> None:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "test_expert_machine"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{OUR_SRC / 'llama'}", f"-I{OUR_SRC / 'include'}",
                    str(ROOT / "tests" / "cpp" / "test_expert_machine.cpp"), *map(str, policy_sources), "-o",
                    str(exe)], check=True, capture_output=True, text=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all expert machine tests passed" in res.stdout


def test_the_plans_own_terms_are_the_engines() -> None:
    """The Python mirror's constants are the C++'s: the runtime's baseline, the default readers, the O_DIRECT
    alignment of a read buffer."""
    machine = (OUR_SRC / "llama" / "llama-expert-machine.h").read_text()
    m = re.search(r"#define LLAMA_EXPERT_RUNTIME_BASELINE \((\d+)ull << (\d+)\)", machine)
    assert m and int(m[1]) << int(m[2]) == RUNTIME_BASELINE
    spec = (OUR_SRC / "llama" / "llama-expert-spec.h").read_text()
    m = re.search(r"int32_t\s+readers = (\d+);", spec)
    assert m and int(m[1]) == ENGINE_READERS
    io = (OUR_SRC / "llama" / "llama-expert-io.cpp").read_text()
    m = re.search(r"DIRECT_ALIGN = (\d+);", io)
    assert m and int(m[1]) == READ_ALIGN
    measure = (OUR_SRC / "llama" / "llama-expert-measure.cpp").read_text()  # the budget's model walk
    assert "(uint64_t) (readers + 1) * (max_slice + 2*4096)" in measure  # reader_buffer_bytes's formula


def test_ram_terms_count_the_process(tmp_path: Path) -> None:
    from harness.parsers.gguf_model import read_model_info

    info = read_model_info(write_synth_model(SynthSpec(), tmp_path / "m.gguf"))
    t = ram_budget_terms(info, 16 * MiB, 65536)
    slice_max = max(info.bytes_per_expert_tensor.values())
    assert t.readers == reader_buffer_bytes(info) == (ENGINE_READERS + 1) * (slice_max + 2 * READ_ALIGN)
    assert t.baseline == RUNTIME_BASELINE
    assert t.fixed == (info.non_expert_bytes + 65536 + 16 * MiB + t.readers + RUNTIME_BASELINE + t.per_slot
                       + 512 * t.n_banks)
    assert t.total(3) == t.fixed + 3 * t.per_slot
    assert ram_budget_terms(info, 0, 0, readers=0).readers == 0


def _ppl(build: Build, model: Path, text: Path) -> list[str]:
    return [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "128", "-b", "128",
            "--chunks", "2", "-t", "2", "-ub", "1"]


def _error_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if "is more than this process may use" in ln]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


@pytest.mark.build
def test_ram_above_a_fake_machine_is_one_line(patched_build: Build, synth_text_file: Path, tmp_path: Path) -> None:
    """LLAMA_MOE_CACHE_MACHINE_ROOT: a fake /proc and /sys (v2, a 150 MiB limit on a parent cgroup): ram=16G is one
    line naming the cgroup and a budget that fits; a budget whose plan holds less than the limit runs; vram= on a CPU
    build is checked alike in engine mode, not in emulate mode."""
    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    root = tmp_path / "machine"
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text("MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n")
    (root / "proc" / "self" / "cgroup").write_text("0::/job/run\n")
    (root / "sys" / "fs" / "cgroup" / "job" / "run").mkdir(parents=True)
    (root / "sys" / "fs" / "cgroup" / "job" / "run" / "memory.max").write_text("max\n")
    (root / "sys" / "fs" / "cgroup" / "job" / "memory.max").write_text(f"{LIMIT}\n")
    (root / "sys" / "fs" / "cgroup" / "job" / "memory.current").write_text("0\n")
    env = {**{k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"},
           "LLAMA_MOE_CACHE_MACHINE_ROOT": str(root)}
    args = _ppl(patched_build, model, synth_text_file)
    # the default reserve (256 MiB) alone is more than the limit
    res = subprocess.run(args, env={**env, "LLAMA_MOE_CACHE": "mode=engine,host=file,ram=16G"}, capture_output=True,
                         text=True, timeout=300)
    line = _error_line(res.stdout + res.stderr)
    assert res.returncode != 0
    assert "the memory cgroup /job (v2, limit 150.0 MiB" in line and "not even 4 slots per layer fit" in line, line
    # with a small reserve the whole model fits: ram=16G holds less than the limit and runs
    res = subprocess.run(args, env={**env, "LLAMA_MOE_CACHE": "mode=engine,host=file,ram=16G,vram_reserve=16M"},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    # vram= on a CPU build: its banks are host memory, checked alike
    res = subprocess.run(args, env={**env, "LLAMA_MOE_CACHE": "mode=engine,vram=16G"}, capture_output=True, text=True,
                         timeout=300)
    line = _error_line(res.stdout + res.stderr)
    assert res.returncode != 0 and line.split("': ", 1)[1].startswith("vram=16384 MiB"), line
    # emulate mode allocates no banks (its budget may describe another machine): not checked
    res = subprocess.run(args, env={**env, "LLAMA_MOE_CACHE": "mode=emulate,vram=16G"}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]


@pytest.mark.build
def test_ram_above_the_cgroup_is_one_line_not_a_kill(patched_build: Build, synth_text_file: Path,
                                                      tmp_path: Path) -> None:
    """The issue's case: in a 150 MiB memory cgroup, mode=engine,host=file,policy=quality,ram=16G was killed (status
    137, nothing printed). Now it is one line that names the cgroup and what would fit; that budget runs to the end in
    the same cgroup; and with the check disabled (no machine facts: the planted bug) the same run is OOM-killed."""
    from harness.tools.cgroup import CgroupError, MemoryCgroup, check_ram_limit, mem_available

    check_ram_limit(LIMIT, mem_available(), MARGIN, what="the test's cgroup")
    try:
        cg = MemoryCgroup(LIMIT, "moe-subst-machinetest")
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    # 156 MiB of routed experts: more than the limit (a model file that fits is near the fit, where auto runs stock
    # since issue 35; 96 MiB fit for stock)
    model = write_synth_model(SynthSpec(n_layer=2, n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=832),
                              tmp_path / "m.gguf")
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_MOE_CACHE", "LLAMA_MOE_CACHE_MACHINE_ROOT")}
    args = _ppl(patched_build, model, synth_text_file)
    spec = "mode=engine,host=file,policy=quality,vram_reserve=16M"
    with cg:
        assert cg.path is not None
        rc, out, err = cg.run(args, {**env, "LLAMA_MOE_CACHE": spec + ",ram=16G"}, timeout=300)
        line = _error_line(out + err)
        assert rc == 1 and cg.oom_kills() in (0, None), (rc, (out + err)[-2000:])
        assert cg.path.name in line and "limit 150.0 MiB" in line, line
        m = re.search(r"; ram=(\d+)M would fit \((\d+) of 32 experts resident per layer\)$", line)
        assert m and 4 <= int(m[2]) < 32, line
        # the budget it names runs to the end in the same cgroup
        rc, out, err = cg.run(args, {**env, "LLAMA_MOE_CACHE": f"{spec},ram={m[1]}M,stats={tmp_path / 's.json'}"},
                              timeout=600)
        assert rc == 0 and "Final estimate" in out + err, (out + err)[-3000:]
        assert cg.oom_kills() in (0, None)
        # --moe-cache auto in the same cgroup: the file tier, ram= from the cgroup's limit less its margin, to the end
        rc, out, err = cg.run([*args, "-lv", "4"], {**env, "LLAMA_MOE_CACHE": "auto,vram_reserve=16M"}, timeout=600)
        auto = [ln for ln in (out + err).splitlines() if "llama_expert_cache: auto: " in ln]
        assert rc == 0 and len(auto) == 1 and "runs from the file tier" in auto[0], (out + err)[-3000:]
        assert cg.path.name in auto[0] and cg.oom_kills() in (0, None)
        # the planted bug: no machine facts (an empty root) and the same run is killed by the kernel, not told
        empty = tmp_path / "empty"
        empty.mkdir()
        rc, out, err = cg.run(args, {**env, "LLAMA_MOE_CACHE": spec + ",ram=16G",
                                     "LLAMA_MOE_CACHE_MACHINE_ROOT": str(empty)}, timeout=300)
        assert rc in (-9, 137) or (cg.oom_kills() or 0) > 0, (rc, (out + err)[-2000:])
        parent = cg.path.parent
        name = cg.path.name
    assert not (parent / name).exists()  # removed afterwards
