"""The full-scale tiers benchmark (scripts/bench_tiers.py --full-scale, issue 23): its pure parts.

- `text_sequences`: the distinct token sequences the decode runs are measured on (seeded, non-overlapping slices
  of a real text, teacher-forced at ubatch 1), one per round;
- `expert_read_spans`: the disk probe's reads, the engine's own pattern (one expert's slice of one expert tensor,
  the 4 KiB-aligned span around it, at random experts), and `Floors`/`floors`: a run's floor from its bytes read per
  token, the disk's bandwidth in that pattern and the compute time with every expert in RAM, serial (I/O then
  compute) and overlapped (the larger of the two); `depth_scaled_compute_ms`: that compute time, measured on
  shallower models of the same layer shape, at the benchmark's depth;
- `rotated_trace`: a router trace whose every layer starts elsewhere, so that replayed runs of distinct rounds see
  distinct routing (the replay starts each process at the same records);
- the raw record of one run (`run_record`, `check_run_record`: schema RUN_SCHEMA, version RUN_SCHEMA_VERSION) and
  the summary rows computed from records only (`summarize_runs`), so that every figure can be recomputed from the
  committed records;
- `--pack` (issue 23 item 4): `record_read_spans`, the disk probe's reads of whole-expert records of the expert pack
  (the engine's pattern with a pack), and `pack_verdict`, the rule that judges one read per expert against three
  reads at the same policy (PACK_TARGET, written beside it);
- prefetch (issue 23 item 3): `prefetch_pairs`, each `P,prefetch=on` row with its row `P`, and `prefetch_verdict`,
  the rule that says whether prefetch pays on the file tier (written before any run).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.core.errors import HarnessError
from harness.domain.pack import PackLayout
from harness.parsers.trace import ExpertTrace
from harness.stats.intervals import mean_ci, ratio_ci

RUN_SCHEMA = "moe-subst/bench-tiers-run"
RUN_SCHEMA_VERSION = 1
DIRECT_ALIGN = 4096  # the engine's O_DIRECT alignment (src/llama/llama-expert-io)

# ------------------------------------------------------------------------------------------------------------------
# sequences


def text_sequences(text: str, n: int, n_chars: int, seed: int) -> tuple[str, ...]:
    """`n` distinct slices of `n_chars` characters of `text`, at seeded random non-overlapping places (whole slots
    of n_chars), in the order drawn. HarnessError when the text is too short for n of them,
    or when two slices are equal (a text that repeats itself)."""
    if n < 1 or n_chars < 1:
        raise HarnessError(f"sequences: need n >= 1 and n_chars >= 1, got {n} and {n_chars}")
    slots = len(text) // n_chars
    if slots < n:
        raise HarnessError(f"the text has {len(text)} characters: too short for {n} distinct sequences of {n_chars} "
                           "characters; give a longer --text, fewer rounds or a shorter --ctx")
    picked = random.Random(seed).sample(range(slots), n)
    out = [text[s * n_chars:(s + 1) * n_chars] for s in picked]
    if len(set(out)) != len(out):
        raise HarnessError("the text repeats itself: two of the sequences drawn from it are equal; give another text")
    return tuple(out)


# ------------------------------------------------------------------------------------------------------------------
# the disk probe and the floors


@dataclass(frozen=True)
class ExpertSlices:
    """One routed-expert tensor in the file: where its data starts, its experts' stride and how many there are."""

    name: str
    offset: int
    stride: int  # bytes of one expert's slice (the engine's read size for this tensor)
    n_expert: int


