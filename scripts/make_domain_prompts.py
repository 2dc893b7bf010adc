#!/usr/bin/env python3
"""Write eval/data/gen-prompts-domains.jsonl: prompts of the kinds of text the trained models saw, from held-out
documents they never saw, for `harness generate --prompts` (greedy generations of a model card, issue 22).

Rule (deterministic, fixed before any model's generations were run): from eval/data/heldout.txt (the first 10 code
and the first 10 prose documents of its manifest, in manifest order) and eval/data/heldout-docs.txt (the first 6 of
each), skipping documents shorter than 600 characters; each prompt is the document's beginning cut after the last
newline within its first 300 characters (or at the last space when that leaves fewer than 100). Tables are left
out: their continuations are columns of numbers, which says little about a language model.

    python3 scripts/make_domain_prompts.py            # rewrites the file; --check: fail if it would change
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "eval/data"
OUT = DATA / "gen-prompts-domains.jsonl"
SOURCES = (("heldout", "heldout.txt", "heldout-sources.json", 10),
           ("docs", "heldout-docs.txt", "heldout-docs-sources.json", 6))
KINDS = ("code", "prose")
MIN_DOC, MAX_PROMPT, MIN_PROMPT = 600, 300, 100


def documents(text: str, manifest: list[dict]) -> list[tuple[str, str]]:
    """(domain, document) in manifest order: the text is the documents joined by one newline."""
    out, pos = [], 0
    for d in manifest:
        out.append((d["domain"], text[pos:pos + d["chars"]]))
        pos += d["chars"] + 1
    if pos - 1 != len(text):
        raise SystemExit(f"the manifest does not match the text ({pos - 1} != {len(text)} characters)")
    return out


def cut(doc: str) -> str:
    head = doc[:MAX_PROMPT]
    nl = head.rfind("\n")
    if nl + 1 >= MIN_PROMPT:
        return head[:nl + 1]
    sp = head.rfind(" ")
    return head[:sp] if sp >= MIN_PROMPT else head


def prompts() -> list[dict]:
    out = []
    for tag, text_name, manifest_name, per_kind in SOURCES:
        docs = documents((DATA / text_name).read_text(encoding="utf-8"),
                         json.loads((DATA / manifest_name).read_text()))
        for kind in KINDS:
            chosen = [d for dom, d in docs if dom == kind and len(d) >= MIN_DOC][:per_kind]
            out += [{"id": f"{tag}-{kind}-{i + 1:02d}", "kind": kind, "text": cut(d)} for i, d in enumerate(chosen)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file differs from the rule's")
    args = ap.parse_args()
    body = "".join(json.dumps(p) + "\n" for p in prompts())
    if args.check:
        same = OUT.is_file() and OUT.read_text() == body
        print(f"{OUT.relative_to(ROOT)}: {'up to date' if same else 'differs from the rule'}")
        return 0 if same else 1
    OUT.write_text(body)
    print(f"wrote {OUT.relative_to(ROOT)}: {body.count(chr(10))} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
