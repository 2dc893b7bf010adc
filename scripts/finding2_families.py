"""Finding 2 by families (docs/study-verdicts.md, the rule written 2026-12-07 03:25 UTC) recomputed from a study
folder's committed sweep records and NLL dumps, for a study that ran before the rule was wired in and whose
build has changed since (so `harness study` will not resume it). Nothing is run.

    .venv/bin/python scripts/finding2_families.py eval/study-localmoe
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.core.records import ResultsFile
from harness.domain.verdicts import distinct_policies, family_mass, finding2_verdict
from harness.orchestration import study
from harness.orchestration.summary import load_nlls
from harness.orchestration.sweep import reload_sweep
from harness.parsers.nll_dump import read_nll_dump_file


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a `harness study --out` folder with a sweep/ part")
    args = ap.parse_args()
    s = reload_sweep(args.folder / "sweep")
    nll, _ = load_nlls(ResultsFile(s.results_path).read(), read_nll_dump_file)
    pts = study.mass_points(s.rows)
    v = finding2_verdict(family_mass(pts), study.admission_pairs(s.rows, nll, seed=0), distinct_policies(pts),
                         s.mass.correlation)
    outcome = "held" if v.held is True else "did not hold" if v.held is False else "inconclusive"
    print(f"- **{v.finding}: {outcome}.** {v.evidence}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
