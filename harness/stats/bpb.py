"""Bits per byte: a model's cross-entropy on a text per byte of that text, which models with different tokenizers
share (per token they do not: a tokenizer with longer tokens has a higher loss per token for the same model
quality). Pure functions of numbers.

bits per byte = sum(NLL of the scored tokens, in nats) / ln 2 / sum(bytes of the scored tokens).

The interval resamples whole chunks (llama-perplexity's context windows: tokens of a chunk share their context), as
`intervals.paired_delta_ppl` does: each bootstrap replicate draws as many chunks as there are, with replacement, and
recomputes the ratio of the sums (a percentile `level` CI, seeded; not one SE).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError

LN2 = math.log(2.0)


@dataclass(frozen=True)
class ChunkTotals:
    """Per chunk, in chunk order: the sum of the scored tokens' NLLs (nats), their bytes, and their count. The raw
    samples of a bits-per-byte figure: every statistic here is a function of them."""

    nll: tuple[float, ...]
    bytes: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class BitsPerByte:
    bpb: float
    low: float  # the `level` CI, block bootstrap over chunks; nan with one chunk
    high: float
    n_tokens: int
    n_bytes: int
    n_chunks: int
    nll_nats: float  # sum of the NLLs
    n_boot: int
    seed: int
    level: float = 0.95

    @property
    def kind(self) -> str:
        return f"{self.level * 100:g}% CI, block bootstrap over {self.n_chunks} chunks"

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / self.n_tokens

    @property
    def nats_per_token(self) -> float:
        return self.nll_nats / self.n_tokens

    @property
    def bits_per_token(self) -> float:
        return self.nats_per_token / LN2

    @property
    def ppl(self) -> float:
        """Perplexity per token, exp(mean NLL): what llama-perplexity's final estimate is."""
        return math.exp(self.nats_per_token)


def chunk_totals(nll: Sequence[float] | npt.NDArray[np.float64], n_bytes: Sequence[int] | npt.NDArray[np.int64],
                 chunk_ids: Sequence[int] | npt.NDArray[np.int64]) -> ChunkTotals:
    """Sum per-token NLLs and byte counts by chunk (`chunk_ids[i]`: the chunk of token i)."""
    x = np.asarray(nll, dtype=np.float64)
    b = np.asarray(n_bytes, dtype=np.int64)
    ids = np.asarray(chunk_ids, dtype=np.int64)
    if x.ndim != 1 or x.shape != b.shape or x.shape != ids.shape:
        raise HarnessError(f"per-token arrays differ in shape: nll {x.shape}, bytes {b.shape}, chunks {ids.shape}")
    if x.size == 0:
        raise HarnessError("no scored tokens")
    if not np.all(np.isfinite(x)):
        raise HarnessError("a per-token NLL is not finite (nan or inf): the run diverged")
    if np.any(b < 0):
        raise HarnessError("a negative byte count")
    _, inverse = np.unique(ids, return_inverse=True)
    sums = np.bincount(inverse, weights=x)
    nbytes = np.bincount(inverse, weights=b.astype(np.float64))
    counts = np.bincount(inverse)
    return ChunkTotals(tuple(float(v) for v in sums), tuple(int(round(v)) for v in nbytes),
                       tuple(int(v) for v in counts))


def bits_per_byte(totals: ChunkTotals, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> BitsPerByte:
    """Bits per byte of the scored tokens, with its block-bootstrap CI over chunks (module docstring)."""
    nll = np.asarray(totals.nll, dtype=np.float64)
    nbytes = np.asarray(totals.bytes, dtype=np.float64)
    tokens = np.asarray(totals.tokens, dtype=np.int64)
    if not (nll.shape == nbytes.shape == tokens.shape) or nll.ndim != 1 or nll.size == 0:
        raise HarnessError("bits per byte needs the same number (at least one) of chunk NLLs, bytes and tokens")
    total_bytes = float(nbytes.sum())
    if total_bytes <= 0:
        raise HarnessError("the scored tokens have no bytes (only control tokens?): bits per byte is undefined")
    total_nll = float(nll.sum())
    bpb = total_nll / LN2 / total_bytes
    n_chunks = int(nll.size)
    lo = hi = math.nan
    if n_chunks >= 2:
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, n_chunks, size=(n_boot, n_chunks))
        denom = nbytes[idx].sum(axis=1)
        boot = nll[idx].sum(axis=1) / LN2 / np.where(denom > 0, denom, np.nan)
        alpha = (1 - level) / 2
        lo, hi = (float(v) for v in np.nanquantile(boot, [alpha, 1 - alpha]))
    return BitsPerByte(bpb, lo, hi, int(tokens.sum()), int(round(total_bytes)), n_chunks, total_nll, n_boot, seed,
                       level)
