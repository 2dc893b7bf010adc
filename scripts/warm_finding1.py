#!/usr/bin/env python3
"""Finding 1b from warm starts on each stand-in (docs/study-verdicts.md, "Warm starts"): reads the sweeps that
scripts/finish_localmoe.sh records in eval/study-warm/<model> (fetch-all, the 0.15 rule, substitute-all; every
cache from the calibration profile) and prints, per model, the regime (fetch-all's hit rate at the residency), S
(substitute-all against the full model), the rule against the full model, P (substitute-all against the rule) and
the verdict by the committed rule (P's CI low > S/2: held; P's CI high < S/2: did not hold; else inconclusive):

    .venv/bin/python scripts/warm_finding1.py eval/study-warm/studymoe eval/study-warm/localmoe

then, per domain of the text (code, prose, tables: harness study's split), S and the rule against the full model; a
folder with substitute-all alone (a sweep from another calibration text) gives its S per domain only.
A reader of the records, not a run: the NLL dumps (not committed) must be in <folder>/nll.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.domain.verdicts import above  # noqa: E402
from harness.parsers.nll_dump import read_nll_dump_file  # noqa: E402
from harness.stats.intervals import DeltaPPL, paired_delta_ppl  # noqa: E402

SAME_TOKENIZER = {"localmoe": "studymoe"}  # localmoe is studymoe trained on (models/localmoe.md)


def fmt(d: DeltaPPL) -> str:
    return f"{d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}]"


def row(folder: Path) -> str:
    recs = [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines() if x.strip()]
    ppl = {r["config"]: r for r in recs if r.get("kind") == "ppl"}

    def pick(prefix: str) -> dict:
        (rec,) = [r for c, r in ppl.items() if c.startswith(prefix)]
        return rec

    full, fa, rule, sa = pick("full"), pick("fetch-all"), pick("threshold tau=0.15"), pick("substitute-all")
    nll = {k: read_nll_dump_file(folder / "nll" / Path(r["nll_dump"]).name) for k, r in
           (("full", full), ("rule", rule), ("sa", sa))}
    s = paired_delta_ppl(nll["full"].nll, nll["sa"].nll, nll["full"].chunk)
    r = paired_delta_ppl(nll["full"].nll, nll["rule"].nll, nll["full"].chunk)
    p = paired_delta_ppl(nll["rule"].nll, nll["sa"].nll, nll["rule"].chunk)
    verdict = {True: "held", False: "did not hold", None: "inconclusive"}[above(p, s.delta_pct / 2)]
    meta = next(x for x in recs if x.get("kind") == "meta")
    model = Path(meta["options"]["model"]).name
    hit = fa["cache_stats"]["hit_rate"]
    return (f"| {model} | {hit:.3f} | {rule['cache_stats']['substitution_rate']:.1%} | "
            f"{sa['cache_stats']['substitution_rate']:.1%} | {fmt(s)} | {fmt(r)} | {fmt(p)} | {s.delta_pct / 2:+.2f} | "
            f"{verdict} | {s.n_tokens:,} |")


def domain_table(folder: Path) -> list[str]:
    from harness.orchestration.study_domains import study_domain_rows

    recs = [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines() if x.strip()]
    meta = next(x for x in recs if x.get("kind") == "meta")
    nll = {r["config"]: read_nll_dump_file(folder / "nll" / Path(r["nll_dump"]).name)
           for r in recs if r.get("kind") == "ppl"}
    key = {c.split(" ")[0]: c for c in nll}
    stem = Path(meta["options"]["model"]).name.split("-")[0]
    tok = ROOT / "models" / f"{SAME_TOKENIZER.get(stem, stem)}-tokenizer.json"
    pairs = [("S: substitute-all vs full", key["full"], key["substitute-all"])]
    if "threshold" in key:
        pairs.append(("the 0.15 rule vs full", key["full"], key["threshold"]))
    rows, why = study_domain_rows(Path(meta["options"]["text"]), tok if tok.is_file() else None, nll, pairs)
    if not rows:
        return [f"{folder}: {why}"]
    out = []
    for r in rows:
        cells = " | ".join(f"{d}: {fmt(x)}" if x is not None else f"{d}: -" for d, x in r.by_domain)
        out.append(f"| {Path(meta['options']['model']).name} | {r.comparison} | {fmt(r.whole)} | {cells} |")
    return out


def main() -> int:
    print("| model | fetch-all hit rate (warm, 25%) | 0.15 rule substitutes | substitute-all substitutes | S: "
          "substitute-all vs full | the 0.15 rule vs full | P: substitute-all vs the rule | S/2 | 1b | scored tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in sys.argv[1:]:
        if (Path(f) / "stats").is_dir() and any(Path(f, "stats").glob("threshold_*")):
            print(row(Path(f)))
    print()
    print("| model | comparison | whole text | per domain |")
    print("|---|---|---|---|")
    for f in sys.argv[1:]:
        print("\n".join(domain_table(Path(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
