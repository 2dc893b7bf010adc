#!/usr/bin/env python3
"""Build the training corpus and the held-out evaluation texts for the tiny MoE model.

Everything comes from files that a Debian 12 machine of this kind carries offline (see
eval/data/README for the exact sources and their licences). Three domains:

* ``code``   -- the CPython 3.11 standard library sources in /usr/lib/python3.11 (Debian's
               libpython3.11-stdlib / -minimal packages);
* ``prose``  -- English manual pages (sections 1, 3, 5, 7, 8, without the Google Cloud SDK pages)
               under /usr/share/man, turned into plain
               text by a small roff-macro stripper in this file, plus the licence texts in
               /usr/share/common-licenses;
* ``tables`` -- reference tables: glibc charmaps and locale sources under /usr/share/i18n, the tz
               database (tzdata.zi and the zone tables), /etc/services, Debian/Ubuntu release tables.

Each source file is one document. A document goes to the held-out set when a hash of its path says so
(bucket 0 of 20 -> heldout.txt, bucket 1 of 20 -> topic-shift.txt); everything else is training text.
The split depends only on the paths, so it is deterministic.

``--corpus study`` (the corpus of models/studymoe, the study's routing shape) adds, from Debian packages
that must be installed (``apt-get install python3.11-doc perl-doc git-doc postgresql-doc-15``):

* ``code``   -- also the Python packages in /usr/lib/python3/dist-packages and the Perl modules (*.pm)
               of /usr/share/perl/5.36;
* ``prose``  -- also the Python 3.11 documentation sources (reStructuredText, python3.11-doc), the Perl
               documentation (*.pod, perl-doc), Git's documentation (*.txt, git-doc) and the PostgreSQL
               15 manual (HTML turned into text, postgresql-doc-15); all English manual pages, not
               only the first 24 M characters.

It never rewrites heldout.txt or topic-shift.txt: their documents (by the manifests) and every bucket-0
and bucket-1 document of every source stay out of training, and a second held-out text is written,
``heldout-docs.txt``: bucket-0 documents of the new kinds of text (code and prose), which neither model
has seen, with its manifest ``heldout-docs-sources.json``.

Outputs (``--work`` directory, default build/tinymoe; ~/.cache/moe-subst/studymoe for ``--corpus study``):
    train.jsonl         one JSON object per training document: {"domain", "source", "text"}
and, in --eval-dir (default eval/data):
    heldout.txt, topic-shift.txt, topic-shift.json
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

PY_STDLIB = Path("/usr/lib/python3.11")
MAN_ROOT = Path("/usr/share/man")
MAN_SECTIONS = ("man1", "man3", "man5", "man7", "man8")
# the ~16,600 Google Cloud SDK pages are near-duplicates of each other; they are left out
MAN_EXCLUDE = ("gcloud", "bq", "gsutil")
LICENSES = Path("/usr/share/common-licenses")
TABLE_FILES = [
    Path("/usr/share/zoneinfo/tzdata.zi"),
    Path("/usr/share/zoneinfo/zone.tab"),
    Path("/usr/share/zoneinfo/zone1970.tab"),
    Path("/usr/share/zoneinfo/iso3166.tab"),
    Path("/etc/services"),
    Path("/usr/share/distro-info/debian.csv"),
    Path("/usr/share/distro-info/ubuntu.csv"),
]
CHARMAPS = Path("/usr/share/i18n/charmaps")
LOCALES = Path("/usr/share/i18n/locales")

# caps, in characters, so that the corpus stays balanced and fits the training budget
MAX_DOC_CHARS = 200_000
PROSE_BUDGET = 24_000_000
TABLES_BUDGET = 6_000_000

HELDOUT_TARGET_CHARS = {"code": 260_000, "prose": 260_000, "tables": 120_000}
TOPIC_SEGMENT_CHARS = 6_000
TOPIC_ORDER = ["code", "prose", "tables", "prose", "code", "tables", "code", "prose", "tables", "code",
               "prose", "tables"]


def bucket(path: str) -> int:
    return int(hashlib.sha1(path.encode()).hexdigest(), 16) % 20


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


# --- roff stripping -----------------------------------------------------------------------------

_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),   # font changes
    (re.compile(r"\\s[+-]?\d"), ""),                # size changes
    (re.compile(r"\\\((aq|cq)"), "'"),
    (re.compile(r"\\\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\((em|en|hy|mi)"), "-"),
    (re.compile(r"\\\(bu"), "*"),
    (re.compile(r"\\\(co"), "(c)"),
    (re.compile(r"\\\(..") , ""),
    (re.compile(r"\\\[[^\]]*\]"), ""),
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[e\\]"), "\\\\"),
    (re.compile(r"\\[&|^:%c]"), ""),
    (re.compile(r"\\ "), " "),
    (re.compile(r"\\[nk]\(?.."), ""),
    (re.compile(r"\\[hvwlLoXNZ]'[^']*'"), ""),
    (re.compile(r"\\\".*$"), ""),                  # comments
]
_TEXT_MACROS = {"SH", "SS", "B", "I", "SM", "SB", "IP", "TP", "Nm", "Sh", "Ss", "Nd", "Xr", "Fl",
                "Ar", "Pa", "Dq", "Sq", "Op", "It", "Em", "Cm", "Va", "Ev", "Fn", "Ft", "Dv"}
_ALT_MACROS = {"BR", "BI", "IB", "IR", "RB", "RI"}
_BREAK_MACROS = {"PP", "LP", "P", "TP", "IP", "SH", "SS", "Pp", "Sh", "Ss", "sp", "br"}


def _unescape(s: str) -> str:
    s = s.replace("\\\\", "\x00")
    for pat, rep in _ESCAPES:
        s = pat.sub(rep, s)
    return s.replace("\x00", "\\")


def _macro_args(rest: str) -> list[str]:
    out, cur, quoted = [], [], False
    for ch in rest.strip():
        if ch == '"':
            quoted = not quoted
        elif ch == " " and not quoted:
            if cur:
                out.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return out


_STRING_REF = re.compile(r"\\\*(\[[^\]]*\]|\(..|.)")


def strip_roff(src: str) -> str | None:
    lines = src.splitlines()
    strings: dict[str, str] = {}

    def interpolate(s: str) -> str:
        return _STRING_REF.sub(lambda m: strings.get(m.group(1).strip("[]("), ""), s)

    if lines and lines[0].startswith(".so "):
        return None  # alias page
    out: list[str] = []
    skip_until_dotdot = False
    skip_table = False
    for line in lines:
        if skip_until_dotdot:
            if line.startswith(".."):
                skip_until_dotdot = False
            continue
        if line.startswith((".de", ".ig", ".am")):
            skip_until_dotdot = True
            continue
        if line.startswith(".TS"):
            skip_table = True
            continue
        if line.startswith(".TE"):
            skip_table = False
            continue
        if skip_table:
            continue
        line = interpolate(line)
        if line.startswith((".", "'")):
            ds = re.match(r"[.']\s*ds\s+(\S+)\s+\"?(.*)", line)
            if ds:
                strings[ds.group(1)] = ds.group(2)
                continue
            m = re.match(r"[.'][ \t]*([A-Za-z]+)[ \t]*(.*)", line)
            if not m:
                continue
            name, rest = m.group(1), m.group(2)
            if name in _BREAK_MACROS and out and out[-1] != "":
                out.append("")
            if name in _TEXT_MACROS and rest:
                args = _macro_args(_unescape(rest))
                if name in ("SH", "Sh"):
                    out.append(" ".join(args).upper())
                elif name == "TP":
                    pass  # the argument is an indent; the tag is the next line
                elif name == "IP":
                    if args:
                        out.append(args[0])
                else:
                    out.append(" ".join(args))
            elif name in _ALT_MACROS and rest:
                out.append("".join(_macro_args(_unescape(rest))))
            continue
        out.append(_unescape(line).rstrip())
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text + "\n" if len(text) > 200 else None


# --- sources ------------------------------------------------------------------------------------

Doc = tuple[str, str, str]  # domain, source path, text


def code_docs() -> Iterator[Doc]:
    for p in sorted(PY_STDLIB.rglob("*.py")):
        if "site-packages" in p.parts or "dist-packages" in p.parts:
            continue
        text = read_text(p)[:MAX_DOC_CHARS]
        if len(text) > 200:
            yield "code", str(p), text


def prose_docs() -> Iterator[Doc]:
    for p in sorted(LICENSES.iterdir()):
        if p.is_file() and not p.is_symlink():
            yield "prose", str(p), read_text(p)
    paths = []
    for sec in MAN_SECTIONS:
        paths += [p for p in (MAN_ROOT / sec).iterdir()
                  if p.is_file() and not p.is_symlink() and not p.name.startswith(MAN_EXCLUDE)]
    # a deterministic shuffle, so that the budget is not spent on one alphabetical range
    paths.sort(key=lambda p: hashlib.sha1(str(p).encode()).hexdigest())
    used = 0
    for p in paths:
        text = strip_roff(read_text(p))
        if text is None:
            continue
        text = text[:MAX_DOC_CHARS]
        used += len(text)
        if used > PROSE_BUDGET:
            break
        yield "prose", str(p), text


def table_docs() -> Iterator[Doc]:
    for p in TABLE_FILES:
        if p.exists():
            yield "tables", str(p), read_text(p)
    paths = sorted(CHARMAPS.iterdir()) + sorted(LOCALES.iterdir())
    paths.sort(key=lambda p: hashlib.sha1(str(p).encode()).hexdigest())
    used = 0
    for p in paths:
        if not p.is_file():
            continue
        text = read_text(p)[:MAX_DOC_CHARS // 2]
        used += len(text)
        if used > TABLES_BUDGET:
            break
        yield "tables", str(p), text


def write_corpus_stats(work: Path, stats: dict[str, list[int]]) -> None:
    for domain, (n, c) in stats.items():
        print(f"train {domain}: {n} documents, {c} characters")
    (work / "corpus_stats.json").write_text(json.dumps(
        {d: {"documents": n, "characters": c} for d, (n, c) in stats.items()}, indent=1) + "\n")


REFRESH_EVAL = False  # --refresh-eval


def write_eval_text(path: Path, text: str) -> None:
    """Write an evaluation text, but never replace a different one silently: every committed figure was measured on
    the file as it is, and the same rule on another machine's Debian packages picks other bytes (postgresql-doc-15
    15.18 against 15.20 changed heldout-docs.txt). A different text goes to <path>.new with a one-line notice, unless
    --refresh-eval."""
    if path.exists() and not REFRESH_EVAL and path.read_text(encoding="utf-8") != text:
        new = path.with_name(path.name + ".new")
        new.write_text(text, encoding="utf-8")
        print(f"build_corpus: {path} differs from what this machine's packages give; kept it, wrote {new} "
              f"(--refresh-eval replaces it)", file=sys.stderr)
        return
    path.write_text(text, encoding="utf-8")


def write_held_out(docs: dict[str, list[Doc]], targets: dict[str, int], text_path: Path, sources_path: Path,
                   label: str) -> None:
    """Whole documents (each cut at 20k characters), in the order given, until each domain's target; the text and
    its manifest of sources."""
    parts: list[str] = []
    manifest = []
    for domain, target in targets.items():
        got = 0
        for _, src, text in docs[domain]:
            if got >= target:
                break
            t = text[:20_000].strip("\n") + "\n"
            parts.append(t)
            manifest.append({"domain": domain, "source": src, "chars": len(t)})
            got += len(t)
        print(f"{label} {domain}: {got} characters")
    before = text_path.read_text(encoding="utf-8") if text_path.exists() else None
    write_eval_text(text_path, "\n".join(parts))
    if before is None or text_path.read_text(encoding="utf-8") != before:  # the manifest goes with its text
        sources_path.write_text(json.dumps(manifest, indent=1) + "\n")


# --- the study corpus's extra sources (--corpus study) ---------------------------------------------

PY_DIST = Path("/usr/lib/python3/dist-packages")
PERL_LIB = Path("/usr/share/perl/5.36")
PY_DOC = Path("/usr/share/doc/python3.11/html/_sources")
PERL_POD = Path("/usr/share/perl/5.36/pod")
GIT_DOC = Path("/usr/share/doc/git-doc")
PG_DOC = Path("/usr/share/doc/postgresql-doc-15/html")
STUDY_PACKAGES = {PY_DOC: "python3.11-doc", PERL_POD: "perl-doc", GIT_DOC: "git-doc", PG_DOC: "postgresql-doc-15"}
STUDY_PROSE_BUDGET = 60_000_000
HELDOUT_DOCS_TARGET_CHARS = {"code": 150_000, "prose": 250_000}


def walk(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under root (symbolic links to folders followed, as /usr/share/perl/5.36 is one), sorted."""
    out = []
    for d, _, files in os.walk(root, followlinks=True):
        out += [Path(d) / f for f in files if f.endswith(suffixes)]
    return sorted(out)


