#!/usr/bin/env python3
"""The held-out texts without their near-duplicates of training documents (issue 36, item 3: bits per byte with and
without them).

A held-out document is never a training document (scripts/build_corpus.py splits by path), but some are generated
from the same template as training files: Python's codec tables (encodings/cp*.py: 256 lines of `'\\xNN' # 0xNN ->
NAME` that differ in a few names), charmaps, licence variants. A model scores those at a fraction of a bit per byte,
which lifts the average of the whole text. Here a document is a near-duplicate when at least NEAR_DUP of its lines
(stripped, at least MIN_LINE characters; shorter lines are too common to mean anything) occur verbatim in the
training corpus. Writes, per text, `<text>-nodup.txt` (the other documents, joined as in the text) and
`<text>-nodup.json` (each document's line overlap and whether it was kept):

    .venv/bin/python scripts/heldout_nodup.py [--corpus ~/.cache/moe-subst/studymoe/train.jsonl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ("heldout", "heldout-docs")
NEAR_DUP = 0.5
MIN_LINE = 16


def _key(line: str) -> bytes:
    return hashlib.blake2b(line.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def training_lines(corpus: Path) -> set[bytes]:
    seen: set[bytes] = set()
    with corpus.open(encoding="utf-8") as f:
        for row in f:
            for line in json.loads(row)["text"].splitlines():
                s = line.strip()
                if len(s) >= MIN_LINE:
                    seen.add(_key(s))
    return seen


def overlap(doc: str, seen: set[bytes]) -> tuple[float, int]:
    lines = [s for s in (ln.strip() for ln in doc.splitlines()) if len(s) >= MIN_LINE]
    if not lines:
        return 0.0, 0
    return sum(_key(s) in seen for s in lines) / len(lines), len(lines)


def split_documents(text: str, sources: list[dict]) -> list[str]:
    """The documents of a held-out text, by the lengths in its sources file (joined by one newline)."""
    docs, pos = [], 0
    for s in sources:
        docs.append(text[pos:pos + s["chars"]])
        pos += s["chars"] + 1
    if pos - 1 != len(text):
        raise SystemExit(f"heldout_nodup.py: error: the sources' lengths ({pos - 1}) do not add up to the text "
                         f"({len(text)} characters)")
    return docs


def main() -> int:
    cache = Path(os.environ.get("MOE_SUBST_CACHE") or Path.home() / ".cache/moe-subst")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=cache / "studymoe/train.jsonl",
                    help="the training corpus, JSON lines of {text} (scripts/build_corpus.py --corpus study)")
    ap.add_argument("--data", type=Path, default=ROOT / "eval/data")
    args = ap.parse_args()
    if not args.corpus.is_file():
        print(f"heldout_nodup.py: error: no training corpus at {args.corpus} (scripts/build_corpus.py --corpus study)",
              file=sys.stderr)
        return 1
    seen = training_lines(args.corpus)
    for name in TEXTS:
        text = (args.data / f"{name}.txt").read_text(encoding="utf-8")
        sources = json.loads((args.data / f"{name}-sources.json").read_text())
        docs = split_documents(text, sources)
        rows, kept = [], []
        for s, doc in zip(sources, docs, strict=True):
            share, n = overlap(doc, seen)
            keep = share < NEAR_DUP
            rows.append({**s, "lines": n, "line_overlap": round(share, 4), "kept": keep})
            if keep:
                kept.append(doc)
        out = "\n".join(kept)
        (args.data / f"{name}-nodup.txt").write_text(out, encoding="utf-8")
        dropped = [r for r in rows if not r["kept"]]
        summary = {"rule": f"a document is left out when >= {NEAR_DUP:g} of its lines of >= {MIN_LINE} characters "
                           "occur verbatim in the training corpus",
                   "corpus": args.corpus.name, "documents": len(rows), "left_out": len(dropped),
                   "chars": len(text), "chars_kept": len(out), "documents_detail": rows}
        (args.data / f"{name}-nodup.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"{name}: {len(dropped)} of {len(rows)} documents left out "
              f"({len(text) - len(out):,} of {len(text):,} characters): "
              + ", ".join(Path(r["source"]).name for r in dropped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
