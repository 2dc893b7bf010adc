"""Runners: the only layer that starts processes. Each runs one built llama.cpp tool and returns its raw
output together with the parsed result; what they are asked and what they return are the value types of
harness.tools.requests.

A tool that exits non-zero raises `ToolCrashedError` showing its last lines; one that runs past its
timeout is killed and raises `ToolTimeoutError`. Ctrl-C kills the child and propagates.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.files import check_cache_paths, refuse_special
from harness.core.project import Build, with_log_drain
from harness.core.sizes import format_bytes
from harness.parsers import (
    MemoryBreakdown,
    ParseError,
    parse_bench_json,
    parse_memory_breakdown,
    parse_perplexity,
    tail,
)
from harness.parsers.cache_stats import CacheStats, parse_cache_stats
from harness.parsers.memory import vulkan_device_peak_mib
from harness.parsers.nll_dump import NllDump, read_nll_dump_file
from harness.tools.cgroup import MemoryCgroup, PeakMeter, drop_page_cache
from harness.tools.requests import (
    CACHE_ENV_VAR,
    BenchRequest,
    BenchRun,
    CacheSpec,
    PerplexityRequest,
    PerplexityRun,
    RunOutput,
)


class ToolCrashedError(HarnessError):
    exit_code = 4


class ToolTimeoutError(HarnessError):
    exit_code = 4


def vulkan_device(build: Build, env: Mapping[str, str]) -> str:
    """The first Vulkan device a Vulkan build sees (`--list-devices`, with `env` added), e.g. "Vulkan0: llvmpipe
    (LLVM 15.0.6, 256 bits)"; a one-line HarnessError when it sees none."""
    import re

    try:
        out = subprocess.run([str(build.tool("llama-perplexity")), "--list-devices"], capture_output=True, text=True,
                             timeout=120, check=False, env={**os.environ, **env})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HarnessError(f"cannot list the devices of the Vulkan build: {e}") from None
    m = re.search(r"^\s*(Vulkan0: .*?) \(\d+ MiB, \d+ MiB free\)", out.stdout + out.stderr, re.M)
    if m is None:
        raise HarnessError("the Vulkan build sees no Vulkan device (a device of type CPU, such as Mesa's lavapipe, "
                           "only with GGML_VK_VISIBLE_DEVICES=0; lavapipe: apt-get install mesa-vulkan-drivers)")
    return m[1]


