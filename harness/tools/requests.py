"""What a run of a built llama.cpp tool is asked (the requests, the cache spec, where weights go) and what it
returns: value types only, imported by the domain layer and the commands. Pure: this module starts no process
(harness.tools.runners does; tests/test_layers.py checks that the domain layer imports no module that does).

The expert cache of the patched build is configured by the environment variable `CACHE_ENV_VAR`, whose value
`CacheSpec.render()` writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.parsers import BenchResult, MemoryBreakdown, PerplexityResult
from harness.parsers.cache_stats import CacheStats
from harness.parsers.nll_dump import NllDump

if TYPE_CHECKING:  # a request names its memory cgroup; the cgroup's code (signals, processes) is the runners'
    from harness.tools.cgroup import MemoryCgroup

CACHE_ENV_VAR = "LLAMA_MOE_CACHE"  # docs/expert-cache.md
CACHE_MODES = ("off", "emulate", "engine")  # engine: part 2 of the cache, not in every patched build yet


@dataclass(frozen=True)
class CacheSpec:
    """The patched build's cache configuration, rendered as `key=value,...` for CACHE_ENV_VAR.

    `slots` is a count per MoE layer (int) or a string as the user typed it ("25%")."""

    mode: str
    policy: str | None = None
    slots: int | str | None = None
    stats: str | None = None
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise HarnessError(f"unknown cache mode {self.mode!r}: use one of {', '.join(CACHE_MODES)}")
        for k, v in self.items():
            if any(c in f"{k}{v}" for c in ",=") and k != "stats":
                raise HarnessError(f"cache spec value {k}={v!r} may not contain ',' or '='")
        if self.stats is not None and "," in self.stats:
            raise HarnessError(f"the cache stats path may not contain ',': {self.stats}")

    def items(self) -> list[tuple[str, str]]:
        out = [("mode", self.mode)]
        if self.policy is not None:
            out.append(("policy", self.policy))
        if self.slots is not None:
            out.append(("slots", str(self.slots)))
        if self.stats is not None:
            out.append(("stats", self.stats))
        out.extend(self.extra)
        return out

    def render(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.items())


@dataclass(frozen=True)
class RunOutput:
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the variables set on top of the inherited environment
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_gpu_mib: float | None = None  # nvidia-smi, device-wide, minus the level before the run; or ggml-vulkan's log
    peak_ram_bytes: int | None = None  # the memory cgroup's peak (page cache counted), when run inside one
    ram_limit_bytes: int | None = None  # that cgroup's limit
    peak_ram_source: str = ""  # e.g. "cgroup v1 memory.max_usage_in_bytes"
    peak_gpu_source: str = "nvidia-smi"  # or "ggml-vulkan memory log" (GGML_VK_MEMORY_LOGGER=1)

    @property
    def text(self) -> str:
        return self.stdout + "\n" + self.stderr


@dataclass(frozen=True)
class Placement:
    """Where weights go: all layers offloaded (-ngl), experts of the first `n_cpu_moe` layers on the CPU."""

    n_gpu_layers: int = 999
    n_cpu_moe: int = 0


@dataclass(frozen=True)
class BenchRequest:
    model: Path
    placement: Placement
    n_prompt: int = 512
    n_gen: int = 128
    repetitions: int = 1
    threads: int | None = None
    cache: CacheSpec | None = None
    extra_args: tuple[str, ...] = ()
    label: str = ""  # the configuration's name in reports
    cgroup: MemoryCgroup | None = None  # run inside this memory cgroup (compare --ram), the model uncached first


@dataclass(frozen=True)
class PerplexityRequest:
    model: Path
    text: Path
    placement: Placement
    n_ctx: int = 512
    n_batch: int = 512
    chunks: int | None = None
    threads: int | None = None
    cache: CacheSpec | None = None
    nll_dump: Path | None = None
    extra_args: tuple[str, ...] = ()
    label: str = ""
    cgroup: MemoryCgroup | None = None  # as BenchRequest.cgroup


@dataclass(frozen=True)
class BenchRun:
    results: tuple[BenchResult, ...]
    output: RunOutput
    cache_stats: CacheStats | None = None  # what the cache wrote at exit (its last context's), when asked for


@dataclass(frozen=True)
class PerplexityRun:
    result: PerplexityResult
    memory: MemoryBreakdown | None
    output: RunOutput
    cache_stats: CacheStats | None = None
    attempts: int = 1


class Runner(Protocol):
    """What orchestration needs; `ToolRunner` is the real one, tests pass a fake."""

    def bench(self, build: Build, req: BenchRequest) -> BenchRun: ...

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun: ...

    def load_nll(self, path: Path) -> NllDump: ...
