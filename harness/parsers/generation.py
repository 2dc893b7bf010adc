"""The generation worker's output (harness.tools.genworker: one JSON object per prompt and line), and the final
answer of a generated text (GSM8K style: the last number in it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from harness.parsers.base import ParseError

# a number as GSM8K answers write them: optional sign, thousands separators, decimals
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The last number in `text`, normalised as text (no thousands separators, no leading zeros, no trailing
    fractional zeros: "1,000.50" -> "1000.5", "7.0" -> "7", "-0" -> "0"; any length, no rounding), or None when it
    has none. GSM8K's reference answers end with "#### <number>": the same rule reads them."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    raw = found[-1].replace(",", "")
    sign = "-" if raw.startswith("-") else ""
    whole, _, frac = raw.lstrip("-").partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    num = whole + ("." + frac if frac else "")
    return num if num == "0" else sign + num


@dataclass(frozen=True)
class Generation:
    """One prompt's greedy generation: the prompt's tokens, the generated tokens and their text, and the cache's
    statistics file for it (None without a cache)."""

    id: str
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    text: str
    stats: str | None


def parse_generations(stdout: str) -> list[Generation]:
    """The worker's stdout: one JSON object per line (other lines, such as library logs, are not expected there)."""
    out: list[Generation] = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(Generation(str(d["id"]), tuple(int(t) for t in d["prompt_tokens"]),
                                  tuple(int(t) for t in d["tokens"]), str(d["text"]),
                                  None if d.get("stats") is None else str(d["stats"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ParseError(f"not a generation record ({type(e).__name__}: {e}): {line[:200]!r}", stdout) from None
    return out
