"""The expert cache's counters are one table (src/include/llama-expert-counters.h) that generates the C++
statistics structs, the statistics JSON, the C API's counters and the server's /metrics rows; the harness's
parser requires the same counters. This keeps the two sides equal."""

from __future__ import annotations

import re

import pytest

from harness.core import project
from harness.parsers import ParseError
from harness.parsers.cache_stats import ENGINE_COUNTERS, POLICY_COUNTERS, parse_cache_stats

TABLE = project.project_root() / "src" / "include" / "llama-expert-counters.h"


def _table(name: str) -> list[tuple[str, str]]:
    text = TABLE.read_text()
    m = re.search(rf"#define {name}\(X\)((?:[^\n]*\\\n)*[^\n]*\n)", text)
    assert m, f"{name} not found in {TABLE}"
    return re.findall(r"X\((\w+),\s*(\w+),", m.group(1))


def test_parser_knows_the_engine_counters() -> None:
    assert tuple(f for f, _ in _table("LLAMA_EXPERT_POLICY_COUNTERS")) == POLICY_COUNTERS
    assert tuple(f for f, _ in _table("LLAMA_EXPERT_ENGINE_COUNTERS")) == ENGINE_COUNTERS


def test_metric_names_are_unique_and_time_is_seconds() -> None:
    rows = [r for t in ("LLAMA_EXPERT_POLICY_COUNTERS", "LLAMA_EXPERT_ENGINE_COUNTERS", "LLAMA_EXPERT_ROUTE_COUNTERS")
            for r in _table(t)]
    assert len({m for _, m in rows}) == len(rows)
    for field, metric in rows:
        assert field.endswith("_ns") == metric.endswith("_seconds"), (field, metric)


def test_captured_statistics_carry_every_counter() -> None:
    path = project.project_root() / "tests" / "data" / "patched-cpu" / "cache-stats-quality.json"
    parse_cache_stats(path.read_text())  # raises when a counter of the table is missing
    text = path.read_text().replace('"forced_substitutions"', '"forced_substitutionz"')
    with pytest.raises(ParseError, match="lacks the counters forced_substitutions"):
        parse_cache_stats(text)