def expert_read_spans(tensors: Sequence[ExpertSlices], n: int, seed: int, align: int = DIRECT_ALIGN
                      ) -> list[tuple[int, int]]:
    """`n` reads of the engine's pattern: a random tensor, a random expert of it, the `align`-aligned span around
    that expert's slice (offset, length), as the engine's O_DIRECT reads are."""
    if not tensors:
        raise HarnessError("the model has no routed-expert tensors to read")
    rng = random.Random(seed)
    spans: list[tuple[int, int]] = []
    for _ in range(n):
        t = tensors[rng.randrange(len(tensors))]
        e = rng.randrange(t.n_expert)
        start = t.offset + e * t.stride
        lo = start - start % align
        hi = -(-(start + t.stride) // align) * align
        spans.append((lo, hi - lo))
    return spans


@dataclass(frozen=True)
class Floors:
    """A run's floor per token (ms): the I/O (its bytes read per token over the disk's bandwidth in the engine's
    pattern) and the compute with every expert in RAM; serial = both, one after the other; overlapped = the larger."""

    io_ms: float
    compute_ms: float

    @property
    def serial_ms(self) -> float:
        return self.io_ms + self.compute_ms

    @property
    def overlapped_ms(self) -> float:
        return max(self.io_ms, self.compute_ms)

    @property
    def serial_ts(self) -> float:
        return 1000.0 / self.serial_ms if self.serial_ms > 0 else math.inf

    @property
    def overlapped_ts(self) -> float:
        return 1000.0 / self.overlapped_ms if self.overlapped_ms > 0 else math.inf


def floors(read_bytes_per_token: float, disk_bytes_per_s: float, compute_ms: float) -> Floors:
    if disk_bytes_per_s <= 0 or not math.isfinite(disk_bytes_per_s):
        raise HarnessError(f"a floor needs a positive disk bandwidth, not {disk_bytes_per_s}")
    if read_bytes_per_token < 0 or compute_ms < 0:
        raise HarnessError("a floor needs bytes per token and a compute time >= 0")
    return Floors(1000.0 * read_bytes_per_token / disk_bytes_per_s, compute_ms)


def depth_scaled_compute_ms(points: Sequence[tuple[int, float]], n_layers: int) -> tuple[float, str]:
    """The compute time per token at `n_layers` layers from measurements (layers, ms per token) on shallower models
    of the same layer shape, by the median at each depth: with two or more depths a least-squares line through the
    medians (a fixed part, the embeddings and the output head, plus a cost per layer), extrapolated; with one depth,
    or a line that does not rise (noise), proportional to the deepest depth (an upper bound, since the fixed part is
    then counted once per layer). Returns (ms, how it was scaled, in words)."""
    if not points or any(d < 1 or ms <= 0 or not math.isfinite(ms) for d, ms in points):
        raise HarnessError(f"compute measurements need depths >= 1 and finite times > 0, got {list(points)}")
    depths = sorted({d for d, _ in points})
    med = {d: float(np.median([m for dd, m in points if dd == d])) for d in depths}
    deepest = depths[-1]
    proportional = (med[deepest] * n_layers / deepest,
                    f"{med[deepest]:.2f} ms/token (median) at {deepest} layers x {n_layers}/{deepest} (proportional "
                    "to depth)")
    if len(depths) == 1:
        return proportional
    slope, fixed = np.polyfit(np.array(depths, dtype=np.float64), np.array([med[d] for d in depths]), 1)
    if slope <= 0:
        ms, how = proportional
        return ms, how + f"; the line through the medians at {', '.join(map(str, depths))} layers did not rise"
    ms = float(fixed + slope * n_layers)
    return ms, (f"a line through the medians at {', '.join(str(d) for d in depths)} layers: {fixed:.2f} ms fixed + "
                f"{slope:.3f} ms per layer, at {n_layers} layers")


# ------------------------------------------------------------------------------------------------------------------
# replay


def rotated_trace(trace: ExpertTrace, part: int, parts: int) -> ExpertTrace:
    """`trace` with each layer's records rotated to start `part`/`parts` of the way through them (file positions of
    the layers kept): round `part` of `parts` replays routing no other round replays first."""
    if not 0 <= part < parts:
        raise HarnessError(f"rotated_trace: part {part} of {parts}")
    rec = trace.records.copy()
    layers = trace.records["layer"]
    for layer in np.unique(layers):
        idx = np.flatnonzero(layers == layer)
        shift = (len(idx) * part) // parts
        rec[idx] = trace.records[np.roll(idx, -shift)]
    from dataclasses import replace

    return replace(trace, records=rec)


# ------------------------------------------------------------------------------------------------------------------
# records

_RUN_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema": str, "schema_version": int, "config": str, "kind": str, "round": int, "spec": (str, type(None)),
    "readahead_kb": (int, type(None)), "replay": (str, type(None)), "n_ctx": int, "warmup_chunks": int,
    "chunk_ts": list, "chunk_read_bytes": list, "read_bytes_all": (int, type(None)), "tokens_all": int,
    "engine": (dict, type(None)), "disk": dict, "error": (str, type(None)),
}
ENGINE_KEYS = ("tokens", "calls", "hits", "misses", "fetches", "substitutions", "admissions", "hit_rate",
               "substitution_rate", "fetches_per_token", "file_reads", "file_read_bytes", "file_read_ns",
               "copied_experts", "slots", "pack_reads", "pack_read_bytes", "pack", "fetch_wait_ns", "prefetches",
               "prefetch_used", "prefetch_wasted", "prefetch_dropped", "prefetch_cancelled", "prefetch_late",
               "prefetch_waits", "prefetch_wait_ns")


