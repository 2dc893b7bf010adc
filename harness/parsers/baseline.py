"""The perplexity baseline of `harness check` (eval/baselines/*.json): schema moe-subst/ppl-baseline, version 1.

`Baseline.to_json` writes it, `read_baseline` reads it back, refusing another schema or a damaged file with a
one-line error."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError

SCHEMA = "moe-subst/ppl-baseline"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Baseline:
    model: str
    text: str
    n_ctx: int
    chunks: int | None
    tolerance_pct: float
    full_ppl: float
    policies: Mapping[str, Mapping[str, float]]  # name -> delta_pct, low, high, ppl

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "model": self.model, "text": self.text,
                "n_ctx": self.n_ctx, "chunks": self.chunks, "tolerance_pct": self.tolerance_pct,
                "full_ppl": self.full_ppl, "policies": {k: dict(v) for k, v in self.policies.items()}}


def read_baseline(path: Path) -> Baseline:
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise HarnessError(f"cannot read the baseline {path}: {e.strerror} (create it with --update)") from None
    except ValueError as e:
        raise HarnessError(f"{path} is not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("schema_version") != SCHEMA_VERSION:
        raise HarnessError(f"{path} is not a {SCHEMA} version {SCHEMA_VERSION} file")
    try:
        return Baseline(str(doc["model"]), str(doc["text"]), int(doc["n_ctx"]),
                        int(doc["chunks"]) if doc.get("chunks") is not None else None, float(doc["tolerance_pct"]),
                        float(doc["full_ppl"]),
                        {str(k): {kk: float(vv) for kk, vv in v.items()} for k, v in doc["policies"].items()})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise HarnessError(f"{path}: damaged baseline ({type(e).__name__}: {e})") from None
