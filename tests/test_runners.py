"""harness.tools.runners with stand-in executables (shell scripts); no llama.cpp build needed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.tools.requests import CACHE_ENV_VAR, BenchRequest, CacheSpec, PerplexityRequest, Placement
from harness.tools.runners import (
    ToolCrashedError,
    ToolRunner,
    ToolTimeoutError,
    bench_args,
    perplexity_args,
    run_tool,
)

DATA = Path(__file__).resolve().parent / "data" / "stock-cpu"


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_crash_shows_the_last_lines_and_the_command(tmp_path: Path) -> None:
    tool = _script(tmp_path / "llama-bench", 'for i in $(seq 1 30); do echo "line $i"; done\n'
                   'echo "GGML_ASSERT(n_slots > 0) failed" >&2\nexit 134\n')
    with pytest.raises(ToolCrashedError) as e:
        run_tool(tool, ["-m", "x.gguf"], env={CACHE_ENV_VAR: "mode=engine"}, sample_gpu=False)
    msg = str(e.value)
    assert "llama-bench exited with 134" in msg
    assert f"{CACHE_ENV_VAR}=mode=engine {tool} -m x.gguf" in msg
    assert "GGML_ASSERT(n_slots > 0) failed" in msg and "line 30" in msg and "line 5\n" not in msg


def test_killed_by_a_signal(tmp_path: Path) -> None:
    tool = _script(tmp_path / "t", "echo about to die\nkill -SEGV $$\n")
    with pytest.raises(ToolCrashedError, match="killed by signal 11"):
        run_tool(tool, [], sample_gpu=False)


def test_timeout(tmp_path: Path) -> None:
    tool = _script(tmp_path / "t", "echo started\nexec sleep 30\n")
    with pytest.raises(ToolTimeoutError, match=r"(?s)timeout of 0.3 s.*started"):
        run_tool(tool, [], timeout_s=0.3, sample_gpu=False)


def test_only_the_requested_cache_spec_reaches_the_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = _script(tmp_path / "t", f'echo "spec=${{{CACHE_ENV_VAR}:-unset}}"\n')
    monkeypatch.setenv(CACHE_ENV_VAR, "mode=emulate,policy=speed")
    assert run_tool(tool, [], sample_gpu=False).stdout.strip() == "spec=unset"
    out = run_tool(tool, [], env={CACHE_ENV_VAR: "mode=off"}, sample_gpu=False)
    assert out.stdout.strip() == "spec=mode=off" and out.returncode == 0 and out.peak_gpu_mib is None
    assert os.environ[CACHE_ENV_VAR] == "mode=emulate,policy=speed"


def test_cache_spec_render_and_validation() -> None:
    spec = CacheSpec("emulate", "quality", 25, "/tmp/out dir/stats.json", (("beta", "0.5"),))
    assert spec.render() == "mode=emulate,policy=quality,slots=25,stats=/tmp/out dir/stats.json,beta=0.5"
    assert CacheSpec("off").render() == "mode=off"
    assert CacheSpec("engine", slots="25%").render() == "mode=engine,slots=25%"
    with pytest.raises(HarnessError, match="unknown cache mode"):
        CacheSpec("fast")
    with pytest.raises(HarnessError, match="may not contain"):
        CacheSpec("emulate", "quality,beta=1")
    with pytest.raises(HarnessError, match="stats path"):
        CacheSpec("emulate", stats="/tmp/a,b.json")


def test_argument_lists() -> None:
    b = bench_args(BenchRequest(Path("m.gguf"), Placement(n_cpu_moe=3), n_prompt=512, n_gen=128, threads=4))
    assert b == ["-m", "m.gguf", "-o", "json", "-r", "1", "-ngl", "999", "-ncmoe", "3", "-p", "512", "-n", "128",
                 "-t", "4"]
    p = perplexity_args(PerplexityRequest(Path("m.gguf"), Path("t.txt"), Placement(n_cpu_moe=48), chunks=10,
                                          nll_dump=Path("o/full.bin")))
    assert p[:4] == ["-m", "m.gguf", "-f", "t.txt"]
    assert "--n-cpu-moe" in p and p[p.index("--n-cpu-moe") + 1] == "48"
    assert p[p.index("--chunks") + 1] == "10" and p[p.index("--nll-dump") + 1] == "o/full.bin"
    assert p[p.index("-lv") + 1] == "4" and p[p.index("--fit") + 1] == "off"


def _fake_perplexity(tmp_path: Path, cut_first: int) -> Build:
    """A llama-perplexity stand-in replaying captured output; its first `cut_first` runs lose their end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = tmp_path / "count"
    _script(bin_dir / "llama-perplexity", f"""n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}
if [ "$n" -lt {cut_first} ]; then
  cat {DATA}/perplexity-truncated.stdout; cat {DATA}/perplexity-truncated.stderr >&2
else
  cat {DATA}/perplexity-lv4.stdout; cat {DATA}/perplexity-lv4.stderr >&2
fi
""")
    return Build("stock", "cpu", bin_dir)


