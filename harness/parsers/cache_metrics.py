"""The expert cache's counters as Prometheus text: `llama_expert_cache_metrics()`
(src/llama/llama-expert-cache-api.cpp), which llama-server appends to /metrics and harness.tools.bindings reads
from a llama-cpp-python context.

Rows `llamacpp:moe_cache_<name>_total <value>` for the counters of src/include/llama-expert-counters.h (integers;
the `*_seconds` ones are times, printed with 9 decimals), and the gauges `moe_cache_slots` and
`moe_cache_bank_bytes`; with `shadow=N`, the shadow estimate's gauges `moe_cache_shadow_dppl_pct` (and `_low`,
`_high`: its 95% CI) and `moe_cache_shadow_kl_nats` (numbers), beside its counter `moe_cache_shadow_ubatches_total`.
`# HELP` / `# TYPE` lines are skipped.
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
    shadow: dict[str, float] | None = None  # "dppl_pct", "dppl_pct_low", "dppl_pct_high", "kl_nats"; None: no shadow=


def parse_cache_metrics(text: str) -> CacheMetrics:
    """Parse the text of `llama_expert_cache_metrics()`; a ParseError on a row it does not recognise."""
    counters: dict[str, int] = {}
    seconds: dict[str, float] = {}
    gauges: dict[str, int] = {}
    shadow: dict[str, float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _ROW.match(line)
        if m is None:
            raise ParseError(f"not an expert cache metric row: {line!r}", text)
        name, value = m.group(1), m.group(2)
        try:
            if name.startswith("shadow_") and not name.endswith("_total"):
                shadow[name[len("shadow_"):]] = float(value)
            elif name.endswith("_seconds_total"):
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
    return CacheMetrics(counters=counters, seconds=seconds, slots=gauges["slots"], bank_bytes=gauges["bank_bytes"],
                        shadow=shadow or None)
