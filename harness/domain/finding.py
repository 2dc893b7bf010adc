"""A finding's verdict: its own module so that the result types (results.py) and the rules that produce verdicts
(verdicts.py, composition.py) can both use it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    finding: str
    held: bool | None  # None: not testable here
    evidence: str