def gpu_name() -> str:
    """The first NVIDIA GPU's name from nvidia-smi, or "none"."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return "none"
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    names = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return names[0] if out.returncode == 0 and names else "none"


def threads_without_oversubscription(n_cpus: int, load: float) -> int:
    """Threads a run can use without oversubscribing the machine: the CPUs this process may run on less the
    ones already busy (the 1-minute load average, rounded), at least 1."""
    return max(1, n_cpus - round(max(load, 0.0)))


def default_threads() -> tuple[int, str]:
    """threads_without_oversubscription() of this machine now, and how it was found (for the user)."""
    n_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = threads_without_oversubscription(n_cpus, load)
    return n, f"{n_cpus} CPUs available to this process, 1-minute load average {load:.1f}"


def _gpu_used_mib(exe: str) -> float | None:
    try:
        out = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10, check=False)
        return float(out.stdout.strip().splitlines()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


class GpuMemorySampler:
    """Polls nvidia-smi (GPU 0) while a tool runs; `peak_mib` is the highest use above the level found at
    start. Inactive (peak None) without nvidia-smi."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self._exe = shutil.which("nvidia-smi")
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base: float | None = None
        self._peak: float | None = None

    def __enter__(self) -> GpuMemorySampler:
        if self._exe:
            self._base = _gpu_used_mib(self._exe)
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        assert self._exe
        while not self._stop.is_set():
            v = _gpu_used_mib(self._exe)
            if v is not None:
                self._peak = v if self._peak is None else max(self._peak, v)
            self._stop.wait(self._interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    @property
    def peak_mib(self) -> float | None:
        if self._peak is None or self._base is None:
            return None
        return max(0.0, self._peak - self._base)


def run_tool(tool: Path, args: Sequence[str], *, env: Mapping[str, str] | None = None,
             timeout_s: float = 3600, cwd: Path | None = None, sample_gpu: bool = True,
             cgroup: MemoryCgroup | None = None, uncached: Path | None = None) -> RunOutput:
    """Run `tool args...` with `env` added to the environment; raise on a crash or a timeout. With `cgroup` the
    tool runs inside that memory cgroup and the output has its peak; `uncached` (the model) is dropped from the
    page cache first, so that no run inherits another's cache."""
    argv = (str(tool), *args)
    check_tool_paths(tool, args, env or {})
    full_env = dict(os.environ)
    full_env.pop(CACHE_ENV_VAR, None)  # only what the caller asks for reaches the tool
    full_env.update(env or {})
    with_log_drain(full_env)
    if uncached is not None:
        drop_page_cache(uncached)
    with cgroup.measure() if cgroup is not None else _no_meter() as meter:
        out = _run(tool, argv, env, full_env, timeout_s, cwd, sample_gpu, cgroup)
    if cgroup is None:
        return out
    return replace(out, peak_ram_bytes=meter.peak, ram_limit_bytes=cgroup.limit, peak_ram_source=meter.source)


# The path arguments of the llama.cpp tools the harness starts (and llama-moe-sim's), named for the user.
TOOL_PATH_FLAGS = {"-m": "the model", "--model": "the model", "-f": "the text", "--file": "the text",
                   "--nll-dump": "--nll-dump", "--trace": "--trace", "--stats": "--stats"}


def check_tool_paths(tool: Path, args: Sequence[str], env: Mapping[str, str]) -> None:
    """Before a tool starts: a FIFO, device, socket or folder given as one of its file paths (TOOL_PATH_FLAGS, the
    cache spec's stats=/trace=/profile=/profile_out= in CACHE_ENV_VAR or llama-moe-sim's --spec) is one line of
    HarnessError, not a tool that blocks forever in open()."""
    if tool.name.startswith("llama-"):
        for flag, value in zip(args, args[1:], strict=False):
            if flag in TOOL_PATH_FLAGS:
                refuse_special(value, TOOL_PATH_FLAGS[flag])
            elif flag == "--spec":
                check_cache_paths(spec_items(value))
    if CACHE_ENV_VAR in env:
        check_cache_paths(spec_items(env[CACHE_ENV_VAR]))


def spec_items(spec: str) -> list[tuple[str, str]]:
    """A cache spec string's key=value items, as the engine splits them (on ',' then the first '=')."""
    return [(k.strip(), v.strip()) for k, _, v in (item.partition("=") for item in spec.split(",")) if k.strip()]


@contextmanager
def _no_meter() -> Iterator[PeakMeter]:
    yield PeakMeter()


def _run(tool: Path, argv: tuple[str, ...], env: Mapping[str, str] | None, full_env: dict[str, str], timeout_s: float,
         cwd: Path | None, sample_gpu: bool, cgroup: MemoryCgroup | None) -> RunOutput:
    t0 = time.monotonic()
    sampler = GpuMemorySampler() if sample_gpu else None
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", env=full_env, cwd=cwd, stdin=subprocess.DEVNULL,
                                preexec_fn=cgroup.preexec if cgroup is not None else None)
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolCrashedError(f"cannot start {tool}: {e}") from None
    try:
        if sampler is not None:
            sampler.__enter__()
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise ToolTimeoutError(f"{tool.name} ran past its timeout of {timeout_s:g} s and was stopped; "
                               f"last lines:\n{tail(stdout + chr(10) + stderr)}") from None
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if sampler is not None:
            sampler.__exit__()
    wall = time.monotonic() - t0
    peak, source = sampler.peak_mib if sampler is not None else None, "nvidia-smi"
    if peak is None and (vk := vulkan_device_peak_mib(stderr)) is not None:
        peak, source = vk, "ggml-vulkan memory log"  # a Vulkan build run with GGML_VK_MEMORY_LOGGER=1
    out = RunOutput(argv, dict(env or {}), proc.returncode, stdout, stderr, wall, peak, peak_gpu_source=source)
    if proc.returncode != 0:
        how = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"exited with {proc.returncode}")
        envs = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        if cgroup is not None and proc.returncode == -9:
            how += (f" (the memory cgroup's OOM killer? its limit is {format_bytes(cgroup.limit)}, page cache "
                    "counted: give a larger --ram)")
        raise ToolCrashedError(f"{tool.name} {how}\n  command: {envs + ' ' if envs else ''}{' '.join(argv)}\n"
                               f"  last lines:\n{tail(stdout + chr(10) + stderr)}")
    return out


def bench_args(req: BenchRequest) -> list[str]:
    args = ["-m", str(req.model), "-o", "json", "-r", str(req.repetitions),
            "-ngl", str(req.placement.n_gpu_layers), "-ncmoe", str(req.placement.n_cpu_moe)]
    tests = []
    if req.n_prompt:
        tests += ["-p", str(req.n_prompt)]
    else:
        tests += ["-p", "0"]
    tests += ["-n", str(req.n_gen)]
    args += tests
    if req.threads:
        args += ["-t", str(req.threads)]
    return args + list(req.extra_args)