class _HtmlText(html.parser.HTMLParser):
    """Visible text of an HTML page, a line break after each block element; navigation dropped."""

    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "pre", "dt", "dd", "table", "title"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        cls = dict(attrs).get("class") or ""
        if tag in ("script", "style") or (tag == "div" and cls in ("navheader", "navfooter")):
            self.skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self.skip and tag in ("script", "style", "div"):
            self.skip -= 1 if tag != "div" or self.skip else 0
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.skip:
            self.parts.append(data)


def html_text(src: str) -> str:
    p = _HtmlText()
    p.feed(src)
    text = "".join(p.parts)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def study_code_docs() -> Iterator[Doc]:
    yield from code_docs()
    for p in walk(PY_DIST, (".py",)):
        text = read_text(p)[:MAX_DOC_CHARS]
        if len(text) > 200:
            yield "code", str(p), text
    for p in walk(PERL_LIB, (".pm",)):
        text = read_text(p)[:MAX_DOC_CHARS]
        if len(text) > 200:
            yield "code", str(p), text


def study_prose_docs() -> Iterator[Doc]:
    global PROSE_BUDGET
    saved, PROSE_BUDGET = PROSE_BUDGET, STUDY_PROSE_BUDGET
    try:
        yield from prose_docs()
    finally:
        PROSE_BUDGET = saved
    for root, suffixes in ((PY_DOC, (".rst.txt",)), (PERL_POD, (".pod",)), (GIT_DOC, (".txt",))):
        for p in walk(root, suffixes):
            text = read_text(p)[:MAX_DOC_CHARS]
            if len(text) > 200:
                yield "prose", str(p), text
    for p in walk(PG_DOC, (".html",)):
        text = html_text(read_text(p))[:MAX_DOC_CHARS]
        if len(text) > 200:
            yield "prose", str(p), text


