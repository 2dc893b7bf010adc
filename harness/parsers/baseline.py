"""The perplexity baseline of `harness check` (eval/baselines/*.json): schema moe-subst/ppl-baseline, version 2.

`Baseline.to_json` writes it, `read_baseline` reads it back (version 1 too), refusing another schema or a damaged
file with a one-line error.

Version 2 adds, per policy, the substitution rate and substituted gate mass of the run (a preset that stops
substituting is a regression too), and `tolerance_scale`: a policy's delta-PPL must stay within its baseline's
95% interval widened by `tolerance_scale` x the interval's width + `tolerance_pct` points, in either direction.
Version 1 files (one-sided gate, no substitution figures) are read with `tolerance_scale` 0.5 and their
`tolerance_pct` as the floor; their substitution checks are skipped with a note.

Python's json reads `Infinity` and `NaN`: a tolerance that is not a finite number >= 0 would pass anything
(Infinity) or fail everything as a regression (NaN, negative), and so would an absurdly large one (1e308 passed a
-50% regression): `tolerance_pct` must lie in [0, MAX_TOLERANCE_PCT] points, `tolerance_scale` in [0,
MAX_TOLERANCE_SCALE]. A non-finite figure of the full model or a policy means nothing. Each is a damaged
baseline."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError

SCHEMA = "moe-subst/ppl-baseline"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
DEFAULT_TOLERANCE_SCALE = 0.5
# the largest tolerances a gate takes: a band wider than 100 points of delta PPL, or 10 interval widths on each
# side, passes any regression a policy can show (1e308 disarmed the gate: a -50% regression passed)
MAX_TOLERANCE_PCT = 100.0
MAX_TOLERANCE_SCALE = 10.0


@dataclass(frozen=True)
class Baseline:
    model: str
    text: str
    n_ctx: int
    chunks: int | None
    tolerance_pct: float
    full_ppl: float
    # name -> delta_pct, low, high, ppl (+ substitution_rate, substituted_mass: version 2)
    policies: Mapping[str, Mapping[str, float]]
    tolerance_scale: float = DEFAULT_TOLERANCE_SCALE
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "model": self.model, "text": self.text,
                "n_ctx": self.n_ctx, "chunks": self.chunks, "tolerance_pct": self.tolerance_pct,
                "tolerance_scale": self.tolerance_scale, "full_ppl": self.full_ppl,
                "policies": {k: dict(v) for k, v in self.policies.items()}}


def read_baseline(path: Path) -> Baseline:
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise HarnessError(f"cannot read the baseline {path}: {e.strerror} (create it with --update)") from None
    except ValueError as e:
        raise HarnessError(f"{path} is not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("schema_version") not in READABLE_VERSIONS:
        raise HarnessError(f"{path} is not a {SCHEMA} version {SCHEMA_VERSION} file")
    try:
        base = Baseline(str(doc["model"]), str(doc["text"]), int(doc["n_ctx"]),
                        int(doc["chunks"]) if doc.get("chunks") is not None else None, float(doc["tolerance_pct"]),
                        float(doc["full_ppl"]),
                        {str(k): {kk: float(vv) for kk, vv in v.items()} for k, v in doc["policies"].items()},
                        float(doc.get("tolerance_scale", DEFAULT_TOLERANCE_SCALE)), int(doc["schema_version"]))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise HarnessError(f"{path}: damaged baseline ({type(e).__name__}: {e})") from None
    problem = baseline_problem(base)
    if problem:
        raise HarnessError(f"{path}: damaged baseline: {problem}; correct it, or delete it and write a new one with "
                           "--update")
    return base


def tolerance_problem(tolerance: float, limit: float = MAX_TOLERANCE_PCT, unit: str = "percentage points") -> str:
    """Why a tolerance cannot gate anything ('' if it can): it must be a finite number of `unit` in [0, limit]
    (Infinity, or 1e308, would pass any regression; NaN or a negative one fail every policy)."""
    if not math.isfinite(tolerance) or tolerance < 0 or tolerance > limit:
        return f"not a number of {unit} in [0, {limit:g}]"
    return ""


def baseline_problem(base: Baseline) -> str:
    """The first figure of a baseline that cannot be gated against ('' if none): the tolerance, the full model's
    PPL (finite, > 0) and every policy's figures (finite)."""
    if problem := tolerance_problem(base.tolerance_pct):
        return f"tolerance_pct is {base.tolerance_pct!r}, {problem}"
    if problem := tolerance_problem(base.tolerance_scale, MAX_TOLERANCE_SCALE, "interval widths"):
        return f"tolerance_scale is {base.tolerance_scale!r}, {problem}"
    if not (math.isfinite(base.full_ppl) and base.full_ppl > 0):
        return f"full_ppl is {base.full_ppl!r}, not a finite perplexity > 0"
    for name, figures in base.policies.items():
        for key, value in figures.items():
            if not math.isfinite(value):
                return f"policy {name}'s {key} is {value!r}, not a finite number"
    return ""