def engine_counters(stats: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The engine's counters a run record keeps (ENGINE_KEYS) from its statistics JSON (`stats=`): the totals and
    the engine object, not the per-layer arrays (48 layers of them would not be small)."""
    if stats is None:
        return None
    total = stats.get("total", {})
    eng = stats.get("engine", {})
    cfg = stats.get("config", {})
    out: dict[str, Any] = {}
    for k in ENGINE_KEYS:
        v = total.get(k, eng.get(k, cfg.get(k)))
        if v is not None:
            out[k] = v
    return out


def run_record(*, config: str, kind: str, round_: int, spec: str | None, readahead_kb: int | None,
               replay: str | None, n_ctx: int, warmup_chunks: int, chunk_ts: Sequence[float],
               chunk_read_bytes: Sequence[int], read_bytes_all: int | None, tokens_all: int,
               engine: Mapping[str, Any] | None, disk: Mapping[str, Any], error: str | None = None) -> dict[str, Any]:
    """One run's raw record: the t/s of every measured chunk (a distinct sequence of n_ctx tokens, after
    `warmup_chunks`), the process's storage reads (/proc/PID/io read_bytes) in each and over all chunks, the engine's
    counters, the disk figures of the round. `kind`: decode, compute (in RAM, no limit) or load (none)."""
    rec = {"schema": RUN_SCHEMA, "schema_version": RUN_SCHEMA_VERSION, "config": config, "kind": kind,
           "round": round_, "spec": spec, "readahead_kb": readahead_kb, "replay": replay, "n_ctx": n_ctx,
           "warmup_chunks": warmup_chunks, "chunk_ts": [float(x) for x in chunk_ts],
           "chunk_read_bytes": [int(x) for x in chunk_read_bytes], "read_bytes_all": read_bytes_all,
           "tokens_all": tokens_all, "engine": dict(engine) if engine is not None else None, "disk": dict(disk),
           "error": error}
    check_run_record(rec)
    return rec


def check_run_record(rec: Mapping[str, Any]) -> None:
    """HarnessError naming the first problem of a run record: another schema or version, a missing key or one of
    the wrong type, samples that are not finite and positive, per-chunk lists of different lengths."""
    if rec.get("schema") != RUN_SCHEMA or rec.get("schema_version") != RUN_SCHEMA_VERSION:
        raise HarnessError(f"not a {RUN_SCHEMA} record of version {RUN_SCHEMA_VERSION}: "
                           f"{rec.get('schema')!r} {rec.get('schema_version')!r}")
    for k, t in _RUN_KEYS.items():
        if k not in rec:
            raise HarnessError(f"a run record without {k!r}")
        if not isinstance(rec[k], t) or (t is int and isinstance(rec[k], bool)):
            raise HarnessError(f"a run record's {k!r} is {type(rec[k]).__name__}")
    if rec["kind"] not in ("decode", "compute"):
        raise HarnessError(f"a run record of kind {rec['kind']!r}")
    ts, rb = rec["chunk_ts"], rec["chunk_read_bytes"]
    if any(not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0 for x in ts):
        raise HarnessError(f"a run record's chunk_ts are not all finite and > 0: {ts}")
    if rb and len(rb) != len(ts):
        raise HarnessError(f"a run record has {len(ts)} chunk_ts and {len(rb)} chunk_read_bytes")
    if rec["error"] is None and not ts:
        raise HarnessError("a run record without an error and without samples")


# ------------------------------------------------------------------------------------------------------------------
# the summary


@dataclass(frozen=True)
class TierRow:
    config: str
    n: int  # measured sequences
    mean_ts: float
    ci95: float  # half width of the 95% CI (Student t) over the sequences
    vs_stock: dict[str, tuple[float, float, float]]  # stock config -> (ratio, low, high), bootstrap 95%
    engine_bytes_per_token: float | None  # the engine's file_read_bytes / tokens (all chunks of its runs)
    process_bytes_per_token: float  # /proc/PID/io read_bytes over the measured chunks / their tokens
    hit_rate: float | None
    substitution_rate: float | None
    floors: Floors | None  # from the engine's bytes (the process's for stock)
    error: str | None = None


def summarize_runs(records: Sequence[Mapping[str, Any]], disk_bytes_per_s: float, compute_ms: float,
                   stock_configs: Sequence[str], disk_by_config: Mapping[str, float] | None = None) -> list[TierRow]:
    """One row per decode config, in the order first seen, from its run records only. disk_by_config: the disk
    bandwidth of configs that read in another pattern (the expert pack's rows: whole-expert records).
    stock_configs: the rows every other row is compared with (ratio of mean t/s), each only with rows of its own
    routing: the stock rows with the model's own, MMAP_REPLAY_ROW with the replayed rows."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        if r.get("kind") == "decode":
            by.setdefault(str(r["config"]), []).append(r)
    samples = {c: [float(x) for r in rs for x in r["chunk_ts"]] for c, rs in by.items()}
    rows: list[TierRow] = []

    def replayed(config: str) -> bool:
        return " (replay)" in config
    for c, rs in by.items():
        xs = samples[c]
        errors = [str(r["error"]) for r in rs if r.get("error")]
        if not xs:
            rows.append(TierRow(c, 0, math.nan, math.nan, {}, None, math.nan, None, None, None,
                                errors[0] if errors else "no samples"))
            continue
        ci = mean_ci(xs)
        vs: dict[str, tuple[float, float, float]] = {}
        for s in stock_configs:  # a ratio only between rows of the same routing (the model's own, or replayed)
            if samples.get(s) and s != c and replayed(s) == replayed(c):
                rc = ratio_ci(xs, samples[s])
                vs[s] = (rc.ratio, rc.low, rc.high)
        tokens = sum(len(r["chunk_ts"]) * int(r["n_ctx"]) for r in rs)
        pbytes = sum(sum(int(b) for b in r["chunk_read_bytes"]) for r in rs)
        # an emulate row's counters are its emulated cache's, not reads: its I/O is the process's
        engines = [r["engine"] for r in rs
                   if r.get("engine") and not str(r.get("spec") or "").startswith("mode=emulate")]
        eb: float | None = None
        hit = sub = None
        if engines:
            etok = sum(int(e.get("tokens", 0)) for e in engines)
            if etok:
                eb = sum(int(e.get("file_read_bytes", 0)) for e in engines) / etok
            hit = float(np.mean([float(e["hit_rate"]) for e in engines if "hit_rate" in e])) if any(
                "hit_rate" in e for e in engines) else None
            sub = float(np.mean([float(e["substitution_rate"]) for e in engines if "substitution_rate" in e])) if any(
                "substitution_rate" in e for e in engines) else None
        per_tok = pbytes / tokens if tokens else math.nan
        bw = (disk_by_config or {}).get(c, disk_bytes_per_s)
        fl = floors(eb if eb is not None else per_tok, bw, compute_ms) if math.isfinite(
            eb if eb is not None else per_tok) else None
        rows.append(TierRow(c, len(xs), ci.mean, ci.half_width, vs, eb, per_tok, hit, sub, fl,
                            errors[0] if errors else None))
    return rows


def better_stock(rows: Sequence[TierRow], stock_configs: Sequence[str]) -> str | None:
    """The stock config with the higher mean t/s: the headline ratio's denominator."""
    cands = [r for r in rows if r.config in stock_configs and r.n > 0]
    return max(cands, key=lambda r: r.mean_ts).config if cands else None


# ------------------------------------------------------------------------------------------------------------------
# one read per expert (--pack)

# --replay-trace: stock's I/O path under the replayed routing (stock cannot replay): the patched build in emulate mode
# with fetch-all, every routed expert computed from the mapping as stock computes it
MMAP_REPLAY_ROW = "mmap, emulate fetch-all (replay)"

PACK_ROW = " (pack)"  # the expert pack's row of a policy: "<policy> (pack)", beside "<policy>" (three reads)
# The target (issue 23): one read per expert at least 1.2x the t/s of three reads at the same policy and residency,
# where the disk is latency-bound; else the measured reason it is not.
PACK_TARGET = 1.2


def record_read_spans(layout: PackLayout, n: int, seed: int) -> list[tuple[int, int]]:
    """`n` reads of the engine's pattern with an expert pack: a random layer, a random expert, its whole record
    (aligned: one O_DIRECT read)."""
    if not layout.layers:
        raise HarnessError("the expert pack has no layers to read")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        la = layout.layers[rng.randrange(len(layout.layers))]
        out.append((la.first_record + rng.randrange(layout.n_expert) * la.record_bytes, la.record_bytes))
    return out


@dataclass(frozen=True)
class PackVerdict:
    policy: str
    three_ts: float
    pack_ts: float
    ratio: tuple[float, float, float] | None  # pack / three reads, t/s, with its bootstrap 95% CI
    slice_bps: float  # the disk probe in the three-read pattern (one expert slice per read)
    record_bps: float  # ... and in the pack's (one whole expert per read)
    io_share: float | None  # the three-read row's I/O floor / its serial floor
    bound: float | None  # the most one read per expert can gain from the probes: 1 / ((1 - s) + s * slice / record)
    verdict: str


def pack_verdict(policy: str, three: Sequence[float], pack: Sequence[float], slice_bps: float, record_bps: float,
                 io_share: float | None) -> PackVerdict:
    """The rule for one read per expert against three reads at the same policy (both rows' t/s samples over the
    same distinct sequences, interleaved in the same rounds):

    - met: the mean t/s ratio pack / three >= PACK_TARGET (1.2x); "conclusive" when its 95% CI's low end is too;
    - not met, with the measured reason: the disk probes say what one read per expert can gain at most: the I/O part
      of the three-read row's serial floor (io_share, s) shrinks by the ratio of the probes' bandwidths (the disk is
      latency-bound when whole-expert reads run faster than slice reads), bound = 1 / ((1 - s) + s x slice/record).
      A bound below 1.2x is the reason (the disk is not latency-bound enough here, or I/O is too small a part);
      a bound at or above 1.2x with a measured ratio below it is a miss the probes do not explain (said as such).
    """
    if not three or not pack:
        return PackVerdict(policy, math.nan, math.nan, None, slice_bps, record_bps, io_share, None,
                           "not measured (a row without samples)")
    rc = ratio_ci(list(pack), list(three))
    ratio = (rc.ratio, rc.low, rc.high)
    t3, tp = float(np.mean(three)), float(np.mean(pack))
    speedup = record_bps / slice_bps if slice_bps > 0 else math.nan
    bound = None
    if io_share is not None and math.isfinite(speedup) and speedup > 0:
        bound = 1.0 / ((1.0 - io_share) + io_share / speedup)
    ci = f"{rc.ratio:.2f}x [95% CI {rc.low:.2f}, {rc.high:.2f}]"
    if rc.ratio >= PACK_TARGET:
        sure = "conclusive" if rc.low >= PACK_TARGET else f"not conclusive: the CI reaches below {PACK_TARGET}x"
        verdict = f"met: one read per expert is {ci} three reads ({sure})"
    elif bound is not None and bound < PACK_TARGET:
        verdict = (f"not met ({ci}); the probes bound the gain at {bound:.2f}x: whole-expert reads ran at "
                   f"{record_bps / 1e6:.0f} MB/s, slice reads at {slice_bps / 1e6:.0f} MB/s ({speedup:.2f}x: "
                   f"{'not latency-bound' if speedup < PACK_TARGET else 'latency-bound'}), and I/O is "
                   f"{100 * (io_share or 0):.0f}% of the three-read serial floor")
    else:
        why = (f"the probes allow up to {bound:.2f}x (reads {speedup:.2f}x faster, I/O {100 * (io_share or 0):.0f}% "
               "of the serial floor)" if bound is not None else "no probe bound (no I/O share)")
        verdict = f"not met ({ci}), unexplained by the probes: {why}"
    return PackVerdict(policy, t3, tp, ratio, slice_bps, record_bps, io_share, bound, verdict)


# ------------------------------------------------------------------------------------------------------------------
# prefetch on the file tier (issue 23 item 3)

PREFETCH_KEYS = ("prefetch", "prefetch_max")  # the spec keys that make a policy entry the prefetch row of another


def prefetch_pairs(configs: Sequence[str]) -> list[tuple[str, str]]:
    """(P, P with prefetch) for every config entry with `prefetch=on` whose entry without the prefetch keys
    (`prefetch=`, `prefetch_max=`) is a config too, in the order of the configs: "quality,prefetch=on" pairs with
    "quality", "quality,tau_file=0.3,prefetch=on,prefetch_max=2" with "quality,tau_file=0.3"."""
    present = set(configs)
    out = []
    for c in configs:
        name, suffix = c, ""  # a row's suffix (" (pack)", " (replay)") pairs with the same suffix
        if c.endswith(")") and " (" in c:
            name, suffix = c[:c.rindex(" (")], c[c.rindex(" ("):]
        items = name.split(",")
        if "prefetch=on" not in items[1:]:
            continue
        base = ",".join(it for it in items if "=" not in it or it.partition("=")[0] not in PREFETCH_KEYS) + suffix
        if base in present and base != c:
            out.append((base, c))
    return out


def prefetch_counts(records: Sequence[Mapping[str, Any]], config: str) -> str:
    """What a prefetch row's engine did per token, summed over its decode records: prefetches, the share used,
    dropped and late ones, waits for a started prefetch read (ms), the fetches' wait (ms)."""
    keys = ("tokens", "prefetches", "prefetch_used", "prefetch_dropped", "prefetch_late", "prefetch_waits",
            "prefetch_wait_ns", "fetch_wait_ns")
    tot = dict.fromkeys(keys, 0)
    for r in records:
        if r.get("kind") == "decode" and r.get("config") == config and r.get("engine"):
            for k in keys:
                tot[k] += int(r["engine"].get(k, 0) or 0)
    n = tot["tokens"]
    if n <= 0:
        return "-"
    used = f"{100 * tot['prefetch_used'] / tot['prefetches']:.0f}%" if tot["prefetches"] else "-"
    return (f"{tot['prefetches'] / n:.1f} prefetches/token, {used} used, {tot['prefetch_dropped'] / n:.1f} dropped "
            f"and {tot['prefetch_late'] / n:.1f} late/token, {tot['prefetch_waits'] / n:.1f} waits/token "
            f"({tot['prefetch_wait_ns'] / n / 1e6:.1f} ms), fetch wait {tot['fetch_wait_ns'] / n / 1e6:.1f} ms/token")


@dataclass(frozen=True)
class PrefetchVerdict:
    policy: str
    prefetch: str  # the row with prefetch
    off_ts: float
    on_ts: float
    ratio: tuple[float, float, float] | None  # with / without prefetch, t/s, with its bootstrap 95% CI
    verdict: str


def prefetch_verdict(policy: str, prefetch: str, off: Sequence[float], on: Sequence[float]) -> PrefetchVerdict:
    """The rule for prefetch on the file tier (written before any run; docs/expert-cache-engine.md): both rows' decode
    t/s samples over the same distinct sequences, interleaved in the same rounds; ratio = mean t/s with prefetch /
    mean t/s without, with a bootstrap 95% CI over the sequences.

    - pays: the ratio and the CI's low end are above 1;
    - loses: the CI's high end is below 1;
    - otherwise not distinguishable from prefetch off at this sample (the CI contains 1).
    """
    if not off or not on:
        return PrefetchVerdict(policy, prefetch, math.nan, math.nan, None, "not measured (a row without samples)")
    rc = ratio_ci(list(on), list(off))
    ci = f"{rc.ratio:.2f}x [95% CI {rc.low:.2f}, {rc.high:.2f}]"
    if rc.ratio > 1.0 and rc.low > 1.0:
        verdict = f"pays: {ci} the t/s without prefetch"
    elif rc.high < 1.0:
        verdict = f"loses: {ci} the t/s without prefetch"
    elif not (math.isfinite(rc.low) and math.isfinite(rc.high)):
        verdict = f"not decided: {rc.ratio:.2f}x, no CI (fewer than 2 samples in a row)"
    else:
        verdict = f"not distinguishable: {ci} (the CI contains 1)"
    return PrefetchVerdict(policy, prefetch, float(np.mean(off)), float(np.mean(on)), (rc.ratio, rc.low, rc.high),
                           verdict)


def file_tier_spec(policy: str, slots: str, pack: str = "off") -> str:
    """The engine's spec on the file tier for a policy item of the benchmark: a preset name, optionally with more
    keys ("quality,tau_file=0.3"). pack: off (three reads per expert, whatever lies next to the model) or the expert
    pack's path (one read)."""
    name, _, more = policy.partition(",")
    return f"mode=engine,policy={name},slots={slots},host=file,pack={pack}" + (f",{more}" if more else "")
