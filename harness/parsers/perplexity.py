"""llama-perplexity's text output (tools/perplexity/perplexity.cpp, function `perplexity`).

What it prints, in the pinned source:
- `LOG_INF("%s: calculating perplexity over %d chunks, n_ctx=%d, batch_size=%d, n_seq=%d\\n", ...)` (stderr)
- per chunk, default `--ppl-output-type 0`: `LOG("[%d]%.4lf,", i + 1, exp(nll / count))` (stdout): the
  *running* perplexity over the chunks so far, not the chunk's own;
  with `--ppl-output-type 1`: `LOG("%8d  %.4lf  %4lf  %4lf\\n", i*n_ctx, ppl, av, av2)`
- `LOG_INF("Final estimate: PPL = %.4lf +/- %.5lf\\n", ppl, nll2*ppl)` (stderr); the +/- is one standard
  error (the SE of the mean NLL, times PPL), not a confidence interval.
- too little text: `LOG_ERR("%s: you need at least %d tokens to evaluate perplexity with a context of %d\\n")`
  and `LOG_ERR("%s: the data file you provided tokenizes to only %zu tokens\\n")`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from harness.parsers.base import ParseError

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|nan|inf)"
_SETUP_RE = re.compile(
    r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)")
_RUNNING_RE = re.compile(r"\[(\d+)\](" + _NUM + "),")
_TYPE1_RE = re.compile(r"^\s*(\d+)  (" + _NUM + r")  (" + _NUM + r")  (" + _NUM + r")\s*$", re.MULTILINE)
_FINAL_RE = re.compile(r"Final estimate: PPL = (" + _NUM + r") \+/- (" + _NUM + ")")
_TOO_SHORT_RE = re.compile(r"you need at least (\d+) tokens to evaluate perplexity with a context of (\d+)")
_TOKENS_RE = re.compile(r"tokenizes to only (\d+) tokens")


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    ppl_se: float  # one standard error, as llama-perplexity prints it ("+/-")
    n_chunks: int
    n_ctx: int
    n_batch: int
    n_seq: int
    running_ppl: tuple[float, ...]  # running PPL after chunk 1..n, as printed

    @property
    def n_scored_tokens(self) -> int:
        """Tokens scored: the second half of every chunk, less one (perplexity.cpp: n_ctx - first - 1)."""
        return self.n_chunks * (self.n_ctx - self.n_ctx // 2 - 1)


def _float(s: str) -> float:
    return float(s.replace("-nan", "nan"))


def parse_perplexity(text: str) -> PerplexityResult:
    """Parse stdout and stderr of one llama-perplexity run (concatenated, in any order)."""
    short = _TOO_SHORT_RE.search(text)
    if short:
        have = _TOKENS_RE.search(text)
        raise ParseError(
            f"the text is too short: llama-perplexity needs at least {short.group(1)} tokens for a context "
            f"of {short.group(2)}" + (f", and the text has {have.group(1)}" if have else "")
            + "; pass a longer text or a smaller context", text, source="llama-perplexity")
    setup = _SETUP_RE.search(text)
    if not setup:
        raise ParseError("no 'calculating perplexity over N chunks' line (did the model load?)", text,
                         source="llama-perplexity")
    n_chunks, n_ctx, n_batch, n_seq = (int(g) for g in setup.groups())
    final = _FINAL_RE.search(text)
    if not final:
        raise ParseError("no 'Final estimate: PPL = ...' line (did the run finish?)", text,
                         source="llama-perplexity")
    running = [(int(m.group(1)), _float(m.group(2))) for m in _RUNNING_RE.finditer(text)]
    if not running:
        running = [(i + 1, _float(m.group(2))) for i, m in enumerate(_TYPE1_RE.finditer(text))]
    if [i for i, _ in running] != list(range(1, n_chunks + 1)):
        raise ParseError(f"expected running perplexities for chunks 1..{n_chunks}, found "
                         f"{[i for i, _ in running][:20]}", text, source="llama-perplexity")
    ppl = _float(final.group(1))
    if math.isfinite(ppl) and abs(running[-1][1] - ppl) > 1e-4 * max(1.0, ppl) + 1e-4:
        raise ParseError(f"the last running perplexity {running[-1][1]} disagrees with the final {ppl}", text,
                         source="llama-perplexity")
    return PerplexityResult(ppl, _float(final.group(2)), n_chunks, n_ctx, n_batch, n_seq,
                            tuple(v for _, v in running))
