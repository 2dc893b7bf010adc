"""Routing statistics of a router trace: how a model spreads gate weight over its top-k and how its expert
choices repeat in time. Pure functions, no I/O.

These say how far a model's routing is from the study's (Qwen3-Next-80B-A3B: 512 experts, top-10, normalised
top-k weights): the 0.15 rule fetches a miss when it is a first choice or weighs >= 0.15, so the share of calls
that are "heavy" bounds what the rule can save; temporal reuse (the share of a token's experts that the
previous token of the same layer also used) is what an LRU/LFU cache and prefetch live on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError

HEAVY_WEIGHT = 0.15  # PAPER.md: the 0.15 rule


@dataclass(frozen=True)
class LayerRouting:
    layer: int
    tokens: int
    mean_weight_by_rank: tuple[float, ...]  # rank 0 (first choice) first; weights sorted descending per token
    first_heavy: float  # share of first choices with weight >= 0.15
    rest_heavy: float  # share of ranks 1..k-1 with weight >= 0.15
    heavy_calls: float  # share of all calls that are a first choice or weigh >= 0.15 (the 0.15 rule fetches these)
    usage_entropy: float  # entropy of the expert load over ln(n_expert): 1 for a uniform load
    dead: float  # share of experts with < 1% of the uniform load
    reuse: float  # mean share of a token's k experts that the previous token of this layer also used
    reuse_chance: float  # the same for independent uniform choices: k / n_expert


@dataclass(frozen=True)
class RoutingStats:
    n_expert: int
    k: int
    layers: tuple[LayerRouting, ...]

    def mean(self, field: str) -> float:
        """The mean over layers of one per-layer figure."""
        return float(np.mean([getattr(x, field) for x in self.layers]))


def routing_stats(rec: npt.NDArray[np.void], k: int, n_expert: int) -> RoutingStats:
    """Per MoE layer statistics of the router's choices in a trace's records (harness.parsers.trace: fields layer,
    token, ids[k], weights[k]; any policy: the ids and weights are the router's own, before any substitution)."""
    if len(rec) == 0:
        raise HarnessError("the trace holds no records (no token was decided)")
    rows = []
    for layer in np.unique(rec["layer"]):
        r = rec[rec["layer"] == layer]
        r = r[np.argsort(r["token"], kind="stable")]
        ids = r["ids"].astype(np.int64)
        w = r["weights"].astype(np.float64)
        order = np.argsort(-w, axis=1, kind="stable")
        ws = np.take_along_axis(w, order, axis=1)
        heavy = ws >= HEAVY_WEIGHT
        heavy[:, 0] = True  # a first choice is fetched whatever it weighs
        load = np.bincount(ids.reshape(-1), minlength=n_expert).astype(np.float64)
        p = load / load.sum()
        nz = p[p > 0]
        entropy = float(-(nz * np.log(nz)).sum() / math.log(n_expert)) if n_expert > 1 else 1.0
        # temporal reuse: consecutive tokens (token index t-1 and t) of this layer
        tok = r["token"].astype(np.int64)
        consecutive = np.nonzero(tok[1:] == tok[:-1] + 1)[0]
        if len(consecutive):
            prev, cur = ids[consecutive], ids[consecutive + 1]
            shared = (cur[:, :, None] == prev[:, None, :]).any(axis=2).sum(axis=1)
            reuse = float(shared.mean() / k)
        else:
            reuse = float("nan")
        rows.append(LayerRouting(
            layer=int(layer), tokens=len(r),
            mean_weight_by_rank=tuple(float(x) for x in ws.mean(axis=0)),
            first_heavy=float((ws[:, 0] >= HEAVY_WEIGHT).mean()),
            rest_heavy=float((ws[:, 1:] >= HEAVY_WEIGHT).mean()) if k > 1 else 0.0,
            heavy_calls=float(heavy.mean()),
            usage_entropy=entropy,
            dead=float((p < 0.01 / n_expert).mean()),
            reuse=reuse, reuse_chance=k / n_expert))
    return RoutingStats(n_expert, k, tuple(rows))
