#!/usr/bin/env python3
"""The degeneration rule on the held-out text's own continuations: a calibration of the model card's generation check
(issue 22). For each prompt of eval/data/gen-prompts-domains.jsonl (scripts/make_domain_prompts.py's rule), the next
48 tokens of its source document, tokenized with the model's tokenizer, judged by harness.stats.degeneration exactly
as a greedy generation is. A rule that flagged real text would blame the model for the text.

    .venv/bin/python scripts/reference_degeneration.py --tokenizer models/studymoe-tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import make_domain_prompts as mdp  # noqa: E402

from harness.stats.degeneration import loop_tail  # noqa: E402


def continuations(tok, n_tokens: int) -> list[tuple[str, list[int]]]:
    """(prompt id, the document's next n_tokens after the prompt), in the prompts file's order."""
    out = []
    for tag, text_name, manifest_name, per_kind in mdp.SOURCES:
        docs = mdp.documents((mdp.DATA / text_name).read_text(encoding="utf-8"),
                             json.loads((mdp.DATA / manifest_name).read_text()))
        for kind in mdp.KINDS:
            chosen = [d for dom, d in docs if dom == kind and len(d) >= mdp.MIN_DOC][:per_kind]
            for i, d in enumerate(chosen):
                rest = d[len(mdp.cut(d)):]
                out.append((f"{tag}-{kind}-{i + 1:02d}", tok.encode(rest, add_special_tokens=False).ids[:n_tokens]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="the model's tokenizer.json")
    ap.add_argument("--n-predict", type=int, default=48, help="tokens per continuation (harness generate's default)")
    args = ap.parse_args()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(args.tokenizer)
    rows = continuations(tok, args.n_predict)
    looped = [(pid, loop_tail(ids)) for pid, ids in rows if loop_tail(ids) is not None]
    print(f"{len(looped)} of {len(rows)} held-out continuations ({args.n_predict} tokens, {args.tokenizer}) end in a "
          f"loop by harness.stats.degeneration's rule" + "".join(f"\n- {pid}: period {lp.period}, span {lp.span}"
                                                                   for pid, lp in looped if lp is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
