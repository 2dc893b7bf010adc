"""Figures for `harness report DIR --plots`: the quality/speed frontier and the mass hypothesis of a sweep.

The figures are drawn from an already summarised sweep (`SweepResult`): nothing is recomputed here except
the least-squares line of the mass plot. matplotlib is an optional extra (`pip install -e '.[plot]'`); it is
imported only when a figure is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.domain.catalogue import FIRST_CHOICE_FETCHING
from harness.domain.results import MassHypothesis, SweepResult, SweepRow
from harness.stats.frontier import pareto_front

FORMATS = ("png", "svg")


@dataclass(frozen=True)
class Line:
    """Ordinary least-squares line y = slope * x + intercept."""

    slope: float
    intercept: float


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """Least-squares line through (xs, ys): slope = Sxy / Sxx, intercept = mean(y) - slope * mean(x)."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise HarnessError(f"a fitted line needs at least 2 paired points, got {n} and {len(ys)}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise HarnessError("a fitted line needs some spread in x: every point has the same substituted mass")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    return Line(slope, my - slope * mx)


def short_label(row: SweepRow) -> str:
    """A policy's name without the parts that are usually constant across a sweep (eviction, slots)."""
    p = row.point
    label = p.rule + (f" tau={p.tau:g}" if p.tau is not None else "")
    return label + (f" admit={p.admit}" if p.admit != "off" else "")


