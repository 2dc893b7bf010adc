"""scripts/bench_tiers.py --full-scale (issue 23): its pure parts (harness.domain.tiers: floors, depth scaling,
sequences, read spans, trace rotation, the run record and the summary), the readahead guard on a fake sysfs tree,
the chunk-timed runner's parsing, and one end-to-end run on a tiny generated model (marker `build`, ~15 s)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.core.errors import HarnessError
from harness.domain.tiers import (
    MMAP_REPLAY_ROW,
    PACK_TARGET,
    RUN_SCHEMA,
    ExpertSlices,
    better_stock,
    check_run_record,
    depth_scaled_compute_ms,
    engine_counters,
    expert_read_spans,
    floors,
    pack_verdict,
    prefetch_pairs,
    prefetch_verdict,
    record_read_spans,
    rotated_trace,
    run_record,
    summarize_runs,
    text_sequences,
)
from harness.parsers.trace import synthetic_trace
from harness.tools.chunked import CHUNK_RE, ChunkedRun
from harness.tools.readahead import ReadAhead, read_ahead_file

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------------------------
# floors


def test_floors_serial_and_overlapped() -> None:
    f = floors(50e6, 500e6, 100.0)  # 50 MB a token at 500 MB/s: 100 ms of I/O, beside 100 ms of compute
    assert f.io_ms == pytest.approx(100.0) and f.compute_ms == 100.0
    assert f.serial_ms == pytest.approx(200.0) and f.serial_ts == pytest.approx(5.0)
    assert f.overlapped_ms == pytest.approx(100.0) and f.overlapped_ts == pytest.approx(10.0)
    g = floors(10e6, 1e9, 40.0)  # 10 ms of I/O under 40 ms of compute: overlapped = compute
    assert g.overlapped_ms == 40.0 and g.serial_ms == pytest.approx(50.0)
    with pytest.raises(HarnessError, match="bandwidth"):
        floors(1e6, 0.0, 1.0)
    with pytest.raises(HarnessError):
        floors(-1.0, 1e6, 1.0)


def test_compute_is_extrapolated_by_a_line_through_the_medians() -> None:
    # 2 ms fixed + 5 ms per layer: 12 at 2 layers, 22 at 4 (the 100 is an outlier the median drops)
    ms, how = depth_scaled_compute_ms([(2, 12.0), (2, 11.0), (2, 13.0), (4, 22.0), (4, 22.0), (4, 100.0)], 48)
    assert ms == pytest.approx(2.0 + 5.0 * 48)
    assert "per layer" in how and "48 layers" in how


def test_compute_at_one_depth_or_a_falling_line_is_proportional() -> None:
    ms, how = depth_scaled_compute_ms([(4, 20.0)], 48)
    assert ms == pytest.approx(240.0) and "proportional" in how
    ms, how = depth_scaled_compute_ms([(2, 12.0), (4, 10.0)], 48)  # noise: the deeper model measured faster
    assert ms == pytest.approx(120.0) and "did not rise" in how
    with pytest.raises(HarnessError):
        depth_scaled_compute_ms([(0, 1.0)], 48)
    with pytest.raises(HarnessError):
        depth_scaled_compute_ms([], 48)


# ------------------------------------------------------------------------------------------------------------------
# sequences and reads


TEXT = "".join(f"line {i}: the quick brown fox {i * 7919 % 1013} jumps\n" for i in range(400))


def test_sequences_are_distinct_disjoint_and_seeded() -> None:
    seqs = text_sequences(TEXT, 5, 500, seed=1)
    assert len(seqs) == 5 and len(set(seqs)) == 5 and all(len(s) == 500 for s in seqs)
    starts = sorted(TEXT.index(s) for s in seqs)
    assert all(b - a >= 500 for a, b in zip(starts, starts[1:], strict=False))  # no two overlap
    assert text_sequences(TEXT, 5, 500, seed=1) == seqs
    assert text_sequences(TEXT, 5, 500, seed=2) != seqs


def test_sequences_refuse_a_short_or_repeating_text() -> None:
    with pytest.raises(HarnessError, match="too short"):
        text_sequences(TEXT, 100, 500, seed=0)
    with pytest.raises(HarnessError, match="repeats"):
        text_sequences("abcd" * 1000, 3, 4, seed=0)


def test_read_spans_are_the_engines_aligned_expert_slices() -> None:
    tensors = [ExpertSlices("blk.0.ffn_up_exps.weight", 12_345, 589_824 + 100, 512),
               ExpertSlices("blk.0.ffn_down_exps.weight", 999_999_999, 4_000, 8)]
    spans = expert_read_spans(tensors, 500, seed=3)
    assert spans == expert_read_spans(tensors, 500, seed=3)
    for off, n in spans:
        assert off % 4096 == 0 and n % 4096 == 0
        t = next(t for t in tensors if t.offset - 4096 < off < t.offset + t.stride * t.n_expert)
        e = max(0, -(-(off - t.offset) // t.stride))  # the first expert whose slice starts at or after off
        start = t.offset + e * t.stride
        # the span starts at the slice's aligned start and covers the whole slice, up to the next alignment
        assert start - off < 4096 and start + t.stride <= off + n < start + t.stride + 4096
    assert {off < 999_999_999 for off, _ in spans} == {True, False}  # both tensors drawn


def test_rotated_trace_starts_each_layer_elsewhere() -> None:
    tr = synthetic_trace(n_layer=3, n_expert=16, k=4, n_tokens=40, seed=1)
    assert (rotated_trace(tr, 0, 4).records == tr.records).all()
    rot = rotated_trace(tr, 1, 2)
    for layer in range(3):
        idx = np.flatnonzero(tr.records["layer"] == layer)
        orig, new = tr.records[idx], rot.records[idx]
        assert (new["layer"] == layer).all()
        assert new[0]["token"] == orig[len(idx) // 2]["token"]
        assert sorted(new["token"].tolist()) == sorted(orig["token"].tolist())  # the same records, rotated
    with pytest.raises(HarnessError):
        rotated_trace(tr, 2, 2)


# ------------------------------------------------------------------------------------------------------------------
# records and the summary


def _rec(config: str, ts: list[float], *, engine: dict[str, Any] | None = None, reads: list[int] | None = None,
         round_: int = 0, error: str | None = None) -> dict[str, Any]:
    return run_record(config=config, kind="decode", round_=round_, spec=None if engine is None else "mode=engine",
                      readahead_kb=128, replay=None, n_ctx=32, warmup_chunks=1, chunk_ts=ts,
                      chunk_read_bytes=reads if reads is not None else [32 * 1_000_000] * len(ts),
                      read_bytes_all=1, tokens_all=32 * (len(ts) + 2), engine=engine,
                      disk={"round": round_, "MBps": 500.0}, error=error)


def test_a_run_record_is_checked_and_small() -> None:
    rec = _rec("fetch-all", [2.5, 2.7, 2.6], engine={"tokens": 160, "file_read_bytes": 1_600_000_000})
    assert rec["schema"] == RUN_SCHEMA
    check_run_record(json.loads(json.dumps(rec)))
    assert len(json.dumps(rec)) < 1000  # hundreds of them stay small enough for git
    for bad, why in [({**rec, "schema_version": 2}, "version"), ({**rec, "round": True}, "round"),
                     ({k: v for k, v in rec.items() if k != "engine"}, "engine"),
                     ({**rec, "chunk_ts": [1.0, math.inf]}, "finite"), ({**rec, "chunk_ts": [1.0, -2.0]}, "finite"),
                     ({**rec, "chunk_read_bytes": [1]}, "chunk_read_bytes"), ({**rec, "kind": "load"}, "kind"),
                     ({**rec, "chunk_ts": [], "chunk_read_bytes": []}, "without samples")]:
        with pytest.raises(HarnessError, match=why):
            check_run_record(bad)
    failed = _rec("speed", [], reads=[], error="exit 1: boom")
    check_run_record(failed)


def test_engine_counters_keep_totals_not_layers() -> None:
    doc = {"config": {"slots": 96}, "engine": {"file_read_bytes": 5, "file_reads": 2},
           "total": {"tokens": 10, "hit_rate": 0.5, "fetches": 3}, "layers": [{"x": 1}] * 48}
    assert engine_counters(doc) == {"tokens": 10, "hit_rate": 0.5, "fetches": 3, "file_reads": 2,
                                    "file_read_bytes": 5, "slots": 96}
    assert engine_counters(None) is None


def test_summary_from_records() -> None:
    recs = [_rec("stock A", [1.0, 1.0]), _rec("stock B", [2.0, 2.0]),
            _rec("fetch-all", [10.0, 12.0], engine={"tokens": 100, "file_read_bytes": 2_500_000_000,
                                                     "hit_rate": 0.5}),
            _rec("fetch-all", [11.0], engine={"tokens": 100, "file_read_bytes": 2_500_000_000, "hit_rate": 0.7},
                 round_=1),
            _rec("speed", [], reads=[], error="exit 1: boom")]
    rows = {r.config: r for r in summarize_runs(recs, 500e6, 40.0, ["stock A", "stock B"])}
    fa = rows["fetch-all"]
    assert fa.n == 3 and fa.mean_ts == pytest.approx(11.0)
    assert fa.vs_stock["stock A"][0] == pytest.approx(11.0) and fa.vs_stock["stock B"][0] == pytest.approx(5.5)
    assert fa.engine_bytes_per_token == pytest.approx(25e6)  # 5 GB over 200 tokens
    assert fa.process_bytes_per_token == pytest.approx(1e6)  # 32 MB per 32-token chunk
    assert fa.hit_rate == pytest.approx(0.6)
    assert fa.floors is not None and fa.floors.io_ms == pytest.approx(50.0) and fa.floors.compute_ms == 40.0
    assert rows["stock A"].floors is not None and rows["stock A"].floors.io_ms == pytest.approx(2.0)  # process bytes
    assert rows["speed"].n == 0 and rows["speed"].error == "exit 1: boom"
    assert better_stock(list(rows.values()), ["stock A", "stock B"]) == "stock B"


def test_replayed_rows_are_compared_with_the_replayed_stock_path_only() -> None:
    """A replayed row's ratio is against MMAP_REPLAY_ROW (stock's I/O path under the same routing), a row of the
    model's own routing against the stock rows, never across; the emulate row's counters are its emulated cache's,
    not reads: its floors use the process's bytes, and it has no hit rate."""
    mmap = {**_rec(MMAP_REPLAY_ROW, [1.0, 1.0], engine={"tokens": 64, "hit_rate": 0.6, "substitution_rate": 0.0}),
            "spec": "mode=emulate,policy=fetch-all"}
    recs = [_rec("stock A", [5.0, 5.0]), mmap,
            _rec("fetch-all", [6.0], engine={"tokens": 32, "file_read_bytes": 32_000_000}),
            _rec("fetch-all (replay)", [2.0, 2.0], engine={"tokens": 64, "file_read_bytes": 640_000_000})]
    rows = {r.config: r for r in summarize_runs(recs, 500e6, 40.0, ["stock A", MMAP_REPLAY_ROW])}
    assert set(rows["fetch-all"].vs_stock) == {"stock A"}
    assert set(rows["fetch-all (replay)"].vs_stock) == {MMAP_REPLAY_ROW}
    assert rows["fetch-all (replay)"].vs_stock[MMAP_REPLAY_ROW][0] == pytest.approx(2.0)
    m = rows[MMAP_REPLAY_ROW]
    assert m.vs_stock == {} and m.hit_rate is None and m.engine_bytes_per_token is None
    assert m.floors is not None and m.floors.io_ms == pytest.approx(2.0)  # 1 MB per token at 500 MB/s


