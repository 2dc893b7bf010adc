"""Figures for `harness report DIR --plots`: the quality/speed frontier and the mass hypothesis of a sweep, and the
side-by-side frontier of `harness frontier` (one figure per residency).

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
from harness.domain.results import FrontierResult, FrontierRow, MassHypothesis, SweepResult, SweepRow
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


def _frontier_panel(ax: Any, rows: Sequence[FrontierRow], x_of: Callable[[FrontierRow], float | None],
                    front: Sequence[str], families: Sequence[str], xlabel: str) -> None:
    markers = "osD^v<>PX*"
    for i, fam in enumerate(families):
        pts = [r for r in rows if r.point.family == fam and r.delta is not None and x_of(r) is not None]
        if not pts:
            continue
        ys = [r.delta.delta_pct for r in pts if r.delta is not None]
        ax.errorbar([float(x_of(r) or 0.0) for r in pts], ys, yerr=_yerr_rows(pts), fmt=markers[i % len(markers)],
                    color=f"C{i}", ecolor=f"C{i}", alpha=0.75, capsize=2, markersize=5, label=fam)
    on = sorted((r for r in rows if r.point.name in front and x_of(r) is not None and r.delta is not None),
                key=lambda r: float(x_of(r) or 0.0))
    if on:
        ax.plot([float(x_of(r) or 0.0) for r in on], [r.delta.delta_pct for r in on if r.delta is not None],
                "-", color="0.2", linewidth=1.0, label="Pareto frontier")
    for r in rows:
        if r.point.preset is not None and r.delta is not None and x_of(r) is not None:
            ax.annotate(r.point.preset, (float(x_of(r) or 0.0), r.delta.delta_pct), textcoords="offset points",
                        xytext=(6, 6), fontsize=8, fontweight="bold")
    ax.axhline(0.0, color="0.3", linewidth=0.8, linestyle=":")
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)


def _yerr_rows(rows: Sequence[FrontierRow]) -> list[list[float]]:
    """Bar lengths below and above the point (clipped at 0: a percentile CI of an exactly constant shift can miss
    its point estimate by rounding)."""
    lo = [max(0.0, r.delta.delta_pct - r.delta.low) if r.delta else 0.0 for r in rows]
    hi = [max(0.0, r.delta.high - r.delta.delta_pct) if r.delta else 0.0 for r in rows]
    return [lo, hi]


def write_frontier_plots(result: FrontierResult, out: Path) -> tuple[Path, ...]:
    """Per residency, delta-PPL% (95% CI bars) against bytes moved per token (left) and the cost model's
    estimated time per token (right), coloured by family, the Pareto frontier of each panel drawn, the presets
    labelled. Writes out/frontier-<residency>pct.png/.svg (12_5pct for 12.5%)."""
    from harness.domain.catalogue import FRONTIER_FAMILIES

    families = [f for f in FRONTIER_FAMILIES if f in result.options.grid.families]
    paths: list[Path] = []
    plt = _pyplot()
    for f in result.options.grid.fractions:
        rows = [r for r in result.rows if r.point.fraction == f]
        if not any(r.delta is not None for r in rows):
            continue
        fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
        _frontier_panel(left, rows, lambda r: r.bytes_moved / 1024 if r.bytes_moved is not None else None,
                        result.bytes_frontier.get(f, ()), families,
                        "bytes moved per token, KiB\n(synchronous + background; host computes move none)")
        _frontier_panel(right, rows, lambda r: r.est_ms_per_token, result.frontier.get(f, ()), families,
                        f"decode time per token, ms\ncost-model ESTIMATE ({result.options.profile}), not measured")
        left.set_ylabel("delta PPL % vs the full model (bars: 95% CI, block bootstrap)")
        left.legend(loc="best", fontsize=8)
        fig.suptitle(f"The policies side by side at {f:.1%} residency (lower-left is better)")
        try:
            paths += _save(fig, out / f"frontier-{f * 100:g}pct".replace(".", "_"))  # 12.5% -> frontier-12_5pct
        finally:
            plt.close(fig)
    if not paths:
        raise HarnessError("no frontier point has a delta-PPL: nothing to plot")
    return tuple(paths)
