"""`harness check --baseline FILE`: a perplexity regression gate for CI.

Runs the recorded configuration (quality only: the full model and each policy in emulate mode on the same
tokens), and compares every policy's paired delta-PPL% with the baseline's, in both directions: a policy fails
when its delta lies outside the baseline's 95% interval [low, high] widened on each side by
`tolerance_scale` x (high - low) + `tolerance_pct` points. Better is a regression too: a preset whose loss
vanished has usually stopped doing its job (e.g. stopped substituting). So the substitution rate and the
substituted gate mass are checked as well: each must stay within SUBST_RTOL of the baseline's (+ SUBST_ATOL).
The runs are deterministic on one build and CPU (emulate mode, the same tokens), so a change of the code or
the model moves these numbers and nothing else does. The full model's PPL must also be the baseline's (else
the model, text or build changed and the baseline means nothing). `--update` (re)writes the baseline from
this run. report.md in the results folder is the gate's: what ran, the rule, and PASS or FAIL per gate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.files import refuse_special
from harness.core.records import prepare_out_dir
from harness.domain.catalogue import DEFAULT_POLICIES, FULL
from harness.domain.options import CompareOptions
from harness.domain.results import CheckResult, CompareResult, GateLine, QualityRow
from harness.domain.settings import PerplexitySettings
from harness.orchestration.compare import compare
from harness.orchestration.executor import Environment, Progress, no_progress
from harness.parsers.baseline import SCHEMA_VERSION, Baseline, read_baseline, tolerance_problem
from harness.report.markdown import render_check_markdown
from harness.tools.requests import Runner

# The full model runs the stock graph: its PPL is reproducible on one build and CPU. Across CPUs the native
# kernels differ (AVX-512 vs AVX2: other summation orders): measured 267.6401 on an Intel AVX-512 machine and
# 267.6405 on an AMD AVX2 one (1.5e-6). A changed model or text moves it by orders of magnitude more.
FULL_PPL_RTOL = 1e-4
# substitution rate and substituted mass: relative and absolute tolerance (the runs are deterministic; these
# leave room for another CPU's rounding flipping a near-tie in the router, which moves a few calls)
SUBST_RTOL = 0.10
SUBST_ATOL = 0.002


def baseline_from(result: CompareResult, tolerance_pct: float, root: Path) -> Baseline:
    o = result.options
    policies: dict[str, dict[str, float]] = {}
    full = None
    for q in result.quality:
        if q.config == FULL:
            full = q.ppl
        elif q.delta is not None:
            row = {"delta_pct": q.delta.delta_pct, "low": q.delta.low, "high": q.delta.high, "ppl": q.ppl}
            if q.cache is not None and q.cache.substitution_rate is not None:
                row["substitution_rate"] = q.cache.substitution_rate
            if q.cache is not None and q.cache.substituted_mass is not None:
                row["substituted_mass"] = q.cache.substituted_mass
            policies[q.config] = row
    if full is None or not policies:
        raise HarnessError("the run produced no paired deltas (are the NLL dumps readable?): baseline not written")

    def rel(p: Path | None) -> str:
        assert p is not None
        try:
            return str(p.resolve().relative_to(root))
        except ValueError:
            return str(p)

    return Baseline(rel(o.model), rel(o.text), o.n_ctx, o.chunks, tolerance_pct, full, policies)


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
    for name, b in baseline.policies.items():
        q = by.get(name)
        if q is None or q.delta is None:
            note = f" ({q.note})" if q and q.note else ""
            lines.append(GateLine(name, False, "no paired delta in this run" + note))
            continue
        d = q.delta
        lo, hi = band(baseline, b)
        problems = []
        if d.delta_pct > hi:
            problems.append(f"worse than the baseline's band [{lo:+.3f}, {hi:+.3f}]")
        elif d.delta_pct < lo:
            problems.append(f"better than the baseline's band [{lo:+.3f}, {hi:+.3f}] (a policy that stopped "
                            "substituting looks like this; if the change is intended, rerun with --update)")
        problems += substitution_problems(b, q)
        ok = not problems
        verdict = "ok" if ok else "REGRESSION: " + "; ".join(problems)
        lines.append(GateLine(name, ok, f"{verdict}: delta {d.delta_pct:+.3f}% [95% CI {d.low:+.3f}, {d.high:+.3f}] "
                              f"vs baseline {b['delta_pct']:+.3f}% [{b['low']:+.3f}, {b['high']:+.3f}]",
                              b["delta_pct"], d.delta_pct, d.low, d.high, (lo, hi)))
    return tuple(lines)


def band(baseline: Baseline, b: Mapping[str, float]) -> tuple[float, float]:
    """Pure: the range a policy's delta-PPL% may take: the baseline's 95% interval widened on each side by
    tolerance_scale x its width + tolerance_pct points."""
    low, high = min(b["low"], b["delta_pct"]), max(b["high"], b["delta_pct"])
    widen = baseline.tolerance_scale * (high - low) + baseline.tolerance_pct
    return low - widen, high + widen


def rule_text(baseline: Baseline) -> str:
    """Pure: what `gate` checks, in words, with this baseline's tolerances (report.md says it)."""
    subst = (f"; its substitution rate and substituted gate mass must stay within {SUBST_RTOL:.0%} (+ {SUBST_ATOL:g}) "
             "of the baseline's" if baseline.schema_version >= 2 else
             " (a version-1 baseline: no substitution figures to check)")
    return (f"The full model's PPL must be the baseline's (relative tolerance {FULL_PPL_RTOL:g}: else the model, "
            "text or build changed). A policy passes when its paired delta PPL% lies within the baseline's 95% "
            f"interval widened on each side by {baseline.tolerance_scale:g} x its width + "
            f"{baseline.tolerance_pct:g} points, in either direction (better is a regression too: a preset that "
            f"stopped substituting looks like one){subst}.")


