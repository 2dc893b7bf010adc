"""Per-token negative log-likelihoods written by the patched llama-perplexity (`--nll-dump PATH`).

TODO(nll-dump): the dump format is not documented yet (docs/expert-cache.md). Until it is, `read_nll_dump`
raises instead of guessing; the quality comparison then reports perplexities without paired deltas.
`NllData` is the shape the rest of the harness consumes: one NLL per scored token and the chunk each
token belongs to (for the block bootstrap).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from harness.errors import HarnessError


@dataclass(frozen=True, eq=False)
class NllData:
    nll: npt.NDArray[np.float64]  # one per scored token, in order
    chunk: npt.NDArray[np.int64]  # chunk index of each token

    def __post_init__(self) -> None:
        if self.nll.shape != self.chunk.shape or self.nll.ndim != 1:
            raise HarnessError(f"NLL data: {self.nll.shape} NLLs but {self.chunk.shape} chunk ids")


def read_nll_dump(data: bytes) -> NllData:
    raise HarnessError("reading --nll-dump files is not implemented yet: the dump format is not documented "
                       "(docs/expert-cache.md); paired delta-PPL is unavailable")
