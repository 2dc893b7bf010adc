"""parse_cache_stats on a document in the format of docs/expert-cache.md (schema moe-subst/expert-cache-stats,
version 1). Synthetic: assembled field by field from write_stats in the patched tree, until a patched build
is there to capture one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.parsers import ParseError
from harness.parsers.cache_stats import CacheStats, parse_cache_stats


def _counters(**over: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"calls": 8000, "hits": 6000, "misses": 2000, "fetches": 1400, "substitutions": 600,
                         "drops": 0, "host_computes": 0, "skips": 0, "admissions": 30, "evictions": 1430,
                         "subst_first_choice": 0,
                         "forced_substitutions": 0, "token_layers": 2000, "token_layers_with_subst": 500,
                         "ram_tier_loads": 0, "file_loads": 0,
                         "prefetches": 0, "prefetch_used": 0, "prefetch_wasted": 0, "prefetch_dropped": 0,
                         "max_subst_weight": 0.149, "subst_mass_sum": 40.0, "tokens": 1000,
                         "substituted_mass": 0.02, "fetches_per_token": 1.4, "drop_mass_sum": 0.0, "hit_rate": 0.75,
                         "miss_rate": 0.25, "substitution_rate": 0.075, "mass_hist": [1500, 400] + [0] * 18}
    c.update(over)
    return c


def _doc(**over: Any) -> str:
    d = {"schema": "moe-subst/expert-cache-stats", "schema_version": 1,
         "config": {"spec": "mode=emulate,policy=quality,slots=16", "mode": "emulate", "policy": "quality",
                    "rule": "threshold", "tau": 0.15, "evict": "lfu", "admit": True, "beta": 0.5, "lfu_halve": 1024,
                    "slots": 16, "n_expert": 64, "n_expert_used": 4, "profile": ""},
         "mass_hist_edges": [i / 20 for i in range(21)], "route_ns": 123456, "route_ns_per_token_layer": 61.7,
         "total": _counters(), "layers": [{"layer": 0, **_counters()}, {"layer": 1, **_counters()}]}
    d.update(over)
    return json.dumps(d, indent=2)


def test_documented_document() -> None:
    s = parse_cache_stats(_doc())
    assert (s.substitution_rate, s.substituted_mass, s.fetches_per_token, s.hit_rate) == (0.075, 0.02, 1.4, 0.75)
    assert (s.calls, s.substitutions, s.fetches, s.admissions, s.tokens) == (8000, 600, 1400, 30, 1000)
    assert s.policy == "quality" and '"layers"' in s.raw
    back = CacheStats.from_dict(s.as_dict())
    assert back.as_dict() == s.as_dict()


def test_rejects_what_is_not_these_statistics() -> None:
    with pytest.raises(ParseError, match="not JSON"):
        parse_cache_stats("substitution_rate=0.1")
    with pytest.raises(ParseError, match="not a moe-subst/expert-cache-stats"):
        parse_cache_stats('{"substitution_rate": 0.1}')
    with pytest.raises(ParseError, match="schema_version 2"):
        parse_cache_stats(_doc(schema_version=2))
    with pytest.raises(ParseError, match="no 'total'"):
        parse_cache_stats(_doc(total=[]))
    with pytest.raises(ParseError, match="total.substituted_mass is nan"):
        parse_cache_stats(_doc(total=_counters(substituted_mass=float("nan"))))
    with pytest.raises(ParseError, match="total.calls is -1"):
        parse_cache_stats(_doc(total=_counters(calls=-1)))


def test_captured_document_of_the_patched_build() -> None:
    # written by the patched CPU build: `harness compare --vram 50% --policies quality` on the generated qwen3moe
    # model (tests/data/README.md)
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "data" / "patched-cpu" / "cache-stats-quality.json"
    s = parse_cache_stats(path.read_text())
    assert s.policy == "quality"
    assert (s.calls, s.substitutions, s.fetches, s.admissions, s.tokens) == (6144, 888, 917, 12, 768)
    assert s.substitution_rate == pytest.approx(888 / 6144)
    assert s.fetches_per_token == pytest.approx(917 / 768)
    assert s.substituted_mass == pytest.approx(0.04606477478944271)
    assert s.subst_first_choice == 0  # the 0.15 rule always fetches a missed first choice