def test_pack_rows_use_their_own_disk_bandwidth() -> None:
    recs = [_rec("fetch-all", [10.0], engine={"tokens": 100, "file_read_bytes": 2_500_000_000}),
            _rec("fetch-all (pack)", [12.0], engine={"tokens": 100, "file_read_bytes": 2_500_000_000})]
    rows = {r.config: r for r in summarize_runs(recs, 500e6, 40.0, [], {"fetch-all (pack)": 1000e6})}
    assert rows["fetch-all"].floors is not None and rows["fetch-all"].floors.io_ms == pytest.approx(50.0)
    assert rows["fetch-all (pack)"].floors is not None and rows["fetch-all (pack)"].floors.io_ms == pytest.approx(25.0)


def test_pack_verdict_rule() -> None:
    """met at >= 1.2x (conclusive when the CI's low end is too); below it, the probes' bound is the reason when it
    is below 1.2x (a disk that is not latency-bound, or little I/O), else the miss is said to be unexplained."""
    three, fast, slow = [10.0, 10.2, 9.8, 10.1], [13.0, 13.1, 12.9, 13.2], [10.5, 10.4, 10.6, 10.5]
    v = pack_verdict("fetch-all", three, fast, 500e6, 900e6, 0.8)
    assert v.ratio is not None and v.ratio[0] == pytest.approx(13.05 / 10.025) and v.verdict.startswith("met")
    assert "(conclusive)" in v.verdict and v.bound == pytest.approx(1 / (0.2 + 0.8 * 500 / 900))
    # not latency-bound: whole-expert reads no faster than slice reads, so the bound is 1x
    v = pack_verdict("fetch-all", three, slow, 500e6, 500e6, 0.8)
    assert v.verdict.startswith("not met") and "bound the gain at 1.00x" in v.verdict
    assert "not latency-bound" in v.verdict
    # latency-bound disk, but I/O a small part of the floor
    v = pack_verdict("quality", three, slow, 300e6, 900e6, 0.1)
    assert v.bound is not None and v.bound < PACK_TARGET and "I/O is 10%" in v.verdict
    # the probes allow 1.2x and more, the runs did not get it
    v = pack_verdict("fetch-all", three, slow, 300e6, 900e6, 0.9)
    assert v.bound is not None and v.bound >= PACK_TARGET and "unexplained by the probes" in v.verdict
    assert pack_verdict("speed", three, [], 1.0, 1.0, None).verdict.startswith("not measured")


