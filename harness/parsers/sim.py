"""The output of `llama-moe-sim` (patched build): the engine's statistics JSON on stdout, and the summary line
it prints on stderr after replaying (tools/moe-sim in the patched tree)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from harness.parsers.base import ParseError
from harness.parsers.cache_stats import CacheStats, parse_cache_stats

SIM_TOOL = "llama-moe-sim"
_SUMMARY = re.compile(r"llama-moe-sim: replayed (\d+) token-layer decisions \((\d+) MoE layers\) x (\d+) "
                      r"in ([0-9.eE+-]+) s: ([0-9.eE+-]+) million decisions/s \((\d+) threads, ([0-9.eE+-]+) s CPU\)")


@dataclass(frozen=True)
class ReplaySummary:
    decisions: int  # token-layer decisions per replay
    n_moe_layers: int
    repeat: int
    seconds: float  # all replays together (wall time)
    decisions_per_s: float
    threads: int  # MoE layers are replayed in parallel
    cpu_seconds: float  # process CPU time of the replays (all threads)

    @property
    def decisions_per_cpu_s(self) -> float:
        """Decisions per second of CPU time: less sensitive than the wall-time rate to a busy machine."""
        return self.decisions * self.repeat / self.cpu_seconds if self.cpu_seconds > 0 else float("inf")


def parse_sim_summary(stderr: str) -> ReplaySummary:
    """The line llama-moe-sim prints on stderr after replaying."""
    found = list(_SUMMARY.finditer(stderr))
    if not found:
        raise ParseError("no 'replayed ... decisions' line", stderr, source=SIM_TOOL)
    m = found[-1]
    return ReplaySummary(int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5]) * 1e6, int(m[6]), float(m[7]))


@dataclass(frozen=True)
class SimRun:
    spec: str
    stats: CacheStats
    doc: dict[str, Any]  # the statistics JSON (schema moe-subst/expert-cache-stats)
    summary: ReplaySummary | None


def parse_sim_output(spec: str, stdout: str, stderr: str) -> SimRun:
    stats = parse_cache_stats(stdout)
    doc: dict[str, Any] = json.loads(stdout)
    try:
        summary: ReplaySummary | None = parse_sim_summary(stderr)
    except ParseError:
        summary = None
    return SimRun(spec, stats, doc, summary)
