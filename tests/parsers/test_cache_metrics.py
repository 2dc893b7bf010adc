"""harness.parsers.cache_metrics on the captured text of llama_expert_cache_metrics() (tests/data/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.parsers import ParseError
from harness.parsers.cache_metrics import parse_cache_metrics
from harness.parsers.cache_stats import ENGINE_COUNTERS, POLICY_COUNTERS

DATA = Path(__file__).resolve().parents[1] / "data" / "patched-cpu"


def test_parse_captured_engine_metrics() -> None:
    m = parse_cache_metrics((DATA / "cache-metrics-engine.txt").read_text())
    # every counter of src/include/llama-expert-counters.h: times under `seconds`, the rest under `counters`
    counts = [c for c in ENGINE_COUNTERS if not c.endswith("_ns")]
    assert set(m.counters) == {*POLICY_COUNTERS, *counts, "bypass_token_layers"}
    assert set(m.seconds) == {"route", "copy", "copy_wait", "fetch_wait", "file_read", "prefetch_wait"}
    assert m.counters["calls"] == 864 and m.counters["hits"] + m.counters["misses"] == 864
    assert m.counters["copied_experts"] == 52 and m.counters["copy_bytes"] == 7667712
    assert m.seconds["route"] == pytest.approx(0.00157997)
    assert m.slots == 16 and m.bank_bytes == 10027008


@pytest.mark.parametrize(("text", "what"), [
    ("", "no expert cache metrics"),
    ("llamacpp:moe_cache_slots 16\nllamacpp:moe_cache_bank_bytes 0\n", "missing counters"),
    ("llamacpp:moe_cache_calls_total 3\nllamacpp:moe_cache_slots 16\n", "missing bank_bytes"),
    ("llamacpp:moe_cache_calls_total x\n", "bad value"),
    ("llamacpp:prompt_tokens_total 3\n", "not an expert cache metric row"),
])
def test_parse_errors(text: str, what: str) -> None:
    with pytest.raises(ParseError, match=what):
        parse_cache_metrics(text)
