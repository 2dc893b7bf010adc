"""The full-scale tiers benchmark's table (scripts/bench_tiers.py --full-scale): speed, bytes read, floors and each
policy's price in quality, in one markdown table. Pure: rows in, a string out."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from harness.domain.tiers import PACK_ROW, PACK_TARGET, PackVerdict, PrefetchVerdict, TierRow
from harness.stats.intervals import DeltaPPL


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def _ratio(r: tuple[float, float, float] | None) -> str:
    if r is None:
        return "-"
    ratio, lo, hi = r
    ci = f" [{lo:.1f}, {hi:.1f}]" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"{ratio:.2f}x{ci}"


def render_tiers_table(rows: Sequence[TierRow], stock_configs: Sequence[str], best_stock: str | None,
                       quality: Mapping[str, DeltaPPL | None], quality_label: str) -> str:
    """One row per run configuration. `quality` maps a policy (the config's name without " (replay)") to its
    delta-PPL on the trained model (`quality_label` says which model, text and residency)."""
    head = ["run", "t/s", "± 95% CI", "n"] + [f"x {s}" for s in stock_configs] + [
        "hit rate", "subst. rate", "engine MB/token", "process MB/token", "I/O floor ms", "compute ms",
        "serial floor t/s", "overlapped floor t/s", "serial floor / run", "overlapped floor / run",
        f"delta-PPL [95% CI] ({quality_label})"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if r.n == 0:
            lines.append(f"| {r.config} | {r.error or 'no samples'} |" + " |" * (len(head) - 2))
            continue
        policy = r.config.removesuffix(PACK_ROW).removesuffix(" (replay)")
        d = quality.get(policy)
        q = ("-" if policy not in quality else "not measured" if d is None
             else f"{d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}]")
        fl = r.floors
        cells = [r.config + (" (headline denominator)" if r.config == best_stock else ""), _f(r.mean_ts),
                 _f(r.ci95), str(r.n)]
        cells += [_ratio(r.vs_stock.get(s)) for s in stock_configs]
        cells += [_f(r.hit_rate, ".3f"), _f(r.substitution_rate, ".3f"),
                  _f(r.engine_bytes_per_token / 1e6 if r.engine_bytes_per_token is not None else None, ".1f"),
                  _f(r.process_bytes_per_token / 1e6, ".1f"),
                  _f(fl.io_ms if fl else None, ".1f"), _f(fl.compute_ms if fl else None, ".1f"),
                  _f(fl.serial_ts if fl else None), _f(fl.overlapped_ts if fl else None),
                  _f(fl.serial_ts / r.mean_ts if fl else None), _f(fl.overlapped_ts / r.mean_ts if fl else None), q]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_pack_verdicts(verdicts: Sequence[PackVerdict]) -> str:
    """--pack: one read per expert (the expert pack) against three reads, per policy, with the rule's verdict."""
    head = ["policy", "three reads t/s", "one read (pack) t/s", "pack / three [95% CI]", "slice reads MB/s",
            "whole-expert reads MB/s", "I/O share (three reads)", "probe bound", f"verdict (target {PACK_TARGET}x)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for v in verdicts:
        cells = [v.policy, _f(v.three_ts), _f(v.pack_ts), _ratio(v.ratio), _f(v.slice_bps / 1e6, ".0f"),
                 _f(v.record_bps / 1e6, ".0f"), _f(100 * v.io_share if v.io_share is not None else None, ".0f") + "%",
                 _f(v.bound) + "x", v.verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_prefetch_verdicts(verdicts: Sequence[PrefetchVerdict], counts: Mapping[str, str]) -> str:
    """Prefetch on the file tier: each policy with and without prefetch, with the rule's verdict and what the
    prefetch row's engine did (counts: prefetch row -> harness.domain.tiers.prefetch_counts)."""
    head = ["policy", "t/s", "with prefetch", "t/s", "with / without [95% CI]", "verdict", "the prefetch row's engine"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for v in verdicts:
        cells = [v.policy, _f(v.off_ts), v.prefetch, _f(v.on_ts), _ratio(v.ratio), v.verdict,
                 counts.get(v.prefetch, "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
