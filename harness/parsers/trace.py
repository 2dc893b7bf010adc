"""Router traces of the expert cache (`trace=PATH` in the cache spec; format: docs/expert-cache.md).

`read_expert_trace` reads a trace (header + numpy structured records); around it, what the simulator and its
tests need: the header alone, a writer (the exact byte layout the engine writes, so traces round-trip),
decode order, counts of the recorded actions, and synthetic traces with a skewed, drifting expert popularity
for benchmarks of `llama-moe-sim`.

The header's first reserved words (offset 40, uint64) hold the fingerprint of the model the trace was recorded on
(harness.parsers.gguf_model.model_fingerprint; docs/expert-cache.md; the engine computes the same in
llama-expert-fingerprint.cpp), 0 where the writer gave none (traces written before the engine wrote it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError
from harness.core.files import read_file_bytes, refuse_special

__all__ = [
    "ExpertTrace", "TraceHeader", "RecordedActions", "read_expert_trace", "read_trace_header",
    "write_expert_trace", "decode_order", "recorded_actions", "synthetic_trace",
]

TRACE_MAGIC = b"MOETRACE"
TRACE_VERSION = 2  # 2: + pred[k], the previous MoE layer's prediction (prefetch); version 1 is still read
TRACE_VERSIONS = (1, 2)
TRACE_HEADER_SIZE = 64
TRACE_FINGERPRINT_OFFSET = 40  # uint64 in the first two reserved words: the model's fingerprint, 0 for none
MAX_EXPERTS = 1 << 16  # far above any model's experts per layer (llama.cpp: LLAMA_MAX_EXPERTS)

ACTION_HIT = 0
ACTION_FETCH = 1
ACTION_SUBSTITUTE = 2
ACTION_DROP = 3  # a dropped miss, or a selection skipped by rule=ser
ACTION_HOST = 4  # computed on the host with the missed expert (light=host)


@dataclass(frozen=True, eq=False)
class ExpertTrace:
    version: int
    n_layer: int
    n_expert: int
    k: int
    top_m: int
    n_slots: int
    # fields: layer, token, ids[k], weights[k], used[k], action[k], top_ids, top_score; version 2: pred[k] (-1: none)
    records: npt.NDArray[np.void]
    fingerprint: int = 0  # of the model it was recorded on (model_fingerprint); 0: none

    @property
    def has_pred(self) -> bool:
        """Whether the records carry the prefetch prediction (version 2)."""
        return self.version >= 2


def trace_dtype(k: int, top_m: int, version: int = TRACE_VERSION) -> np.dtype[np.void]:
    pad = (k + 3) // 4 * 4
    fields: list[tuple[str, str] | tuple[str, str, tuple[int, ...]]] = [
        ("layer", "<u4"), ("token", "<u4"),
        ("ids", "<i4", (k,)), ("weights", "<f4", (k,)), ("used", "<i4", (k,)), ("action", "u1", (pad,)),
    ]
    if top_m:
        fields += [("top_ids", "<i4", (top_m,)), ("top_score", "<f4", (top_m,))]
    if version >= 2:
        fields.append(("pred", "<i4", (k,)))
    return np.dtype(fields)  # packed, little-endian


def _check_version(path: str | Path, version: int, hsize: int) -> None:
    if version not in TRACE_VERSIONS or hsize != TRACE_HEADER_SIZE:
        raise HarnessError(f"{path}: trace version {version} (header {hsize} bytes); this reader knows versions "
                           f"{', '.join(map(str, TRACE_VERSIONS))}")


def _check_shape(path: str | Path, n_layer: int, n_expert: int, k: int, top_m: int, rsize: int,
                 version: int = TRACE_VERSION) -> None:
    """A header whose shape cannot be a trace's (a damaged file): one line, before any record layout is built."""
    if not (n_layer >= 1 and 1 <= k <= n_expert <= MAX_EXPERTS and top_m <= n_expert):
        raise HarnessError(f"{path}: damaged trace header (n_layer={n_layer}, n_expert={n_expert}, k={k}, "
                           f"top_m={top_m}; expected 1 <= k <= n_expert <= {MAX_EXPERTS}, top_m <= n_expert)")
    want = 8 + 12 * k + (k + 3) // 4 * 4 + 8 * top_m + (4 * k if version >= 2 else 0)
    if rsize != want:
        raise HarnessError(f"{path}: record size {rsize} does not match version {version}, k={k}, top_m={top_m} "
                           f"({want})")