def substitution_problems(b: Mapping[str, float], q: QualityRow) -> list[str]:
    """Pure: the substitution rate and mass moved beyond SUBST_RTOL/SUBST_ATOL of the baseline's."""
    out = []
    for key, label in (("substitution_rate", "substitution rate"), ("substituted_mass", "substituted mass")):
        if key not in b:
            continue  # a version-1 baseline, or a policy that reports none
        new = getattr(q.cache, key) if q.cache is not None else None
        if new is None:
            out.append(f"no {label} in this run (the baseline has {b[key]:.4f})")
        elif abs(new - b[key]) > SUBST_RTOL * abs(b[key]) + SUBST_ATOL:
            out.append(f"{label} {new:.4f} vs the baseline's {b[key]:.4f}")
    return out


@dataclass(frozen=True)
class CheckOptions(PerplexitySettings):
    """`text`, `model`: default the baseline's, else the held-out text and the trained model; `n_ctx`, `chunks`
    and `policies` are those of a new baseline (a recorded one keeps its own)."""

    baseline: Path
    out: Path
    update: bool = False
    tolerance_pct: float = 0.05  # used when writing a baseline: the floor of the band, in points
    policies: tuple[str, ...] = DEFAULT_POLICIES  # used when writing a new baseline
    model: Path | None = None  # default: the baseline's, else the trained model
    n_ctx: int = field(default=256, kw_only=True)
    chunks: int | None = field(default=12, kw_only=True)
    argv: tuple[str, ...] = ()


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
        # a baseline of this schema keeps its tolerance; a version-1 one's meant another rule (one-sided, beyond
        # the CI), so the new baseline takes this run's
        keep = base is not None and base.schema_version == SCHEMA_VERSION
        new = baseline_from(result, base.tolerance_pct if keep and base else opts.tolerance_pct, root)
        opts.baseline.parent.mkdir(parents=True, exist_ok=True)
        opts.baseline.write_text(json.dumps(new.to_json(), indent=1) + "\n")
        lines = gate(new, result)
        res = CheckResult(lines, all(x.ok for x in lines), True, opts.baseline, result, new, rule_text(new))
    else:
        assert base is not None
        lines = gate(base, result)
        res = CheckResult(lines, all(x.ok for x in lines) and not result.interrupted, False, opts.baseline, result,
                          base, rule_text(base))
    # the comparison wrote its own report.md (a compare's, with a plan of speed runs that check never makes): this
    # run's is the gate's
    (opts.out / "report.md").write_text(render_check_markdown(res))
    return res
