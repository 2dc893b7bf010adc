"""parse_cache_plan on captured runs of the patched CPU build (tests/data/README.md): vram= and ram= in
llama-perplexity, ram= in llama-bench (a context per test, so a plan per test), a budget too small (no plan)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.parsers import ParseError
from harness.parsers.cache_plan import CachePlan, parse_cache_plan, parse_cache_plans

DATA = Path(__file__).resolve().parent.parent / "data" / "patched-cpu"
MiB = 2**20
TINYMOE = {"per_slot": 589824, "banks": 12, "n_expert": 64, "k": 8}  # 4 MoE layers x 3 tensors x 49152 B


def test_vram_plan() -> None:
    p = parse_cache_plan((DATA / "cache-plan-vram.stderr").read_text())
    assert p == CachePlan(key="vram", budget=24 * MiB, weights=0, context=524288, reserve=0, slots=40, **TINYMOE)
    # the engine's formula (harness.domain.plan.BudgetTerms): budget - fixed, in whole slots
    fixed = p.weights + p.context + p.reserve + p.per_slot + 512 * p.banks
    assert p.slots == min(p.n_expert, (p.budget - fixed) // p.per_slot)


def test_ram_plan() -> None:
    # weights: the whole process's (the mapped file, 41.76 MiB, and 5.50 MiB that this machine's AMX buffer type
    # repacked: the capture ran without --no-repack) less the 36 MiB of routed experts, which stay in the file
    p = parse_cache_plan((DATA / "cache-plan-ram.stderr").read_text())
    assert p == CachePlan(key="ram", budget=24 * MiB, weights=11807744, context=524288, reserve=0, slots=20,
                          **TINYMOE)


def test_bench_logs_a_plan_per_context() -> None:
    """llama-bench -p 512 -n 16 makes a context per test: under ram= each gets slots of its own (19 for the prompt
    test's larger KV cache, 20 for the generation test), which is why compare --ram gives every run the plan's
    slots instead of ram=."""
    plans = parse_cache_plans((DATA / "cache-plan-bench-ram.stderr").read_text())
    assert [(p.key, p.context, p.slots) for p in plans] == [("ram", 1048576, 19), ("ram", 524288, 20)]
    assert parse_cache_plan((DATA / "cache-plan-bench-ram.stderr").read_text()) == plans[0]


def test_no_plan_is_a_parse_error_with_the_tail() -> None:
    text = (DATA / "cache-plan-too-small.stderr").read_text()
    assert parse_cache_plans(text) == ()
    with pytest.raises(ParseError, match="no expert cache plan line") as e:
        parse_cache_plan(text)
    assert "is too small" in str(e.value)  # the tail of the output says why


@pytest.mark.parametrize("line", [
    "f: expert cache plan: vram=1 weights=2 context=3 reserve=4 per_slot=5 banks=6 n_expert=7 k=8",  # no slots
    "f: expert cache plan: gpu=1 weights=2 context=3 reserve=4 per_slot=5 banks=6 n_expert=7 k=8 slots=9",
    "f: expert cache plan: vram=-1 weights=2 context=3 reserve=4 per_slot=5 banks=6 n_expert=7 k=8 slots=9",
    "f: expert cache plan: vram=1 weights=2 context=3 reserve=4 per_slot=5 banks=6 n_expert=7 k=8 slots=9 x=1",
])
def test_a_damaged_plan_line_is_a_parse_error(line: str) -> None:
    text = (DATA / "cache-plan-ram.stderr").read_text().replace(
        next(ln for ln in (DATA / "cache-plan-ram.stderr").read_text().splitlines() if "expert cache plan" in ln),
        line)
    with pytest.raises(ParseError, match="unrecognised expert cache plan line"):
        parse_cache_plans(text)
