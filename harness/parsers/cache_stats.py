"""The expert cache's statistics JSON (patched build, `stats=PATH` in the cache spec).

PROVISIONAL: the cache's documentation (docs/expert-cache.md) does not define the schema yet. This reader
accepts the three figures the harness reports under the names below, at the top level or inside a
"totals" / "summary" / "total" object, and keeps the whole document as text so nothing is lost. Adapt
the names here (one place) when the schema is documented.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from harness.parsers.base import ParseError

_FIELDS: dict[str, tuple[str, ...]] = {
    "substitution_rate": ("substitution_rate", "sub_rate"),
    "substituted_mass": ("substituted_mass", "mass", "substituted_gate_mass"),
    "fetches_per_token": ("fetches_per_token", "fetch_per_token"),
}
_NESTS = ("totals", "summary", "total")


@dataclass(frozen=True)
class CacheStats:
    substitution_rate: float | None  # substituted expert calls / all expert calls
    substituted_mass: float | None  # mean substituted gate mass per token-layer
    fetches_per_token: float | None
    raw: str  # the JSON document as written by the engine

    def as_dict(self) -> dict[str, float | None]:
        return {k: getattr(self, k) for k in _FIELDS}


def _lookup(doc: dict[str, Any], names: tuple[str, ...]) -> float | None:
    scopes = [doc] + [doc[n] for n in _NESTS if isinstance(doc.get(n), dict)]
    for scope in scopes:
        for name in names:
            v = scope.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    return None


def parse_cache_stats(text: str) -> CacheStats:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ParseError(f"the cache statistics are not JSON ({e})", text, source="the expert cache") from None
    if not isinstance(doc, dict):
        raise ParseError("the cache statistics are not a JSON object", text, source="the expert cache")
    values = {k: _lookup(doc, names) for k, names in _FIELDS.items()}
    if all(v is None for v in values.values()):
        raise ParseError(f"the cache statistics have none of {', '.join(_FIELDS)}", text,
                         source="the expert cache")
    for k, v in values.items():
        if v is not None and (not math.isfinite(v) or v < 0):
            raise ParseError(f"the cache statistic {k} is {v}", text, source="the expert cache")
    return CacheStats(values["substitution_rate"], values["substituted_mass"], values["fetches_per_token"], text)