def mass_rows(rows: Sequence[SweepRow]) -> list[SweepRow]:
    """The rows the mass hypothesis uses: first-choice-fetching rules with a delta and a substituted mass."""
    return [r for r in rows if r.point.rule in FIRST_CHOICE_FETCHING and r.delta is not None
            and r.substituted_mass is not None]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise HarnessError("plots need matplotlib: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, stem: Path) -> tuple[Path, ...]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = tuple(stem.with_suffix(f".{fmt}") for fmt in FORMATS)
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    return paths


def _grouped_labels(rows: Sequence[SweepRow], x_of: Callable[[SweepRow], float]) -> dict[tuple[float, float],
                                                                                         list[str]]:
    """Labels of points that (nearly) coincide, joined under one position, so they do not print over each other."""
    groups: dict[tuple[float, float], list[str]] = {}
    for r in rows:
        y = r.delta.delta_pct if r.delta else 0.0
        key = next((k for k in groups if abs(k[0] - x_of(r)) <= 0.002 * max(abs(k[0]), 1e-9)
                    and abs(k[1] - y) <= 0.05), (x_of(r), y))
        groups.setdefault(key, []).append(short_label(r))
    return groups


def _yerr(rows: Sequence[SweepRow]) -> list[list[float]]:
    lo = [r.delta.delta_pct - r.delta.low if r.delta else 0.0 for r in rows]
    hi = [r.delta.high - r.delta.delta_pct if r.delta else 0.0 for r in rows]
    return [lo, hi]


def plot_frontier(rows: Sequence[SweepRow], frontier: Sequence[str], stem: Path, *, profile: str = "") -> tuple[
        Path, ...]:
    """delta-PPL% (95% CI bars) against the cost model's estimated ms/token, or against fetches per token when
    no estimate is there; points on the Pareto frontier highlighted and labelled. Writes stem.png/.svg."""
    with_delta = [r for r in rows if r.delta is not None]
    use_est = bool(with_delta) and all(r.est_ms_per_token is not None for r in with_delta)
    pts = [r for r in with_delta if (r.est_ms_per_token if use_est else r.fetches_per_token) is not None]
    if not pts:
        raise HarnessError("no sweep point has both a delta-PPL and a speed figure: nothing to plot")

    def x_of(r: SweepRow) -> float:
        v = r.est_ms_per_token if use_est else r.fetches_per_token
        return float(v) if v is not None else 0.0

    if use_est:
        front = set(frontier)
        xlabel = "decode time per token, ms: cost-model ESTIMATE" + (f" ({profile} profile)" if profile else "") \
            + ", not measured"
    else:
        front = set(pareto_front([(r.point.name, x_of(r), r.delta.delta_pct) for r in pts if r.delta]))
        xlabel = "expert fetches per token (engine statistics)"
    on = sorted((r for r in pts if r.point.name in front), key=x_of)
    off = [r for r in pts if r.point.name not in front]

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    if off:
        ax.errorbar([x_of(r) for r in off], [r.delta.delta_pct for r in off if r.delta], yerr=_yerr(off),
                    fmt="o", color="0.6", ecolor="0.8", capsize=2, label="other policies")
    if on:
        ax.errorbar([x_of(r) for r in on], [r.delta.delta_pct for r in on if r.delta], yerr=_yerr(on),
                    fmt="o-", color="C3", ecolor="C3", capsize=3, label="Pareto frontier")
        for (x, y), labels in _grouped_labels(on, x_of).items():
            ax.annotate(" / ".join(labels), (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.axhline(0.0, color="0.3", linewidth=0.8, linestyle=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("delta PPL % vs the full model (bars: 95% CI, block bootstrap)")
    ax.set_title("Quality vs speed across cache policies (lower-left is better)")
    ax.legend(loc="best", fontsize=8)
    ax.grid(True, alpha=0.3)
    try:
        return _save(fig, stem)
    finally:
        plt.close(fig)


def plot_mass(rows: Sequence[SweepRow], mass: MassHypothesis, stem: Path) -> tuple[tuple[Path, ...], Line]:
    """Substituted mass against delta-PPL% over the mass hypothesis's points, with the least-squares line and
    Pearson r with its Fisher-z CI in the title. Writes stem.png/.svg; returns the paths and the line."""
    if mass.correlation is None:
        raise HarnessError(f"no mass-hypothesis plot: {mass.note or 'no correlation was computed'}")
    pts = mass_rows(rows)
    xs = [float(r.substituted_mass) for r in pts if r.substituted_mass is not None]
    ys = [float(r.delta.delta_pct) for r in pts if r.delta is not None]
    line = fit_line(xs, ys)
    c = mass.correlation

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.errorbar(xs, ys, yerr=_yerr(pts), fmt="o", color="C0", ecolor="C0", alpha=0.8, capsize=2,
                label="policy (bars: 95% CI of delta PPL)")
    x0, x1 = min(xs), max(xs)
    ax.plot([x0, x1], [line.slope * x0 + line.intercept, line.slope * x1 + line.intercept], color="C3",
            label=f"least squares: y = {line.slope:.3g} x {'-' if line.intercept < 0 else '+'} "
            f"{abs(line.intercept):.3g}")
    ax.set_xlabel("substituted mass (mean substituted gate weight per token-layer)")
    ax.set_ylabel("delta PPL % vs the full model")
    ax.set_title(f"Mass hypothesis: r = {c.r:.3f} [{c.level * 100:g}% CI {c.low:.3f}, {c.high:.3f}] (Fisher z), "
                 f"n = {c.n}\n"
                 f"(rules that always fetch the first choice: {', '.join(FIRST_CHOICE_FETCHING)})", fontsize=10)
    ax.legend(loc="best", fontsize=8)
    ax.grid(True, alpha=0.3)
    try:
        return _save(fig, stem), line
    finally:
        plt.close(fig)


def write_sweep_plots(result: SweepResult, out: Path) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    """Both figures of a sweep into `out` (frontier.png/.svg, mass.png/.svg). Returns the paths written and a
    note for each figure that could not be drawn (too few points)."""
    paths: list[Path] = []
    notes: list[str] = []
    paths += plot_frontier(result.rows, result.frontier, out / "frontier", profile=result.options.profile)
    if result.mass.correlation is None:
        notes.append(f"no mass-hypothesis plot: {result.mass.note}")
    else:
        mass_paths, _ = plot_mass(result.rows, result.mass, out / "mass")
        paths += mass_paths
    return tuple(paths), tuple(notes)