def perplexity_args(req: PerplexityRequest) -> list[str]:
    args = ["-m", str(req.model), "-f", str(req.text), "-c", str(req.n_ctx), "-b", str(req.n_batch),
            "-ngl", str(req.placement.n_gpu_layers), "--n-cpu-moe", str(req.placement.n_cpu_moe),
            "--fit", "off", "-lv", "4"]
    if req.chunks:
        args += ["--chunks", str(req.chunks)]
    if req.threads:
        args += ["-t", str(req.threads)]
    if req.nll_dump is not None:
        args += ["--nll-dump", str(req.nll_dump)]
    return args + list(req.extra_args)


def _cache_env(cache: CacheSpec | None) -> dict[str, str]:
    return {CACHE_ENV_VAR: cache.render()} if cache is not None else {}


class ToolRunner:
    """Runs the real binaries of a build.

    llama-perplexity logs through an asynchronous queue that upstream does not flush at exit
    (common/log.cpp, `common_log_main`), so a run that exits 0 sometimes lacks its last lines (the final
    estimate, the memory breakdown); such a run is repeated, up to `attempts` times in all. Measured on
    this project's machines: the stock build lost its final line in 9 of 20 short runs; the patched build
    drains the log at exit (patch "log: drain the log queue at exit") and lost none of 20."""

    def __init__(self, timeout_s: float = 3600, attempts: int = 12, extra_env: Mapping[str, str] | None = None) -> None:
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.extra_env = dict(extra_env or {})  # set for every tool (e.g. the Vulkan builds' device and memory log)

    def _env(self, cache: CacheSpec | None) -> dict[str, str]:
        return {**self.extra_env, **_cache_env(cache)}

    def bench(self, build: Build, req: BenchRequest) -> BenchRun:
        if req.cache is not None and build.name != "patched":
            raise HarnessError(f"a cache configuration needs the patched build, not {build.name}")
        try:
            out = run_tool(build.tool("llama-bench"), bench_args(req), env=self._env(req.cache),
                           timeout_s=self.timeout_s, cgroup=req.cgroup,
                           uncached=req.model if req.cgroup is not None else None)
        except ToolCrashedError as e:
            # llama-bench hides libllama's log unless -v: repeat a failed context creation verbosely, so the
            # error names its cause (such as a cache spec the build rejects)
            if "failed to create context" not in str(e) or "-v" in req.extra_args:
                raise
            run_tool(build.tool("llama-bench"), [*bench_args(req), "-v"], env=self._env(req.cache),
                     timeout_s=self.timeout_s, cgroup=req.cgroup)
            raise
        try:
            results = parse_bench_json(out.stdout)
        except ParseError as e:
            raise ParseError(e.what, out.text, source="llama-bench") from None
        try:
            stats = _read_cache_stats(req.cache)
        except ParseError:
            stats = None  # the speed figures stand without them
        return BenchRun(tuple(results), out, stats)

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        if (req.cache is not None or req.nll_dump is not None) and build.name != "patched":
            raise HarnessError("a cache configuration or an NLL dump needs the patched build, "
                               f"not {build.name}")
        for attempt in range(1, self.attempts + 1):
            out = run_tool(build.tool("llama-perplexity"), perplexity_args(req), env=self._env(req.cache),
                           timeout_s=self.timeout_s, cgroup=req.cgroup,
                           uncached=req.model if req.cgroup is not None else None)
            try:
                result = parse_perplexity(out.text)
                memory: MemoryBreakdown | None = parse_memory_breakdown(out.stderr)
            except ParseError as e:
                if attempt < self.attempts and output_was_cut(out.text):
                    continue
                if "memory breakdown" not in e.what:
                    raise
                memory = None
            return PerplexityRun(result, memory, out, _read_cache_stats(req.cache), attempt)
        raise AssertionError("unreachable")

    def load_nll(self, path: Path) -> NllDump:
        if not path.is_file():
            raise HarnessError(f"the NLL dump {path} is missing: delete its record from results.jsonl to redo the run")
        return read_nll_dump_file(path)


def output_was_cut(text: str) -> bool:
    """Did a llama-perplexity run that exited 0 lose the end of its output? (The memory breakdown, printed
    at -lv 4, is the last thing it logs.)"""
    return "common_memory_breakdown_print: " not in text and "you need at least" not in text


def _read_cache_stats(cache: CacheSpec | None) -> CacheStats | None:
    """The statistics the cache wrote at exit, when the spec asked for them (None when it wrote none)."""
    if cache is None or cache.stats is None or cache.mode == "off":
        return None
    path = Path(cache.stats)
    if not path.is_file():
        return None
    return parse_cache_stats(path.read_text())
