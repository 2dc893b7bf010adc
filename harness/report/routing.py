"""Routing statistics (harness.stats.routing) as a Markdown table: a renderer, returns a string."""

from __future__ import annotations

from harness.stats.routing import RoutingStats


def render_routing(s: RoutingStats, title: str = "") -> str:
    head = [f"### Routing statistics{': ' + title if title else ''}", "",
            f"{s.n_expert} experts, top-{s.k}; weights are the normalised top-k gate weights. heavy calls = first "
            "choices + other ranks with weight >= 0.15 (what the 0.15 rule fetches on a miss); reuse = share of a "
            f"token's experts the previous token also used (chance: {s.k / s.n_expert:.3f}).", "",
            "| layer | tokens | w rank 0 | w rank 1 | w rank k-1 | first >= 0.15 | ranks 1.. >= 0.15 | heavy calls "
            "| usage entropy / ln E | dead (< 1% of uniform) | reuse |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for x in s.layers:
        w = x.mean_weight_by_rank
        rows.append(f"| {x.layer} | {x.tokens} | {w[0]:.3f} | {w[1] if len(w) > 1 else 0:.3f} | {w[-1]:.3f} "
                    f"| {x.first_heavy:.1%} | {x.rest_heavy:.1%} | {x.heavy_calls:.1%} | {x.usage_entropy:.3f} "
                    f"| {x.dead:.1%} | {x.reuse:.3f} |")
    w0 = sum(x.mean_weight_by_rank[0] for x in s.layers) / len(s.layers)
    rows.append(f"| mean | | {w0:.3f} | | | {s.mean('first_heavy'):.1%} | {s.mean('rest_heavy'):.1%} "
                f"| {s.mean('heavy_calls'):.1%} | {s.mean('usage_entropy'):.3f} | {s.mean('dead'):.1%} "
                f"| {s.mean('reuse'):.3f} |")
    return "\n".join(head + rows) + "\n"