def test_prefetch_pairs_and_verdict_rule() -> None:
    """Each `P,prefetch=on` row pairs with its row `P` (prefetch_max= dropped too, other keys kept, the same row
    suffix); the verdict: pays when the ratio's 95% CI is above 1, loses when it is below 1, else not
    distinguishable."""
    configs = ["stock", "quality", "quality,prefetch=on", "fetch-all,tau_file=0.3",
               "fetch-all,tau_file=0.3,prefetch=on,prefetch_max=2", "speed,prefetch=on", "quality (pack)",
               "quality,prefetch=on (pack)", "quality,prefetch=off"]
    assert prefetch_pairs(configs) == [("quality", "quality,prefetch=on"),
                                       ("fetch-all,tau_file=0.3", "fetch-all,tau_file=0.3,prefetch=on,prefetch_max=2"),
                                       ("quality (pack)", "quality,prefetch=on (pack)")]  # speed: no row without
    off = [6.5, 6.8, 7.0, 6.6]
    v = prefetch_verdict("quality", "quality,prefetch=on", off, [8.0, 8.2, 7.9, 8.1])
    assert v.verdict.startswith("pays") and v.ratio is not None and v.ratio[1] > 1
    assert v.ratio[0] == pytest.approx(np.mean([8.0, 8.2, 7.9, 8.1]) / np.mean(off))
    v = prefetch_verdict("quality", "quality,prefetch=on", off, [2.8, 3.0, 3.2, 2.9])
    assert v.verdict.startswith("loses") and v.ratio is not None and v.ratio[2] < 1
    v = prefetch_verdict("quality", "quality,prefetch=on", off, [6.0, 7.4, 6.4, 7.2])
    assert v.verdict.startswith("not distinguishable")
    assert prefetch_verdict("quality", "quality,prefetch=on", off, []).verdict.startswith("not measured")


