"""The Pareto frontier of points with two coordinates to minimise (delta-PPL and time per token, in sweeps)."""

from __future__ import annotations

from collections.abc import Sequence


def pareto_front(points: Sequence[tuple[str, float, float]]) -> tuple[str, ...]:
    """Names of the points not dominated when both coordinates are to be minimised (a point dominates
    another when it is no worse in both and better in one), in the order of the first coordinate."""
    front = []
    for name, x, y in points:
        dominated = any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for _, x2, y2 in points)
        if not dominated:
            front.append((x, y, name))
    return tuple(n for _, _, n in sorted(front))
