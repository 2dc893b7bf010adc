"""harness.stats.routing: routing statistics of a trace, against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.core.errors import HarnessError
from harness.parsers.trace import ExpertTrace, trace_dtype
from harness.stats.routing import routing_stats


def _trace(layer_ids: list[list[int]], layer_w: list[list[float]], n_expert: int = 8, layers: int = 1) -> ExpertTrace:
    k = len(layer_ids[0])
    dt = trace_dtype(k, 2)
    rec = np.zeros(len(layer_ids) * layers, dtype=dt)
    i = 0
    for layer in range(layers):
        for t, (ids, w) in enumerate(zip(layer_ids, layer_w, strict=True)):
            rec[i]["layer"], rec[i]["token"] = layer, t
            rec[i]["ids"], rec[i]["weights"] = ids, w
            i += 1
    return ExpertTrace(2, layers, n_expert, k, 2, 4, rec)


def test_by_hand() -> None:
    # 3 tokens, k = 2, 8 experts; the middle token lists its weights out of rank order
    ids = [[0, 1], [1, 2], [3, 4]]
    w = [[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]]
    t = _trace(ids, w)
    (row,) = routing_stats(t.records, t.k, t.n_expert).layers
    assert row.tokens == 3
    assert row.mean_weight_by_rank == pytest.approx(((0.9 + 0.8 + 0.5) / 3, (0.1 + 0.2 + 0.5) / 3))
    assert row.first_heavy == 1.0
    assert row.rest_heavy == pytest.approx(2 / 3)  # 0.2 and 0.5 are >= 0.15, 0.1 is not
    assert row.heavy_calls == pytest.approx(5 / 6)
    # load: expert 1 twice, 0, 2, 3, 4 once, experts 5-7 never -> 3 dead of 8
    p = np.array([1, 2, 1, 1, 1]) / 6
    assert row.usage_entropy == pytest.approx(float(-(p * np.log(p)).sum() / math.log(8)))
    assert row.dead == 3 / 8
    # reuse: token 1 shares expert 1 with token 0 (1 of 2), token 2 shares none: (0.5 + 0) / 2
    assert row.reuse == pytest.approx(0.25) and row.reuse_chance == 0.25


def test_layers_separately_and_an_empty_trace() -> None:
    t = _trace([[0, 1], [0, 1]], [[0.6, 0.4], [0.6, 0.4]], layers=2)
    s = routing_stats(t.records, t.k, t.n_expert)
    assert [x.layer for x in s.layers] == [0, 1] and all(x.reuse == 1.0 for x in s.layers)
    assert s.mean("reuse") == 1.0
    with pytest.raises(HarnessError, match="no records"):
        routing_stats(np.zeros(0, dtype=trace_dtype(2, 2)), 2, 8)