def test_record_read_spans_are_whole_aligned_records(tmp_path: Path) -> None:
    from harness.domain.pack import PACK_ALIGN, plan_pack
    from harness.parsers.gguf_model import read_model_info
    from harness.tools.synth import SynthSpec, write_synth_model

    layout = plan_pack(read_model_info(write_synth_model(SynthSpec(n_expert=8, n_expert_used=2), tmp_path / "m.gguf")),
                       1, 1)
    spans = record_read_spans(layout, 200, 3)
    assert spans == record_read_spans(layout, 200, 3) and len(set(spans)) > 8
    starts = {la.first_record + e * la.record_bytes: la.record_bytes for la in layout.layers for e in range(8)}
    assert all(starts.get(off) == n and off % PACK_ALIGN == 0 for off, n in spans)


def test_chunk_lines_and_times() -> None:
    out = "0.00 minutes\n[1]907.8196,[2]933.7420,[3]nan,[4]862.8397,\n\n"
    assert [m for m in CHUNK_RE.findall(out)] == ["1", "2", "3", "4"]
    run = ChunkedRun(0, 1.0, 100, (3.0, 4.5, 8.0), (1100, 1200, 1700), 1800, out, "")
    assert run.chunk_seconds() == [2.0, 1.5, 3.5]
    assert run.chunk_reads() == [1000, 100, 500]


