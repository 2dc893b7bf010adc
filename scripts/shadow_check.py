#!/usr/bin/env python3
"""The shadow estimate against the measured delta-PPL (issue 37; rules: eval/shadow-estimate/RULES.md).

Per cell (model x residency x policy): one llama-perplexity run of the patched build in emulate mode with `shadow=1`
(every ubatch computed twice, exactly and as served), its NLL dump and stats file; per model one run of the full
model (cache off). The measured delta-PPL% is the paired block bootstrap of the two NLL dumps; the estimate is the
stats file's `shadow` object. Appends one JSON line per cell to OUT/results.jsonl (a cell already there is not run
again: an interrupted run resumes), then writes OUT/report.md with the rules' verdicts.

    .venv/bin/python scripts/shadow_check.py --out eval/shadow-estimate
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import ppl_cells  # noqa: E402

from harness.parsers.cache_stats import parse_cache_stats  # noqa: E402
from harness.parsers.nll_dump import read_nll_dump_file  # noqa: E402
from harness.stats.intervals import paired_delta_ppl  # noqa: E402

MODELS = ("tinymoe-f16.gguf", "studymoe-q8_0.gguf", "localmoe-q8_0.gguf")
FRACTIONS = (0.125, 0.25)
POLICIES = ("policy=quality", "policy=speed", "rule=threshold,tau=0.08,evict=lfu,admit=0.5",
            "rule=zero,tau=0.1,evict=lfu")
PPL = ppl_cells.PPL
UBATCH = ("-ub", "1")  # decode's shape: each token's exact pass attends to the served history


def measure(cell: ppl_cells.Cell, work: Path, text: Path, chunks: int, threads: int) -> dict:
    """One cell: emulate with shadow=4 at one-token ubatches; the paired delta against the full model and the
    stats file's shadow object."""
    nll, stats = work / f"{cell.tag}.nll", work / f"{cell.tag}.stats.json"
    spec = f"mode=emulate,{cell.policy},slots={cell.slots},shadow=4,stats={stats}"
    secs = ppl_cells.perplexity(cell.model, text, chunks, threads, nll, spec, extra=UBATCH, who="shadow_check")
    d = paired_delta_ppl(cell.base.nll, read_nll_dump_file(nll).nll, cell.base.chunk)
    st = parse_cache_stats(stats.read_text())
    assert st.shadow is not None, "no shadow object in the stats"
    sh = st.as_dict()["shadow"]
    print(f"{cell.name}: measured {d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}], estimate "
          f"{sh['dppl_pct']:+.2f}% [{sh['dppl_pct_low']:+.2f}, {sh['dppl_pct_high']:+.2f}] ({secs:.0f} s)", flush=True)
    return {"spec": spec, "text": str(text.relative_to(ROOT)), "seconds": round(secs, 1),
            "measured": {"delta_pct": d.delta_pct, "low": d.low, "high": d.high, "n_tokens": d.n_tokens},
            "shadow": sh, "hit_rate": st.hit_rate, "substituted_mass": st.substituted_mass}


def report(rows: list[dict]) -> str:
    est = np.array([r["shadow"]["dppl_pct"] for r in rows])
    mea = np.array([r["measured"]["delta_pct"] for r in rows])
    inside = [r["shadow"]["dppl_pct_low"] <= r["measured"]["delta_pct"] <= r["shadow"]["dppl_pct_high"] for r in rows]
    r_pearson = float(np.corrcoef(est, mea)[0, 1]) if len(rows) > 2 else math.nan
    need = math.ceil(0.8 * len(rows))
    lines = ["# The shadow estimate against the measured delta-PPL", "",
             "Rules: RULES.md (committed before the runs). Records: results.jsonl (one line per cell). "
             "Reproduce: `.venv/bin/python scripts/shadow_check.py --out eval/shadow-estimate`.", "",
             "| model | residency | policy | hit rate | measured delta-PPL% [95% CI] | estimate [95% CI] | "
             "estimate / measured | inside |", "|---|---|---|---|---|---|---|---|"]
    for r, ok in zip(rows, inside, strict=True):
        m, s = r["measured"], r["shadow"]
        ratio = s["dppl_pct"] / m["delta_pct"] if abs(m["delta_pct"]) > 1e-9 else math.nan
        lines.append(f"| {r['model']} | {r['residency'] * 100:g}% | `{r['policy']}` | {r['hit_rate']:.3f} | "
                     f"{m['delta_pct']:+.2f} [{m['low']:+.2f}, {m['high']:+.2f}] | {s['dppl_pct']:+.2f} "
                     f"[{s['dppl_pct_low']:+.2f}, {s['dppl_pct_high']:+.2f}] | {ratio:.2f} | {'yes' if ok else 'no'} |")
    ratios = [r["shadow"]["dppl_pct"] / r["measured"]["delta_pct"] for r in rows if r["measured"]["delta_pct"] > 0.05]
    lines += ["", "## Verdicts", "",
              f"1. Coverage: the interval contains the measurement in {sum(inside)} of {len(rows)} cells (rule: at "
              f"least {need}): **{'held' if sum(inside) >= need else 'did not hold'}**.",
              f"2. Tracking: Pearson r = {r_pearson:.3f} over {len(rows)} cells (rule: at least 0.9): "
              f"**{'held' if r_pearson >= 0.9 else 'did not hold'}**.", "",
              f"Estimate / measured over the cells with a measured loss above +0.05%: median "
              f"{float(np.median(ratios)):.2f}, range [{min(ratios):.2f}, {max(ratios):.2f}] ({len(ratios)} cells)."
              if ratios else "No cell with a measured loss above +0.05%."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "eval/shadow-estimate")
    ap.add_argument("--text", type=Path, default=ROOT / "eval/data/heldout.txt")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if not PPL.exists():
        raise SystemExit(f"shadow_check: {PPL} is not built: run ./build.sh")
    text = a.text.resolve()
    rows = ppl_cells.run_cells(a.out.resolve(), text, a.chunks, a.threads, MODELS, FRACTIONS, POLICIES,
                               lambda c, w: measure(c, w, text, a.chunks, a.threads), extra=UBATCH,
                               who="shadow_check")
    (a.out / "report.md").write_text(report(rows))
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
