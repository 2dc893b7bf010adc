"""`harness check --baseline FILE`: a perplexity regression gate for CI.

Runs the recorded configuration (quality only: the full model and each policy in emulate mode on the same
tokens), and compares every policy's paired delta-PPL% with the baseline's. A policy fails when its delta
got worse than the baseline by more than the tolerance *beyond its CI*: the lower end of the new 95% CI
exceeds baseline + tolerance. The full model's PPL must also be the baseline's (else the model, text or
build changed and the baseline means nothing). `--update` (re)writes the baseline from this run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.files import refuse_special
from harness.core.records import prepare_out_dir
from harness.domain.catalogue import DEFAULT_POLICIES, FULL
from harness.domain.options import CompareOptions
from harness.domain.results import CompareResult
from harness.domain.settings import PerplexitySettings
from harness.orchestration.compare import compare
from harness.orchestration.executor import Environment, Progress, no_progress
from harness.parsers.baseline import Baseline, read_baseline, tolerance_problem
from harness.tools.runners import Runner

# The full model runs the stock graph: its PPL is reproducible on one build and CPU. Across CPUs the native
# kernels differ (AVX-512 vs AVX2: other summation orders): measured 267.6401 on an Intel AVX-512 machine and
# 267.6405 on an AMD AVX2 one (1.5e-6). A changed model or text moves it by orders of magnitude more.
FULL_PPL_RTOL = 1e-4


def baseline_from(result: CompareResult, tolerance_pct: float, root: Path) -> Baseline:
    o = result.options
    policies: dict[str, dict[str, float]] = {}
    full = None
    for q in result.quality:
        if q.config == FULL:
            full = q.ppl
        elif q.delta is not None:
            policies[q.config] = {"delta_pct": q.delta.delta_pct, "low": q.delta.low, "high": q.delta.high,
                                  "ppl": q.ppl}
    if full is None or not policies:
        raise HarnessError("the run produced no paired deltas (are the NLL dumps readable?): baseline not written")

    def rel(p: Path | None) -> str:
        assert p is not None
        try:
            return str(p.resolve().relative_to(root))
        except ValueError:
            return str(p)

    return Baseline(rel(o.model), rel(o.text), o.n_ctx, o.chunks, tolerance_pct, full, policies)


@dataclass(frozen=True)
class GateLine:
    policy: str
    ok: bool
    message: str
    baseline_pct: float | None = None
    delta_pct: float | None = None
    low: float | None = None
    high: float | None = None


def gate(baseline: Baseline, result: CompareResult) -> tuple[GateLine, ...]:
    """Pure: one line per check, ok or not."""
    lines: list[GateLine] = []
    by = {q.config: q for q in result.quality}
    full = by.get(FULL)
    if full is None:
        lines.append(GateLine(FULL, False, "the full-model run is missing"))
    elif not math.isclose(full.ppl, baseline.full_ppl, rel_tol=FULL_PPL_RTOL):
        lines.append(GateLine(FULL, False, f"the full model's PPL is {full.ppl:.6f}, the baseline's "
                              f"{baseline.full_ppl:.6f}: the model, text or build changed; if that is intended, "
                              "rerun with --update"))
    else:
        lines.append(GateLine(FULL, True, f"full model PPL {full.ppl:.4f} as in the baseline"))
    tol = baseline.tolerance_pct
    for name, b in baseline.policies.items():
        q = by.get(name)
        if q is None or q.delta is None:
            note = f" ({q.note})" if q and q.note else ""
            lines.append(GateLine(name, False, "no paired delta in this run" + note))
            continue
        d = q.delta
        ok = d.low <= b["delta_pct"] + tol
        verdict = "ok" if ok else "REGRESSION"
        lines.append(GateLine(name, ok, f"{verdict}: delta {d.delta_pct:+.3f}% [95% CI {d.low:+.3f}, {d.high:+.3f}] "
                              f"vs baseline {b['delta_pct']:+.3f}% (tolerance {tol:g} points)",
                              b["delta_pct"], d.delta_pct, d.low, d.high))
    return tuple(lines)


@dataclass(frozen=True)
class CheckOptions(PerplexitySettings):
    """`text`, `model`: default the baseline's, else the held-out text and the trained model; `n_ctx`, `chunks`
    and `policies` are those of a new baseline (a recorded one keeps its own)."""

    baseline: Path
    out: Path
    update: bool = False
    tolerance_pct: float = 0.5  # used when writing a baseline
    policies: tuple[str, ...] = DEFAULT_POLICIES  # used when writing a new baseline
    model: Path | None = None  # default: the baseline's, else the trained model
    n_ctx: int = field(default=256, kw_only=True)
    chunks: int | None = field(default=12, kw_only=True)
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckResult:
    lines: tuple[GateLine, ...]
    passed: bool
    updated: bool
    baseline_path: Path
    compare: CompareResult


def check(opts: CheckOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
          env: Environment | None = None, root: Path | None = None) -> CheckResult:
    root = root or project.project_root()
    if opts.update and (problem := tolerance_problem(opts.tolerance_pct)):
        raise HarnessError(f"--tolerance {opts.tolerance_pct!r} is {problem}")
    refuse_special(opts.baseline, "--baseline")
    prepare_out_dir(opts.out)
    base = read_baseline(opts.baseline) if opts.baseline.is_file() else None
    if base is None and not opts.update:
        raise HarnessError(f"no baseline at {opts.baseline}: create it with --update")

    def at(p: str) -> Path:
        return Path(p) if Path(p).is_absolute() else root / p

    copts = CompareOptions(
        out=opts.out, model=opts.model or (at(base.model) if base else None),
        text=opts.text or (at(base.text) if base else None),
        policies=tuple(base.policies) if base and not opts.update else opts.policies,
        n_ctx=base.n_ctx if base and not opts.update else opts.n_ctx,
        chunks=base.chunks if base and not opts.update else opts.chunks,
        n_batch=opts.n_batch, threads=opts.threads, speed=False, quality=True, argv=opts.argv, profile=None)
    result = compare(copts, progress, runner=runner, env=env)
    if opts.update:
        new = baseline_from(result, base.tolerance_pct if base else opts.tolerance_pct, root)
        opts.baseline.parent.mkdir(parents=True, exist_ok=True)
        opts.baseline.write_text(json.dumps(new.to_json(), indent=1) + "\n")
        lines = gate(new, result)
        return CheckResult(lines, all(x.ok for x in lines), True, opts.baseline, result)
    assert base is not None
    lines = gate(base, result)
    return CheckResult(lines, all(x.ok for x in lines) and not result.interrupted, False, opts.baseline, result)