# ------------------------------------------------------------------------------------------------------------------
# readahead on a fake sysfs tree


def fake_sysfs(root: Path, file: Path, kb: int, *, partition: bool) -> Path:
    """A sysfs tree in which `file`'s device is a disk (or a partition of one) whose read_ahead_kb is `kb`."""
    st = os.stat(file)
    disk = root / "devices" / "pci0" / "block" / "fakedisk"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "read_ahead_kb").write_text(f"{kb}\n")
    dev = disk
    if partition:
        dev = disk / "fakedisk1"
        dev.mkdir()
        (dev / "partition").write_text("1\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").symlink_to(dev)
    return disk / "queue" / "read_ahead_kb"


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    if os.major(os.stat(f).st_dev) == 0:
        pytest.skip(f"{tmp_path} is on a file system without a block device (tmpfs?): no device to fake")
    return f


@pytest.mark.parametrize("partition", [False, True])
def test_readahead_is_found_from_the_files_device(tmp_path: Path, model_file: Path, partition: bool) -> None:
    ra_file = fake_sysfs(tmp_path / "sys", model_file, 8192, partition=partition)
    assert read_ahead_file(model_file, tmp_path / "sys") == ra_file.resolve()
    ra = ReadAhead.for_file(model_file, tmp_path / "sys")
    assert ra.original == 8192 and ra.device == "fakedisk"


def test_readahead_is_restored_after_the_run_an_error_and_a_signal(tmp_path: Path, model_file: Path) -> None:
    ra_file = fake_sysfs(tmp_path / "sys", model_file, 8192, partition=False)
    ra = ReadAhead.for_file(model_file, tmp_path / "sys")
    with ra.set_for_run(128):
        assert ra_file.read_text().strip() == "128"
    assert ra_file.read_text().strip() == "8192"
    with pytest.raises(RuntimeError), ra.set_for_run(128):
        raise RuntimeError("a run failed")
    assert ra_file.read_text().strip() == "8192"
    old = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), ra.set_for_run(256):  # SIGTERM: as Ctrl-C inside the block
        assert ra_file.read_text().strip() == "256"
        os.kill(os.getpid(), signal.SIGTERM)
    assert ra_file.read_text().strip() == "8192"
    assert signal.getsignal(signal.SIGTERM) == old
    ra_file.write_text("4096\n")  # changed by someone else: restore() puts the value found at the start back
    ra.restore()
    assert ra_file.read_text().strip() == "8192"


def test_readahead_refuses_a_file_without_a_block_device(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="without a block device"):
        read_ahead_file(Path("/proc/self/stat"))
    f = tmp_path / "x"
    f.write_bytes(b"x")
    if os.major(os.stat(f).st_dev) != 0:
        (tmp_path / "sys").mkdir()
        with pytest.raises(HarnessError, match="no .*dev/block"):
            read_ahead_file(f, tmp_path / "sys")


# ------------------------------------------------------------------------------------------------------------------
# end to end, on a tiny generated model