def read_expert_trace(path: str | Path) -> ExpertTrace:
    data = read_file_bytes(path, "the trace")
    if len(data) < TRACE_HEADER_SIZE or data[:8] != TRACE_MAGIC:
        raise HarnessError(f"{path}: not an expert-cache router trace (no {TRACE_MAGIC!r} header)")
    version, hsize, n_layer, n_expert, k, top_m, rsize, n_slots = struct.unpack_from("<8I", data, 8)
    (fingerprint,) = struct.unpack_from("<Q", data, TRACE_FINGERPRINT_OFFSET)
    _check_version(path, version, hsize)
    _check_shape(path, n_layer, n_expert, k, top_m, rsize, version)
    dt = trace_dtype(k, top_m, version)
    body = len(data) - hsize
    if body % rsize:
        raise HarnessError(f"{path}: truncated trace ({body} bytes of records, not a multiple of {rsize})")
    records = np.frombuffer(data, dtype=dt, offset=hsize)
    _check_records(path, records, n_layer, n_expert, top_m)
    return ExpertTrace(version, n_layer, n_expert, k, top_m, n_slots, records, fingerprint)


def _check_records(path: str | Path, rec: npt.NDArray[np.void], n_layer: int, n_expert: int, top_m: int) -> None:
    """The checks llama-moe-sim makes (src/tools/moe-sim): layers and expert ids in range, finite gate weights
    (>= 0) and router scores; the first bad record is named."""
    checks: list[tuple[npt.NDArray[np.bool_], str]] = [
        (rec["layer"] >= n_layer, f"a layer >= n_layer {n_layer}"),
        (np.any((rec["ids"] < 0) | (rec["ids"] >= n_expert), axis=1), f"an expert id outside [0, {n_expert})"),
        (np.any(~np.isfinite(rec["weights"]) | (rec["weights"] < 0), axis=1), "a gate weight not finite or < 0"),
    ]
    if top_m:
        checks += [(np.any((rec["top_ids"] < 0) | (rec["top_ids"] >= n_expert), axis=1),
                    f"a top expert id outside [0, {n_expert})"),
                   (np.any(~np.isfinite(rec["top_score"]), axis=1), "a router score that is not finite")]
    if "pred" in (rec.dtype.names or ()):
        checks.append((np.any((rec["pred"] < -1) | (rec["pred"] >= n_expert), axis=1),
                       f"a predicted expert id outside [-1, {n_expert})"))
    for bad, what in checks:
        if bad.any():
            i = int(np.argmax(bad))
            raise HarnessError(f"{path}: damaged trace: record {i} has {what}")


@dataclass(frozen=True)
class TraceHeader:
    version: int
    n_layer: int  # all layers of the model (record layer ids index these)
    n_expert: int
    k: int  # experts per token
    top_m: int  # router scores per record
    record_size: int
    n_slots: int  # slots per layer of the recorded run
    n_records: int  # token-layers
    fingerprint: int = 0  # of the model it was recorded on (gguf_model.model_fingerprint); 0: none

    @property
    def file_size(self) -> int:
        return TRACE_HEADER_SIZE + self.n_records * self.record_size


