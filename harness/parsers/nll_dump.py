"""The per-token NLL dump of llama-perplexity (`--nll-dump PATH`, patched build; format: docs/expert-cache.md):
the scored tokens and their negative log-likelihoods, per chunk."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError
from harness.core.files import read_file_bytes

NLL_MAGIC = b"LLNLLDMP"
NLL_VERSION = 1


@dataclass(frozen=True, eq=False)
class NllDump:
    n_ctx: int
    first: int
    n_chunk: int
    tokens: npt.NDArray[np.int32]
    nll: npt.NDArray[np.float64]

    @property
    def chunk(self) -> npt.NDArray[np.int64]:
        per = self.n_ctx - self.first - 1
        return np.repeat(np.arange(self.n_chunk, dtype=np.int64), per)


def read_nll_dump_file(path: str | Path) -> NllDump:
    data = read_file_bytes(path, "the NLL dump")
    if len(data) < 32 or data[:8] != NLL_MAGIC:
        raise HarnessError(f"{path}: not a llama-perplexity NLL dump (no {NLL_MAGIC!r} header)")
    version, n_ctx, first, n_chunk = struct.unpack_from("<4I", data, 8)
    (count,) = struct.unpack_from("<Q", data, 24)
    if version != NLL_VERSION:
        raise HarnessError(f"{path}: NLL dump version {version}; this reader knows version {NLL_VERSION}")
    if count != n_chunk * (n_ctx - first - 1) or len(data) != 32 + 12 * count:
        raise HarnessError(f"{path}: inconsistent NLL dump ({count} values, {len(data)} bytes)")
    tokens = np.frombuffer(data, dtype="<i4", count=count, offset=32)
    nll = np.frombuffer(data, dtype="<f8", count=count, offset=32 + 4 * count)
    return NllDump(n_ctx, first, n_chunk, tokens, nll)
