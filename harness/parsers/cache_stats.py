"""The expert cache's statistics JSON (patched build, `stats=PATH` in the cache spec).

Schema `moe-subst/expert-cache-stats`, `schema_version` 1, as docs/expert-cache.md defines it: counters
for all MoE layers together under "total" (and per layer under "layers", kept in `raw`). Written by
`llama_expert_cache::write_stats` (src/llama/llama-expert-cache.cpp), whose counters come from one table
(src/include/llama-expert-counters.h): the parser requires every counter of it (tests/test_stats_schema.py
keeps POLICY_COUNTERS and ENGINE_COUNTERS equal to that table).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from harness.parsers.base import ParseError

SCHEMA = "moe-subst/expert-cache-stats"
SCHEMA_VERSION = 1
# the counter table of src/include/llama-expert-counters.h, in its order
POLICY_COUNTERS = ("calls", "hits", "misses", "fetches", "substitutions", "drops", "host_computes", "skips",
                   "admissions", "evictions", "subst_first_choice", "forced_substitutions", "token_layers",
                   "token_layers_with_subst", "ram_tier_loads", "file_loads", "prefetches", "prefetch_used",
                   "prefetch_wasted", "prefetch_dropped")
ENGINE_COUNTERS = ("copied_experts", "copies", "copy_bytes", "copy_ns", "background_experts", "deferred_experts",
                   "wait_ns", "fetch_wait_ns", "file_reads", "file_read_bytes", "file_read_ns", "pack_reads",
                   "pack_read_bytes", "prefetch_bytes", "prefetch_wasted_bytes", "prefetch_cancelled", "prefetch_late",
                   "prefetch_waits", "prefetch_wait_ns")
_RATES = ("substitution_rate", "substituted_mass", "fetches_per_token", "hit_rate")
_COUNTS = ("calls", "substitutions", "subst_first_choice", "fetches", "admissions", "tokens", "host_computes")


_SHADOW_FIELDS = ("every", "ubatches", "rows", "pairs", "kl", "kl_low", "kl_high", "dnll", "dnll_low", "dnll_high",
                  "dppl_pct", "dppl_pct_low", "dppl_pct_high", "shadow_ms")


@dataclass(frozen=True)
class ShadowEstimate:
    """The cache's measured cost (`shadow=N`, docs/expert-cache.md "The shadow estimate"): every N ubatches one was
    computed exactly too; KL(exact || served) per output row and the NLL difference on the actual next token, each a
    mean over the shadowed ubatches with a 95% t interval; `dppl_pct` = 100 (exp(dnll) - 1) and its interval."""

    every: int
    ubatches: int
    rows: int
    pairs: int
    kl: float
    kl_low: float
    kl_high: float
    dnll: float
    dnll_low: float
    dnll_high: float
    dppl_pct: float
    dppl_pct_low: float
    dppl_pct_high: float
    shadow_ms: float

    @staticmethod
    def parse(obj: Any, text: str) -> ShadowEstimate:
        if not isinstance(obj, dict):
            raise ParseError(f"the cache statistics' shadow is {obj!r}", text, source="the expert cache")
        vals: dict[str, Any] = {}
        for k in _SHADOW_FIELDS:
            v = obj.get(k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ParseError(f"the cache statistic shadow.{k} is {v!r}", text, source="the expert cache")
            vals[k] = v
        i = {k: int(vals[k]) for k in ("every", "ubatches", "rows", "pairs")}
        f = {k: float(vals[k]) for k in _SHADOW_FIELDS if k not in i}
        return ShadowEstimate(i["every"], i["ubatches"], i["rows"], i["pairs"], f["kl"], f["kl_low"], f["kl_high"],
                              f["dnll"], f["dnll_low"], f["dnll_high"], f["dppl_pct"], f["dppl_pct_low"],
                              f["dppl_pct_high"], f["shadow_ms"])


@dataclass(frozen=True)
class CacheStats:
    substitution_rate: float | None  # substituted expert calls / all expert calls
    substituted_mass: float | None  # mean substituted gate mass per token-layer
    fetches_per_token: float | None
    raw: str  # the JSON document as written by the engine
    hit_rate: float | None = None
    calls: int | None = None
    substitutions: int | None = None
    subst_first_choice: int | None = None
    fetches: int | None = None
    admissions: int | None = None
    tokens: int | None = None
    policy: str = ""  # the preset name, or "custom"
    host_computes: int | None = None  # misses computed on the host (light=host)
    shadow: ShadowEstimate | None = None  # shadow=N: the measured cost; None without it

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (*_RATES, *_COUNTS, "policy")}
        if self.shadow is not None:
            d["shadow"] = asdict(self.shadow)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> CacheStats:
        """The inverse of `as_dict` (for records read back from results.jsonl)."""
        shadow = ShadowEstimate(**d["shadow"]) if isinstance(d.get("shadow"), dict) else None
        return CacheStats(d.get("substitution_rate"), d.get("substituted_mass"), d.get("fetches_per_token"), "",
                          **{k: d.get(k) for k in ("hit_rate", *_COUNTS)}, policy=str(d.get("policy", "")),
                          shadow=shadow)

    def host_computes_per_token(self) -> float:
        """Misses computed on the host per token (0 for records of builds without the counter)."""
        return (self.host_computes or 0) / self.tokens if self.tokens else 0.0


def parse_cache_stats(text: str) -> CacheStats:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ParseError(f"the cache statistics are not JSON ({e})", text, source="the expert cache") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ParseError(f"not a {SCHEMA} document", text, source="the expert cache")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ParseError(f"{SCHEMA} schema_version {doc.get('schema_version')!r}; this harness reads "
                         f"{SCHEMA_VERSION}", text, source="the expert cache")
    total = doc.get("total")
    if not isinstance(total, dict):
        raise ParseError("the cache statistics have no 'total' object", text, source="the expert cache")
    rates: dict[str, float] = {}
    for k in _RATES:
        v = total.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ParseError(f"the cache statistic total.{k} is {v!r}", text, source="the expert cache")
        rates[k] = float(v)
    counts: dict[str, int] = {}
    for k in _COUNTS:
        v = total.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ParseError(f"the cache counter total.{k} is {v!r}", text, source="the expert cache")
        counts[k] = v
    for where, obj, keys in (("total", total, POLICY_COUNTERS), ("engine", doc.get("engine"), ENGINE_COUNTERS)):
        if obj is None and where == "engine":
            continue  # emulate mode has no engine object
        missing = [k for k in keys if not isinstance(obj, dict) or not isinstance(obj.get(k), int) or obj[k] < 0]
        if missing:
            raise ParseError(f"the cache statistics' {where} object lacks the counters {', '.join(missing)} "
                             "(a build older or newer than this harness?)", text, source="the expert cache")
    config = doc.get("config")
    policy = str(config.get("policy", "")) if isinstance(config, dict) else ""
    shadow = ShadowEstimate.parse(doc["shadow"], text) if "shadow" in doc else None
    return CacheStats(rates["substitution_rate"], rates["substituted_mass"], rates["fetches_per_token"], text,
                      rates["hit_rate"], policy=policy, shadow=shadow, **counts)
