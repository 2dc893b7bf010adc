"""Does a greedy generation degenerate? (issue 22: a real small language model's greedy generations "do not
degenerate within 48 tokens on most prompts"). Pure.

The rule, fixed before studymoe's generations were run (2026-12-02): a generation **degenerates** when its tokens
end in a loop, a suffix that repeats with some period p <= MAX_PERIOD tokens over at least max(MIN_SPAN, 3p) tokens
(at least three whole periods): "0 0 0 0 ...", the same short line again and again up to the end. tinymoe's
"1.1920000..." and "systemd(1),\\nsystemd(1),..." are loops by this rule. Repetition that varies (code's
`self.a = a` / `self.b = b`, a numbered list) is not periodic in tokens and does not count, nor does a loop that
the generation left before its end. A generation is judged on the tokens it produced: one that stopped early at
end-of-text is judged on what it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_PERIOD = 16
MIN_SPAN = 16


@dataclass(frozen=True)
class Loop:
    period: int  # tokens per repetition
    span: int  # tokens at the end that repeat with that period (the loop's length, first period included)


def loop_tail(tokens: Sequence[int], *, max_period: int = MAX_PERIOD, min_span: int = MIN_SPAN) -> Loop | None:
    """The loop the tokens end in (the shortest period that qualifies), or None."""
    n = len(tokens)
    for p in range(1, max_period + 1):
        if n < 2 * p:
            break
        j = n - p - 1  # tokens[s:] has period p iff tokens[i] == tokens[i + p] for s <= i < n - p
        while j >= 0 and tokens[j] == tokens[j + p]:
            j -= 1
        span = n - (j + 1)
        if span >= max(min_span, 3 * p):
            return Loop(p, span)
    return None


def degenerates(tokens: Sequence[int]) -> bool:
    """The rule of this module's docstring."""
    return loop_tail(tokens) is not None
