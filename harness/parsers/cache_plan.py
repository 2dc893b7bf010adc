"""The expert cache's budget plan, which the patched build logs when `vram=` or `ram=` sizes its banks
(src/llama, `llama_expert_engine_slots_for_budget`), in exact bytes, at info level (`-lv 4`; llama-bench: `-v`):
    <func>: expert cache plan: vram=<n> weights=<n> context=<n> reserve=<n> readers=<n> baseline=<n> per_slot=<n>
        banks=<n> n_expert=<n> k=<n> slots=<n>        (one line)
from the format `"%s: expert cache plan: %s=%llu weights=%llu context=%llu reserve=%llu readers=%llu baseline=%llu
per_slot=%llu banks=%llu n_expert=%d k=%d slots=%d\\n"` (`ram=` in place of `vram=` for a RAM budget; builds before
the machine check printed no readers= and baseline=, read as 0). The terms are harness.domain.plan's `BudgetTerms`
(fixed = weights + context + reserve + readers + baseline + one spare slot + 512 bytes per bank; slots =
min(n_expert, (budget - fixed) // per_slot)); the tests hold the two formulas equal through this parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.parsers.base import ParseError

MARK = "expert cache plan: "
_FIELDS = ("weights", "context", "reserve", "per_slot", "banks", "n_expert", "k", "slots")
_OWN = ("readers", "baseline")  # after reserve; absent in lines of builds before the machine check (read as 0)
_LINE_RE = re.compile(re.escape(MARK) + r"(?P<key>vram|ram)=(?P<budget>\d+) "
                      + " ".join(rf"{f}=(?P<{f}>\d+)" for f in _FIELDS[:3])
                      + "".join(rf"(?: {f}=(?P<{f}>\d+))?" for f in _OWN) + " "
                      + " ".join(rf"{f}=(?P<{f}>\d+)" for f in _FIELDS[3:]) + r"\s*$")


@dataclass(frozen=True)
class CachePlan:
    """One context's plan: the budget (`key` = "vram" or "ram", `budget` bytes), its terms in bytes, and the slots
    per MoE layer that the engine chose."""

    key: str
    budget: int
    weights: int  # on the device (vram=), or in RAM less the routed experts (ram=)
    context: int  # the context's memory (KV cache), measured by the engine
    reserve: int  # vram_reserve
    per_slot: int  # one expert in every bank of every MoE layer
    banks: int  # routed-expert tensors over all MoE layers
    n_expert: int
    k: int
    slots: int
    readers: int = 0  # ram=: the reader threads' buffers
    baseline: int = 0  # ram=: the runtime's baseline


def parse_cache_plans(text: str) -> tuple[CachePlan, ...]:
    """Every plan line in `text`, in order (one per context: llama-bench makes a context per test); a line that
    starts like one but does not match the format is a ParseError."""
    plans: list[CachePlan] = []
    for line in text.splitlines():
        if MARK not in line:
            continue
        m = _LINE_RE.search(line)
        if m is None:
            raise ParseError(f"unrecognised expert cache plan line {line.strip()!r}", text)
        plans.append(CachePlan(m["key"], int(m["budget"]), *(int(m[f]) for f in _FIELDS),
                               *(int(m[f] or 0) for f in _OWN)))
    return tuple(plans)


def parse_cache_plan(text: str) -> CachePlan:
    """The first plan in `text` (the output of a run with vram= or ram=, logged at -lv 4)."""
    plans = parse_cache_plans(text)
    if not plans:
        raise ParseError("no expert cache plan line (a run with vram= or ram=, at -lv 4 or llama-bench -v)", text)
    return plans[0]