def read_trace_header(path: str | Path) -> TraceHeader:
    """The header and the record count, without reading the records (cheap on large traces)."""
    p = Path(path)
    refuse_special(p, "the trace")
    try:
        with p.open("rb") as f:
            head = f.read(TRACE_HEADER_SIZE)
        size = p.stat().st_size
    except OSError as e:
        raise HarnessError(f"cannot read the trace {path}: {e.strerror or e}") from None
    if len(head) < 8 or head[:8] != TRACE_MAGIC:
        raise HarnessError(f"{path}: not an expert-cache router trace (no {TRACE_MAGIC!r} header)")
    if len(head) < TRACE_HEADER_SIZE:
        raise HarnessError(f"{path}: truncated trace header ({len(head)} bytes)")
    version, hsize, n_layer, n_expert, k, top_m, rsize, n_slots = struct.unpack_from("<8I", head, 8)
    (fingerprint,) = struct.unpack_from("<Q", head, TRACE_FINGERPRINT_OFFSET)
    _check_version(path, version, hsize)
    _check_shape(path, n_layer, n_expert, k, top_m, rsize, version)
    body = size - TRACE_HEADER_SIZE
    if body % rsize:
        raise HarnessError(f"{path}: truncated trace ({body} bytes of records, not a multiple of {rsize})")
    return TraceHeader(version, n_layer, n_expert, k, top_m, rsize, n_slots, body // rsize, fingerprint)


def header_of(trace: ExpertTrace) -> TraceHeader:
    return TraceHeader(trace.version, trace.n_layer, trace.n_expert, trace.k, trace.top_m,
                       trace.records.dtype.itemsize, trace.n_slots, len(trace.records), trace.fingerprint)


def write_expert_trace(path: str | Path, trace: ExpertTrace) -> Path:
    """Write `trace` in the engine's byte layout (its version, 1 or 2): `read_expert_trace` gives it back
    unchanged."""
    if trace.version not in TRACE_VERSIONS:
        raise HarnessError(f"trace version {trace.version}: this writer knows versions "
                           f"{', '.join(map(str, TRACE_VERSIONS))}")
    dt = trace_dtype(trace.k, trace.top_m, trace.version)
    if trace.records.dtype != dt:
        raise HarnessError(f"trace records have dtype {trace.records.dtype}, not the version-{trace.version} layout "
                           f"for k={trace.k}, top_m={trace.top_m}")
    if not 0 <= trace.fingerprint < 1 << 64:
        raise HarnessError(f"trace fingerprint {trace.fingerprint} is not a uint64")
    header = TRACE_MAGIC + struct.pack("<8IQ4I", trace.version, TRACE_HEADER_SIZE, trace.n_layer, trace.n_expert,
                                       trace.k, trace.top_m, dt.itemsize, trace.n_slots, trace.fingerprint,
                                       0, 0, 0, 0)
    assert len(header) == TRACE_HEADER_SIZE
    out = Path(path)
    with out.open("wb") as f:
        f.write(header)
        f.write(np.ascontiguousarray(trace.records).tobytes())
    return out


def decode_order(trace: ExpertTrace) -> npt.NDArray[np.void]:
    """The records sorted by (token, layer): the order a decoder meets them (the file is in decision order,
    layer by layer within a ubatch)."""
    order = np.lexsort((trace.records["layer"], trace.records["token"]))
    return trace.records[order]


@dataclass(frozen=True)
class RecordedActions:
    """What the recorded run decided, counted from the trace's action bytes."""

    token_layers: int
    calls: int
    hits: int
    fetches: int
    substitutions: int
    drops: int
    subst_mass_sum: float  # sum of the gate weights of substituted experts
    host_computes: int = 0


def recorded_actions(trace: ExpertTrace) -> RecordedActions:
    k = trace.k
    act = trace.records["action"][:, :k]
    w = trace.records["weights"].astype(np.float64)
    sub = act == ACTION_SUBSTITUTE
    return RecordedActions(
        token_layers=len(trace.records), calls=int(act.size),
        hits=int((act == ACTION_HIT).sum()), fetches=int((act == ACTION_FETCH).sum()),
        substitutions=int(sub.sum()), drops=int((act == ACTION_DROP).sum()),
        subst_mass_sum=float((w * sub).sum()), host_computes=int((act == ACTION_HOST).sum()))


def synthetic_trace(*, n_layer: int, n_expert: int, k: int, n_tokens: int, top_m: int = 16, n_slots: int = 0,
                    zipf: float = 1.0, topic_every: int = 256, seed: int = 0) -> ExpertTrace:
    """A router trace with the statistics of a real one, for benchmarks and tests of the simulator: per
    layer, expert popularity follows a Zipf law over a random permutation that changes every `topic_every`
    tokens (a topic change); router logits are log-popularity plus Gumbel noise, so the top k are a draw
    without replacement by popularity; gate weights are the softmax over the selected, normalised; scores
    the softmax probabilities of the top_m. Records are in decode order (token by token, layer by layer).
    Actions are not decided (all hits, used = selected): replaying is what the simulator is for. Version 2, with no
    prefetch prediction (pred = -1)."""
    if not (1 <= k <= n_expert and 0 <= top_m <= n_expert and n_layer >= 1 and n_tokens >= 0):
        raise HarnessError(f"bad synthetic trace shape: n_layer={n_layer}, n_expert={n_expert}, k={k}, "
                           f"top_m={top_m}, n_tokens={n_tokens}")
    rng = np.random.default_rng(seed)
    dt = trace_dtype(k, top_m)
    rec = np.zeros(n_tokens * n_layer, dtype=dt)
    rec["pred"] = -1
    base = -zipf * np.log(np.arange(1, n_expert + 1, dtype=np.float64))
    n_topics = max(1, -(-n_tokens // max(1, topic_every)))
    for il in range(n_layer):
        perms = np.stack([rng.permutation(n_expert) for _ in range(n_topics)])
        topic = np.arange(n_tokens) // max(1, topic_every)
        logp = np.empty((n_tokens, n_expert))
        logp[np.arange(n_tokens)[:, None], perms[topic]] = base  # expert perm[i] gets the i-th popularity
        logits = (logp + rng.gumbel(size=(n_tokens, n_expert))).astype(np.float32)
        order = np.argsort(-logits, axis=1, kind="stable")
        sel = order[:, :k].astype(np.int32)
        sel_l = np.take_along_axis(logits, sel, axis=1).astype(np.float64)
        w = np.exp(sel_l - sel_l.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        full = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
        probs = (full / full.sum(axis=1, keepdims=True)).astype(np.float32)
        idx = np.arange(n_tokens) * n_layer + il
        rec["layer"][idx] = il
        rec["token"][idx] = np.arange(n_tokens, dtype=np.uint32)
        rec["ids"][idx] = sel
        rec["weights"][idx] = w.astype(np.float32)
        rec["used"][idx] = sel
        if top_m:
            # by score descending, ties lowest id (as the engine writes them)
            top = np.lexsort((np.broadcast_to(np.arange(n_expert), probs.shape), -probs), axis=1)[:, :top_m]
            rec["top_ids"][idx] = top.astype(np.int32)
            rec["top_score"][idx] = np.take_along_axis(probs, top, axis=1)
    return ExpertTrace(TRACE_VERSION, n_layer, n_expert, k, top_m, n_slots, rec)
