"""The expert cache's counters as Prometheus text: `llama_expert_cache_metrics()`
(src/llama/llama-expert-cache-api.cpp), which llama-server appends to /metrics and harness.tools.bindings reads
from a llama-cpp-python context.

Rows `llamacpp:moe_cache_<name>_total <value>` for the counters of src/include/llama-expert-counters.h (integers;
the `*_seconds` ones are times, printed with 9 decimals), and the gauges `moe_cache_slots` and
`moe_cache_bank_bytes`. `# HELP` / `# TYPE` lines are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.parsers.base import ParseError

PREFIX = "llamacpp:moe_cache_"
_ROW = re.compile(r"^llamacpp:moe_cache_([a-z_]+) (\S+)$")


@dataclass(frozen=True)
class CacheMetrics:
    counters: dict[str, int]  # e.g. "hits", "copied_experts": the `_total` counters, named as in the stats JSON
    seconds: dict[str, float]  # "route", "copy", "copy_wait", "file_read": the `*_seconds_total` counters
    slots: int
    bank_bytes: int


def parse_cache_metrics(text: str) -> CacheMetrics:
    """Parse the text of `llama_expert_cache_metrics()`; a ParseError on a row it does not recognise."""
    counters: dict[str, int] = {}
    seconds: dict[str, float] = {}
    gauges: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _ROW.match(line)
        if m is None:
            raise ParseError(f"not an expert cache metric row: {line!r}", text)
        name, value = m.group(1), m.group(2)
        try:
            if name.endswith("_seconds_total"):
                seconds[name[: -len("_seconds_total")]] = float(value)
            elif name.endswith("_total"):
                counters[name[: -len("_total")]] = int(value)
            else:
                gauges[name] = int(value)
        except ValueError:
            raise ParseError(f"bad value in {line!r}", text) from None
    missing = [g for g in ("slots", "bank_bytes") if g not in gauges]
    if missing or not counters:
        raise ParseError(f"no expert cache metrics (missing {', '.join(missing) or 'counters'})", text)
    return CacheMetrics(counters=counters, seconds=seconds, slots=gauges["slots"], bank_bytes=gauges["bank_bytes"])