def build_study(work: Path, eval_dir: Path) -> int:
    missing = [f"{pkg} ({path})" for path, pkg in STUDY_PACKAGES.items() if not path.is_dir()]
    if missing:
        print("build_corpus.py: error: the study corpus needs these Debian packages: " + ", ".join(missing)
              + "; install them with apt-get install " + " ".join(STUDY_PACKAGES.values()), file=sys.stderr)
        return 2
    fixed = {d["source"] for d in json.loads((eval_dir / "heldout-sources.json").read_text())}
    for seg in json.loads((eval_dir / "topic-shift.json").read_text())["segments"]:
        fixed.update(seg["sources"])
    old_kinds = (str(PY_STDLIB), str(MAN_ROOT), str(LICENSES))
    work.mkdir(parents=True, exist_ok=True)
    stats: dict[str, list[int]] = {}
    held: dict[str, list[Doc]] = {"code": [], "prose": []}
    tmp = work / "train.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for gen in (study_code_docs, study_prose_docs, table_docs):
            for domain, src, text in gen():
                b = bucket(src)
                if src in fixed or b in (0, 1):
                    if b == 0 and src not in fixed and not src.startswith(old_kinds) and domain in held:
                        held[domain].append((domain, src, text))
                    continue
                f.write(json.dumps({"domain": domain, "source": src, "text": text}) + "\n")
                s = stats.setdefault(domain, [0, 0])
                s[0] += 1
                s[1] += len(text)
    tmp.replace(work / "train.jsonl")
    write_corpus_stats(work, stats)
    # heldout-docs.txt: whole bucket-0 documents of the new kinds, in SHA-1 order of their paths
    by_hash = {d: sorted(docs, key=lambda x: hashlib.sha1(x[1].encode()).hexdigest()) for d, docs in held.items()}
    write_held_out(by_hash, HELDOUT_DOCS_TARGET_CHARS, eval_dir / "heldout-docs.txt",
                   eval_dir / "heldout-docs-sources.json", "heldout-docs")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", choices=["tinymoe", "study"], default="tinymoe")
    ap.add_argument("--work", default=None, help="default build/tinymoe, or ~/.cache/moe-subst/studymoe (the "
                    "folder scripts/train_moe.py --shape studymoe uses) for --corpus study")
    ap.add_argument("--eval-dir", default="eval/data")
    ap.add_argument("--refresh-eval", action="store_true",
                    help="replace committed evaluation texts that differ (default: keep them, write <name>.new)")
    args = ap.parse_args()
    global REFRESH_EVAL
    REFRESH_EVAL = args.refresh_eval
    if args.work:
        work = Path(args.work)
    elif args.corpus == "study":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_moe import default_work
        work = default_work("studymoe")
    else:
        work = Path("build/tinymoe")
    eval_dir = Path(args.eval_dir)
    if args.corpus == "study":
        return build_study(work, eval_dir)
    work.mkdir(parents=True, exist_ok=True)
    eval_dir.mkdir(parents=True, exist_ok=True)

    held: dict[str, list[Doc]] = {"code": [], "prose": [], "tables": []}
    shift: dict[str, list[Doc]] = {"code": [], "prose": [], "tables": []}
    stats: dict[str, list[int]] = {}
    with open(work / "train.jsonl", "w", encoding="utf-8") as f:
        for gen in (code_docs, prose_docs, table_docs):
            for domain, src, text in gen():
                b = bucket(src)
                if b == 0:
                    held[domain].append((domain, src, text))
                elif b == 1:
                    shift[domain].append((domain, src, text))
                else:
                    f.write(json.dumps({"domain": domain, "source": src, "text": text}) + "\n")
                    s = stats.setdefault(domain, [0, 0])
                    s[0] += 1
                    s[1] += len(text)
    write_corpus_stats(work, stats)

    # heldout.txt: whole documents (truncated to 20k characters each) until each domain's target
    write_held_out(held, HELDOUT_TARGET_CHARS, eval_dir / "heldout.txt", eval_dir / "heldout-sources.json", "heldout")

    # topic-shift.txt: segments of ~TOPIC_SEGMENT_CHARS from bucket-1 documents, cut at line ends
    next_doc = {d: 0 for d in shift}
    text_parts: list[str] = []
    segments = []
    offset_chars = 0
    offset_bytes = 0
    for domain in TOPIC_ORDER:
        seg = ""
        sources = []
        while len(seg) < TOPIC_SEGMENT_CHARS:
            _, src, text = shift[domain][next_doc[domain]]
            next_doc[domain] += 1
            need = TOPIC_SEGMENT_CHARS - len(seg)
            piece = text[:need]
            if len(text) > need:
                cut = piece.rfind("\n")
                piece = piece[: cut + 1] if cut > 0 else piece + "\n"
            seg += piece.strip("\n") + "\n\n"
            sources.append(src)
        segments.append({
            "domain": domain,
            "char_start": offset_chars, "char_end": offset_chars + len(seg),
            "byte_start": offset_bytes, "byte_end": offset_bytes + len(seg.encode()),
            "sources": sources,
        })
        text_parts.append(seg)
        offset_chars += len(seg)
        offset_bytes += len(seg.encode())
    shift_text = "".join(text_parts)
    write_eval_text(eval_dir / "topic-shift.txt", shift_text)
    if (eval_dir / "topic-shift.txt").read_text(encoding="utf-8") == shift_text:  # its segments go with it
        (eval_dir / "topic-shift.json").write_text(json.dumps(
            {"schema_version": 1, "text": "topic-shift.txt", "segments": segments}, indent=1) + "\n")
    print(f"topic-shift: {len(segments)} segments, {offset_chars} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