def _tiny_trained_stand_in(patched_build: Any, tmp_path: Path) -> tuple[Path, Path]:
    """A tiny model standing in for the trained one (2 layers, 16 experts, top-4) and a router trace recorded on it
    (q.gguf, q.trace in tmp_path), for the end-to-end runs' quality rows and replayed rows."""
    from harness.tools.synth import SynthSpec, write_synth_model

    qm = write_synth_model(SynthSpec(n_layer=2, n_expert=16, n_expert_used=4, n_embd=64, n_ff_exp=64, seed=2),
                           tmp_path / "q.gguf")
    trace = tmp_path / "q.trace"
    subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(qm), "-f",
                    str(ROOT / "eval" / "data" / "heldout.txt"), "-c", "64", "--chunks", "4", "-t", "1"],
                   env={**os.environ, "LLAMA_MOE_CACHE": f"mode=emulate,policy=fetch-all,trace={trace}"},
                   capture_output=True, check=True, timeout=120)
    return qm, trace


@pytest.mark.build
def test_full_scale_mode_end_to_end(stock_build: Any, patched_build: Any, tmp_path: Path) -> None:
    """The whole --full-scale flow in seconds: a tiny generated model in the study's layout (2 layers, 16 experts,
    top-4, Q4_0), two compute depths, two rounds, both stock rows (a fake read_ahead_kb), four policies (one with
    prefetch=on, which has no replayed row), the others' replay under a recorded trace and stock's path replayed,
    quality on a tiny f32 model; every record checked, the readahead restored."""
    from harness.tools.cgroup import CgroupError, MemoryCgroup

    try:
        MemoryCgroup(64 << 20, "moe-subst-probe").close()
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    qm, trace = _tiny_trained_stand_in(patched_build, tmp_path)
    sysfs = tmp_path / "sys"
    ra_file = None
    if os.major(os.stat(work).st_dev) != 0:
        ra_file = fake_sysfs(sysfs, work, 4096, partition=False)
    args = [sys.executable, str(ROOT / "scripts" / "bench_tiers.py"), "--full-scale", "--layers", "2",
            "--experts", "16", "--top-k", "4", "--embd", "64", "--ff", "64", "--heads", "4", "--kv-heads", "1",
            "--compute-layers", "1,2", "--ram", "400M", "--reserve", "16M", "--slots", "50%", "--ctx", "256",
            "--sequences", "2", "--tail-chunks", "2", "--rounds", "2", "--threads", "1", "--probe-reads", "50",
            "--sysfs", str(sysfs),
            "--quality-model", str(qm), "--quality-ctx", "64", "--quality-chunks", "2", "--replay-trace", str(trace),
            "--policies", "fetch-all;quality;speed;quality,prefetch=on", "--out", str(out), "--work", str(work)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    for r in records:
        check_run_record(r)
    decode = [r for r in records if r["kind"] == "decode"]
    configs = {r["config"] for r in decode}
    policies = {"fetch-all", "quality", "speed", "quality,prefetch=on"}
    replayed = policies - {"quality,prefetch=on"}  # the engine refuses prefetch=on with a replayed routing
    assert policies | {f"{p} (replay)" for p in replayed} | {MMAP_REPLAY_ROW} <= configs
    assert "quality,prefetch=on (replay)" not in configs
    for r in decode:
        one = r["spec"] is None or r["config"] == MMAP_REPLAY_ROW  # --stock-sequences
        assert r["error"] is None and len(r["chunk_ts"]) == (1 if one else 2), r
    assert {r["round"] for r in decode} == {0, 1}
    engine_rows = [r for r in decode if r["spec"] and r["config"] != MMAP_REPLAY_ROW]
    assert all(r["engine"]["tokens"] > 0 and r["engine"]["slots"] == 8 for r in engine_rows)
    assert all(r["replay"] == "q.trace" for r in decode if r["config"].endswith("(replay)"))
    # stock's I/O under the replayed routing: emulate with fetch-all, at the tuned readahead where it may be set
    mmap_rows = [r for r in decode if r["config"] == MMAP_REPLAY_ROW]
    assert len(mmap_rows) == 2 and all(r["spec"] == "mode=emulate,policy=fetch-all" for r in mmap_rows)
    assert len({r["disk"]["seconds"] for r in decode}) == 2  # one probe per round
    summary = json.loads((out / "summary.json").read_text())
    assert summary["slots"] == 8 and summary["fraction"] == 0.5 and summary["compute_ms_per_token"] > 0
    assert set(summary["quality"]["rows"]) == policies
    assert summary["quality"]["rows"]["fetch-all"]["delta_pct"] == pytest.approx(0.0, abs=1e-9)
    table = (out / "table.md").read_text()
    assert all(f"| {p} |" in table for p in policies)
    # the table is the records' and the summary's alone
    (out / "table.md").unlink()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tiers.py"), "--full-scale", "--rerender", "--out",
                    str(out)], capture_output=True, check=True, timeout=60, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (out / "table.md").read_text() == table
    if ra_file is not None:
        assert ra_file.read_text().strip() == "4096"  # restored
        assert {r["readahead_kb"] for r in decode if r["spec"] is None} == {4096, 128}
        assert {r["readahead_kb"] for r in mmap_rows} == {128}
        assert summary["readahead"]["restored_kb"] == 4096


