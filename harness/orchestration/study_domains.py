"""Per-domain rows of `harness study` (docs/study-verdicts.md): each scored token placed in a domain of the text
(`<text>-sources.json`: each document's domain and length, joined by one newline) by its character position, with
the model's Hugging Face tokenizer checked against the tokens llama-perplexity scored (as `harness topics` does);
then the study's paired comparisons over each domain's tokens only."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError
from harness.domain.verdicts import DomainRow
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import DeltaPPL, paired_delta_ppl


def domain_ranges(sources: Sequence[dict[str, object]]) -> list[tuple[str, int, int]]:
    """(domain, first character, end) per run of documents of one domain, documents joined by one newline."""
    out: list[tuple[str, int, int]] = []
    pos = 0
    try:
        for i, d in enumerate(sources):
            n = int(str(d["chars"]))
            start = pos + (1 if i else 0)
            dom = str(d["domain"])
            if out and out[-1][0] == dom:
                out[-1] = (dom, out[-1][1], start + n)
            else:
                out.append((dom, start, start + n))
            pos = start + n
    except (KeyError, TypeError, ValueError) as e:
        raise HarnessError(f"the sources file is damaged ({type(e).__name__}: {e})") from None
    return out


def token_domains(positions: npt.NDArray[np.int64], offset: int, char_starts: Sequence[int],
                  ranges: Sequence[tuple[str, int, int]]) -> npt.NDArray[np.str_]:
    """The domain of each scored token: `positions` in llama.cpp's sequence, `offset` its BOS shift (topics.align),
    `char_starts` the tokenizer's character offset of each token."""
    starts = np.asarray(char_starts, dtype=np.int64)[positions - offset]
    ends = np.asarray([r[2] for r in ranges], dtype=np.int64)
    idx = np.minimum(np.searchsorted(ends, starts, side="left"), len(ranges) - 1)  # a separator: the domain before
    return np.asarray([r[0] for r in ranges])[idx]


def domain_rows(labels: npt.NDArray[np.str_], pairs: Sequence[tuple[str, NllDump, NllDump]], *, n_boot: int = 2000,
                seed: int = 0) -> tuple[DomainRow, ...]:
    """Per comparison (name, base, test): the whole text's paired delta and each domain's, over its tokens only."""
    domains = list(dict.fromkeys(labels.tolist()))
    out: list[DomainRow] = []
    for name, base, test in pairs:
        if base.nll.shape != labels.shape or test.nll.shape != labels.shape:
            continue
        whole = paired_delta_ppl(base.nll, test.nll, base.chunk, n_boot=n_boot, seed=seed)
        per: list[tuple[str, DeltaPPL | None]] = []
        for d in domains:
            m = labels == d
            per.append((d, paired_delta_ppl(base.nll[m], test.nll[m], base.chunk[m], n_boot=n_boot, seed=seed)
                        if m.sum() > 1 and len(np.unique(base.chunk[m])) > 1 else None))
        out.append(DomainRow(name, whole, tuple(per)))
    return tuple(out)


def study_domain_rows(text: Path, tokenizer: Path | None, nll: dict[str, NllDump],
                      pairs: Sequence[tuple[str, str, str]], *, seed: int = 0) -> tuple[tuple[DomainRow, ...], str]:
    """The rows for `pairs` (name, base config, test config) of `nll`, or ((), why not)."""
    from harness.core import project
    from harness.orchestration.topics import _default_tokenizer, _tokenize, align, scored_positions

    src = text.with_name(f"{text.stem}-sources.json")
    if not src.is_file():
        return (), f"no {src.name} beside the text: no domains"
    try:
        ranges = domain_ranges(json.loads(src.read_text()))
        tok = tokenizer or _default_tokenizer(project.project_root())
        ids, starts = _tokenize(tok, text.read_text())
        usable = [(n, nll[b], nll[t]) for n, b, t in pairs if b in nll and t in nll]
        if not usable or len(ranges) < 2:
            return (), "no NLL dumps to split" if not usable else "one domain only"
        dump = usable[0][1]
        labels = token_domains(scored_positions(dump), align(dump, ids), starts, ranges)
    except (HarnessError, ValueError) as e:
        return (), f"per-domain rows not computed: {e}"
    return domain_rows(labels, usable, seed=seed), ""