def test_perplexity_repeats_a_run_that_lost_its_output(tmp_path: Path) -> None:
    build = _fake_perplexity(tmp_path, cut_first=2)
    run = ToolRunner(attempts=3).perplexity(build, PerplexityRequest(Path("m"), Path("t"), Placement()))
    assert run.attempts == 3 and run.result.ppl == 822.0579
    assert run.memory is not None and run.memory.host is not None


def test_perplexity_gives_up_after_the_last_attempt(tmp_path: Path) -> None:
    build = _fake_perplexity(tmp_path, cut_first=5)
    with pytest.raises(HarnessError, match="Final estimate"):
        ToolRunner(attempts=2).perplexity(build, PerplexityRequest(Path("m"), Path("t"), Placement()))
    assert (tmp_path / "count").read_text().strip() == "2"


def test_cache_settings_need_the_patched_build(tmp_path: Path) -> None:
    build = _fake_perplexity(tmp_path, cut_first=0)
    req = PerplexityRequest(Path("m"), Path("t"), Placement(), cache=CacheSpec("emulate", "quality"))
    with pytest.raises(HarnessError, match="needs the patched build"):
        ToolRunner().perplexity(build, req)


def test_a_failed_bench_context_is_repeated_verbosely(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "llama-bench", """case "$*" in
  *-v*) echo "llama_init_from_model: failed to initialize the context: LLAMA_MOE_CACHE='mode=engine': \\
bad value 'engine' for key 'mode' (accepted: off, emulate)" >&2 ;;
esac
echo "llama_bench: error: failed to create context with model 'm.gguf'" >&2
echo "["
exit 1
""")
    req = BenchRequest(Path("m.gguf"), Placement(), cache=CacheSpec("engine"))
    with pytest.raises(ToolCrashedError, match="bad value 'engine' for key 'mode'") as e:
        ToolRunner().bench(Build("patched", "cpu", bin_dir), req)
    assert " -v" in str(e.value)


def test_vulkan_memory_log_peak() -> None:
    """GGML_VK_MEMORY_LOGGER=1: ggml-vulkan logs every buffer; the device's peak is the highest "Total device"."""
    from harness.parsers.memory import vulkan_device_peak_mib

    dev = "ggml_vulkan memory: llvmpipe (LLVM 15.0.6, 256 bits)"
    log = (f"{dev}: +5.76 MiB device at 0x55d0. Total device: 5.76 MiB, total host: 0.00 B\n"
           f"{dev}: +512.00 KiB device at 0x55d1. Total device: 6.26 MiB, total host: 0.00 B\n"
           f"{dev}: -512.00 KiB device at 0x55d1. Total device: 5.76 MiB, total host: 0.00 B\n")
    assert vulkan_device_peak_mib(log) == pytest.approx(6.26)
    assert vulkan_device_peak_mib("no such lines") is None
    assert vulkan_device_peak_mib(log.replace("6.26 MiB", "1.50 GiB")) == pytest.approx(1536.0)