@pytest.mark.build
def test_full_scale_pack_rows_end_to_end(stock_build: Any, patched_build: Any, tmp_path: Path) -> None:
    """--full-scale --pack on a tiny model (not a measurement): the pack is written next to the model, each policy
    has its three-read row (pack=off) and its pack row (pack=PATH), under its own and a replayed routing, the pack
    rows read one record per expert, the disk probe has the pack's pattern, and the table carries the verdict rule's
    rows; --no-stock: no stock row and no stock-path replay row."""
    from harness.tools.cgroup import CgroupError, MemoryCgroup

    try:
        MemoryCgroup(64 << 20, "moe-subst-probe").close()
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    qm, trace = _tiny_trained_stand_in(patched_build, tmp_path)
    args = [sys.executable, str(ROOT / "scripts" / "bench_tiers.py"), "--full-scale", "--pack", "--layers", "2",
            "--experts", "16", "--top-k", "4", "--embd", "64", "--ff", "64", "--heads", "4", "--kv-heads", "1",
            "--compute-layers", "1", "--ram", "400M", "--reserve", "16M", "--slots", "50%", "--ctx", "256",
            "--sequences", "2", "--tail-chunks", "2", "--rounds", "2", "--threads", "1", "--probe-reads", "30",
            "--no-stock", "--policies", "fetch-all;quality", "--quality-model", "none", "--replay-trace", str(trace),
            "--out", str(out), "--work", str(work)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert list(work.glob("*.moe-pack"))
    decode = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    decode = [r for r in decode if r["kind"] == "decode"]
    # --no-stock: the engine's rows only
    own = {"fetch-all", "fetch-all (pack)", "quality", "quality (pack)"}
    replayed = {"fetch-all (replay)", "fetch-all (replay) (pack)", "quality (replay)", "quality (replay) (pack)"}
    assert {r["config"] for r in decode} == own | replayed
    assert all(r["replay"] == "q.trace" for r in decode if r["config"] in replayed)
    for r in decode:
        assert r["error"] is None, r
        if r["spec"] is None:
            continue
        e = r["engine"]
        if r["config"].endswith("(pack)"):
            assert ",pack=" in r["spec"] and "pack=off" not in r["spec"]
            assert e["pack"] and e["pack_reads"] == e["file_reads"] == e["copied_experts"] > 0, e
            assert "pack" in r["disk"] and r["disk"]["pack"]["MBps"] > 0
        else:
            assert "pack=off" in r["spec"] and e["pack"] == "" and e["pack_reads"] == 0 and e["file_reads"] > 0, e
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pack"]["configs"] == ["fetch-all (pack)", "quality (pack)", "fetch-all (replay) (pack)",
                                          "quality (replay) (pack)"]
    table = (out / "table.md").read_text()
    assert "One read per expert" in table and "| fetch-all |" in table and "| quality (pack) |" in table
    assert sum(1 for line in table.splitlines() if "met" in line and line.startswith("| ")) >= 2


