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
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import ppl_cells  # noqa: E402

from harness.domain.plan import slots_for_residency  # noqa: E402
from harness.parsers.cache_stats import parse_cache_stats  # noqa: E402
from harness.parsers.gguf_model import read_model_info  # noqa: E402
from harness.parsers.nll_dump import read_nll_dump_file  # noqa: E402
from harness.stats.intervals import paired_delta_ppl  # noqa: E402

MODELS = ("tinymoe-f16.gguf", "studymoe-q8_0.gguf", "localmoe-q8_0.gguf")
FRACTIONS = (0.125, 0.25)
POLICIES = ("policy=quality", "policy=speed", "rule=threshold,tau=0.08,evict=lfu,admit=0.5",
            "rule=zero,tau=0.1,evict=lfu")
PPL = ppl_cells.PPL


def perplexity(model: Path, text: Path, chunks: int, threads: int, nll: Path, spec: str | None) -> float:
    return ppl_cells.perplexity(model, text, chunks, threads, nll, spec, extra=("-ub", "1"), who="shadow_check")


def run_cells(out: Path, text: Path, chunks: int, threads: int) -> list[dict]:
    results = out / "results.jsonl"
    done = {}
    if results.exists():
        for line in results.read_text().splitlines():
            r = json.loads(line)
            done[r["cell"]] = r
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in MODELS:
        model = ROOT / "models" / name
        info = read_model_info(model)
        full = work / f"{name}.full.nll"
        if not full.exists():
            s = perplexity(model, text, chunks, threads, full, None)
            print(f"{name}: full model in {s:.0f} s", flush=True)
        base = read_nll_dump_file(full)
        for f in FRACTIONS:
            slots = slots_for_residency(f, info.n_expert, info.n_expert_used)
            for pol in POLICIES:
                cell = f"{name} {f * 100:g}% {pol}"
                if cell in done:
                    rows.append(done[cell])
                    continue
                tag = f"{name}.{f:g}.{pol.replace('=', '-').replace(',', '.')}"
                nll, stats = work / f"{tag}.nll", work / f"{tag}.stats.json"
                spec = f"mode=emulate,{pol},slots={slots},shadow=4,stats={stats}"
                secs = perplexity(model, text, chunks, threads, nll, spec)
                test = read_nll_dump_file(nll)
                d = paired_delta_ppl(base.nll, test.nll, base.chunk)
                st = parse_cache_stats(stats.read_text())
                assert st.shadow is not None, "no shadow object in the stats"
                r = {"cell": cell, "model": name, "residency": f, "slots": slots, "policy": pol, "spec": spec,
                     "text": str(text.relative_to(ROOT)), "chunks": chunks, "threads": threads,
                     "seconds": round(secs, 1),
                     "measured": {"delta_pct": d.delta_pct, "low": d.low, "high": d.high, "n_tokens": d.n_tokens},
                     "shadow": st.as_dict()["shadow"], "hit_rate": st.hit_rate,
                     "substituted_mass": st.substituted_mass}
                with results.open("a") as fh:
                    fh.write(json.dumps(r) + "\n")
                sh = r["shadow"]
                print(f"{cell}: measured {d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}], estimate "
                      f"{sh['dppl_pct']:+.2f}% [{sh['dppl_pct_low']:+.2f}, {sh['dppl_pct_high']:+.2f}] ({secs:.0f} s)",
                      flush=True)
                rows.append(r)
    return rows


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
    rows = run_cells(a.out.resolve(), a.text.resolve(), a.chunks, a.threads)
    (a.out / "report.md").write_text(report(rows))
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
