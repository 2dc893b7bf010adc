"""Readers for the binary files the patched llama.cpp writes (formats: docs/expert-cache.md).

- `read_expert_trace`: the router trace of the expert cache (`trace=PATH` in LLAMA_MOE_CACHE).
- `read_nll_dump_file`: the per-token NLL dump of llama-perplexity (`--nll-dump PATH`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError

TRACE_MAGIC = b"MOETRACE"
TRACE_VERSION = 1
TRACE_HEADER_SIZE = 64

ACTION_HIT = 0
ACTION_FETCH = 1
ACTION_SUBSTITUTE = 2
ACTION_DROP = 3

NLL_MAGIC = b"LLNLLDMP"
NLL_VERSION = 1


@dataclass(frozen=True, eq=False)
class ExpertTrace:
    version: int
    n_layer: int
    n_expert: int
    k: int
    top_m: int
    n_slots: int
    records: npt.NDArray[np.void]  # fields: layer, token, ids[k], weights[k], used[k], action[k], top_ids, top_score


def trace_dtype(k: int, top_m: int) -> np.dtype[np.void]:
    pad = (k + 3) // 4 * 4
    fields: list[tuple[str, str] | tuple[str, str, tuple[int, ...]]] = [
        ("layer", "<u4"), ("token", "<u4"),
        ("ids", "<i4", (k,)), ("weights", "<f4", (k,)), ("used", "<i4", (k,)), ("action", "u1", (pad,)),
    ]
    if top_m:
        fields += [("top_ids", "<i4", (top_m,)), ("top_score", "<f4", (top_m,))]
    return np.dtype(fields)  # packed, little-endian


def read_expert_trace(path: str | Path) -> ExpertTrace:
    data = Path(path).read_bytes()
    if len(data) < TRACE_HEADER_SIZE or data[:8] != TRACE_MAGIC:
        raise HarnessError(f"{path}: not an expert-cache router trace (no {TRACE_MAGIC!r} header)")
    version, hsize, n_layer, n_expert, k, top_m, rsize, n_slots = struct.unpack_from("<8I", data, 8)
    if version != TRACE_VERSION or hsize != TRACE_HEADER_SIZE:
        raise HarnessError(f"{path}: trace version {version} (header {hsize} bytes); this reader knows version "
                           f"{TRACE_VERSION}")
    dt = trace_dtype(k, top_m)
    if dt.itemsize != rsize:
        raise HarnessError(f"{path}: record size {rsize} does not match k={k}, top_m={top_m} ({dt.itemsize})")
    body = len(data) - hsize
    if body % rsize:
        raise HarnessError(f"{path}: truncated trace ({body} bytes of records, not a multiple of {rsize})")
    records = np.frombuffer(data, dtype=dt, offset=hsize)
    return ExpertTrace(version, n_layer, n_expert, k, top_m, n_slots, records)


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
    data = Path(path).read_bytes()
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