@pytest.mark.build
def test_full_scale_prefetch_rows_end_to_end(stock_build: Any, patched_build: Any, tmp_path: Path) -> None:
    """--full-scale with a policy and its prefetch=on entry on a tiny model (not a measurement): both rows run in the
    same rounds, the prefetch row's records carry its prefetch counters, and the table carries the prefetch verdict
    rule's row for the pair."""
    from harness.tools.cgroup import CgroupError, MemoryCgroup

    try:
        MemoryCgroup(64 << 20, "moe-subst-probe").close()
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    args = [sys.executable, str(ROOT / "scripts" / "bench_tiers.py"), "--full-scale", "--layers", "2",
            "--experts", "16", "--top-k", "4", "--embd", "64", "--ff", "64", "--heads", "4", "--kv-heads", "1",
            "--compute-layers", "1", "--ram", "400M", "--reserve", "16M", "--slots", "50%", "--ctx", "256",
            "--sequences", "2", "--tail-chunks", "2", "--rounds", "2", "--threads", "1", "--probe-reads", "30",
            "--no-readahead", "--policies", "fetch-all;fetch-all,prefetch=on", "--quality-model", "none",
            "--out", str(out), "--work", str(work)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    decode = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    decode = [r for r in decode if r["kind"] == "decode" and r["spec"]]
    assert {r["config"] for r in decode} == {"fetch-all", "fetch-all,prefetch=on"}
    for r in decode:
        assert r["error"] is None, r
        e = r["engine"]
        if r["config"] == "fetch-all,prefetch=on":
            assert ",prefetch=on" in r["spec"] and e["prefetches"] > 0, e
            assert e["prefetch_used"] + e["prefetch_wasted"] + e["prefetch_dropped"] <= e["prefetches"]
        else:
            assert "prefetch" not in r["spec"] and e["prefetches"] == 0, e
    table = (out / "table.md").read_text()
    assert "Prefetch on the file tier" in table
    rows = [line for line in table.splitlines()
            if line.startswith("| fetch-all | ") and "fetch-all,prefetch=on" in line]
    assert len(rows) == 1 and any(w in rows[0] for w in ("pays", "loses", "not distinguishable")), table
    assert "prefetches/token" in rows[0]


@pytest.mark.build
def test_the_issue_11_benchmark_end_to_end(stock_build: Any, patched_build: Any, tmp_path: Path) -> None:
    """scripts/bench_tiers.py without --full-scale on a tiny generated model (seconds; not a measurement): every row
    decoded and prefilled inside its memory cgroup, the cost model's estimates beside the measurements, one record."""
    from harness.tools.cgroup import CgroupError, MemoryCgroup
    from harness.tools.synth import SynthSpec, write_synth_model

    try:
        MemoryCgroup(64 << 20, "moe-subst-probe").close()
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    model = write_synth_model(SynthSpec(n_layer=2, n_expert=16, n_expert_used=4, n_embd=64, n_ff_exp=64, n_head=4,
                                        n_head_kv=1, dtype="q4_0"), tmp_path / "m.gguf")
    out = tmp_path / "bt" / "x.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tiers.py"), "--model", str(model), "--ram",
                          "400M", "--slots", "50%", "--rounds", "2", "--tokens", "4", "--prompt", "32",
                          "--prompt-rounds", "1", "--threads", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["runs"]) == ["stock (mmap)", "engine fetch-all 50% host=file", "engine quality 50% host=file",
                                 "engine speed 50% host=file"]
    for name, run in doc["runs"].items():
        assert len(run["samples_ts"]) == 2 and run["mean"] > 0, name  # one sample a round
    assert all(r["stats"]["total"]["tokens"] > 0 for n, r in doc["runs"].items() if n != "stock (mmap)")
    assert len(doc["prefill"]) == 4 and len(doc["disk_samples_MBps"]) == 2
    assert set(doc["simulate"]) == {"fetch-all", "quality", "speed"}
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_tiers.py"), "--model", str(model), "--ram",
                          "1T"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and bad.stderr.startswith("bench_tiers: ") and "Traceback" not in bad.stderr
