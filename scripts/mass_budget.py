#!/usr/bin/env python3
"""Which summary of a token's lost gate weight predicts the loss, and rule=budget against rule=threshold at equal
fetches (issue 37 item 3; rules: eval/mass-budget/RULES.md).

Per cell (model x residency x policy): one llama-perplexity run of the patched build in emulate mode with `shadow=1`
and a router trace; per model one run of the full model (cache off). From the trace, per token (summed over its MoE
layers): S1 the lost gate weight (substituted + dropped), S2 its sum of squares, S3 the lost selections weighing
>= 0.15; S4 the shadow KL. Appends a JSON line per cell to OUT/results.jsonl (resumable; traces are deleted after
their summaries), then writes OUT/report.md with the verdicts.

    .venv/bin/python scripts/mass_budget.py --out eval/mass-budget
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import ppl_cells  # noqa: E402

from harness.parsers.cache_stats import parse_cache_stats  # noqa: E402
from harness.parsers.nll_dump import read_nll_dump_file  # noqa: E402
from harness.parsers.trace import ACTION_DROP, ACTION_SUBSTITUTE, read_expert_trace  # noqa: E402
from harness.stats.intervals import paired_delta_ppl  # noqa: E402

MODELS = ("tinymoe-f16.gguf", "studymoe-q8_0.gguf", "localmoe-q8_0.gguf")
FRACTIONS = (0.125, 0.25)
POLICIES = tuple(
    [f"rule=threshold,tau={t},admit=0.5" for t in (0.03, 0.05, 0.08, 0.1, 0.15, 0.25)]
    + ["rule=first-choice,admit=0.5"]
    + [f"rule=budget,mass={m},admit=0.5" for m in (0.05, 0.1, 0.2, 0.3, 0.5)]
    + [f"rule=zero,tau={t}" for t in (0.05, 0.1, 0.2)])
PPL = ppl_cells.PPL
HEAVY = 0.15


def summaries(trace_path: Path) -> dict[str, float]:
    """S1-S3 per token (summed over MoE layers), averaged over tokens."""
    tr = read_expert_trace(trace_path)
    rec = tr.records
    act = rec["action"][:, : tr.k]
    w = rec["weights"].astype(np.float64)
    lost = (act == ACTION_SUBSTITUTE) | (act == ACTION_DROP)
    lw = np.where(lost, w, 0.0)
    n_tokens = len(np.unique(rec["token"]))
    return {"s1_mass": float(lw.sum() / n_tokens), "s2_sq": float((lw ** 2).sum() / n_tokens),
            "s3_heavy": float((lost & (w >= HEAVY)).sum() / n_tokens), "tokens": n_tokens}


def measure(cell: ppl_cells.Cell, work: Path, text: Path, chunks: int, threads: int) -> dict:
    """One cell: emulate with shadow=1 and a router trace; the paired delta, fetches, the four summaries (the trace
    and the cell's NLL dump are deleted once reduced: the full model's dump stays)."""
    nll, stats, trace = work / f"{cell.tag}.nll", work / f"{cell.tag}.stats.json", work / f"{cell.tag}.trace"
    spec = f"mode=emulate,{cell.policy},evict=lfu,slots={cell.slots},shadow=1,stats={stats},trace={trace}"
    secs = ppl_cells.perplexity(cell.model, text, chunks, threads, nll, spec, who="mass_budget")
    d = paired_delta_ppl(cell.base.nll, read_nll_dump_file(nll).nll, cell.base.chunk)
    st = parse_cache_stats(stats.read_text())
    assert st.shadow is not None
    summ = summaries(trace)
    trace.unlink()
    nll.unlink()
    print(f"{cell.name}: {d.delta_pct:+.2f}% fetches {st.fetches_per_token:.2f} S1 {summ['s1_mass']:.3f} "
          f"S2 {summ['s2_sq']:.4f} S3 {summ['s3_heavy']:.3f} KL {st.shadow.kl:.5f} ({secs:.0f} s)", flush=True)
    return {"spec": spec, "seconds": round(secs, 1),
            "measured": {"delta_pct": d.delta_pct, "low": d.low, "high": d.high},
            "fetches_per_token": st.fetches_per_token, "hit_rate": st.hit_rate,
            **summ, "s4_kl": st.shadow.kl, "shadow": st.as_dict()["shadow"]}


def pearson(x: list[float], y: list[float]) -> float:
    return float(np.corrcoef(np.asarray(x), np.asarray(y))[0, 1])


def budget_wins(rows: list[dict]) -> list[tuple[str, int, int, bool]]:
    out = []
    for name in MODELS:
        for f in FRACTIONS:
            cell = [r for r in rows if r["model"] == name and r["residency"] == f]
            thr = sorted((r["fetches_per_token"], r["measured"]["delta_pct"]) for r in cell
                          if r["policy"].startswith("rule=threshold"))
            xs, ys = [p[0] for p in thr], [p[1] for p in thr]
            compared = won = 0
            for r in cell:
                if not r["policy"].startswith("rule=budget"):
                    continue
                x = r["fetches_per_token"]
                if not xs[0] <= x <= xs[-1]:
                    continue
                compared += 1
                won += r["measured"]["delta_pct"] < float(np.interp(x, xs, ys))
            out.append((f"{name} {f * 100:g}%", compared, won, compared > 0 and won * 2 > compared))
    return out


def report(rows: list[dict]) -> str:
    y = [r["measured"]["delta_pct"] for r in rows]
    keys = {"S1 lost mass": "s1_mass", "S2 sum of squares": "s2_sq", "S3 heavy count": "s3_heavy", "S4 KL": "s4_kl"}
    pooled = {k: pearson([r[v] for r in rows], y) for k, v in keys.items()}
    within = {k: {m: pearson([r[v] for r in rows if r["model"] == m], [r["measured"]["delta_pct"] for r in rows
                                                                          if r["model"] == m]) for m in MODELS}
              for k, v in keys.items()}
    weight = {k: pooled[k] for k in list(keys)[:3]}
    best = max(weight, key=lambda k: weight[k])
    wins = budget_wins(rows)
    n_won = sum(w[3] for w in wins)
    lines = ["# Lost gate weight, the loss, and the budget rule", "",
             "Rules: RULES.md (committed before the runs). Records: results.jsonl. Reproduce: "
             "`.venv/bin/python scripts/mass_budget.py --out eval/mass-budget`.", "",
             "| summary | r pooled (90 cells) | r tinymoe | r studymoe | r localmoe |", "|---|---|---|---|---|"]
    for k in keys:
        lines.append(f"| {k} | {pooled[k]:.3f} | " + " | ".join(f"{within[k][m]:.3f}" for m in MODELS) + " |")
    lines += ["", "| model x residency | budget points compared | below threshold's curve | budget wins |",
              "|---|---|---|---|"]
    lines += [f"| {c} | {n} | {w} | {'yes' if ok else 'no'} |" for c, n, w, ok in wins]
    lines += ["", "## Verdicts", "",
              f"1. Best weight summary across models: {best}, r = {weight[best]:.3f} (rule: >= 0.9): "
              f"**{'held' if weight[best] >= 0.9 else 'did not hold'}**.",
              f"2. The shadow KL across models: r = {pooled['S4 KL']:.3f} (rule: >= 0.95): "
              f"**{'held' if pooled['S4 KL'] >= 0.95 else 'did not hold'}**.",
              f"3. Budget beats threshold at equal fetches in {n_won} of {len(wins)} pairs (rule: >= 5): "
              f"**{'held' if n_won >= 5 else 'did not hold'}**.", "",
              "| cell | delta-PPL% [95% CI] | fetches/token | S1 | S2 | S3 | S4 KL |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured"]
        lines.append(f"| {r['cell']} | {m['delta_pct']:+.2f} [{m['low']:+.2f}, {m['high']:+.2f}] | "
                     f"{r['fetches_per_token']:.2f} | {r['s1_mass']:.3f} | {r['s2_sq']:.4f} | {r['s3_heavy']:.3f} | "
                     f"{r['s4_kl']:.5f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "eval/mass-budget")
    ap.add_argument("--text", type=Path, default=ROOT / "eval/data/heldout.txt")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if not PPL.exists():
        raise SystemExit(f"mass_budget: {PPL} is not built: run ./build.sh")
    text_path = a.text.resolve()
    rows = ppl_cells.run_cells(a.out.resolve(), text_path, a.chunks, a.threads, MODELS, FRACTIONS, POLICIES,
                               lambda c, w: measure(c, w, text_path, a.chunks, a.threads), who="mass_budget")
    text = report(rows)
    (a.out / "report.md").write_text(text)
    print("\n".join(text.splitlines()[:30]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
