"""harness.parsers.trace: the router trace writer round-trips through the reader, header checks, recorded-action
counts, synthetic traces; and (build) a trace the engine wrote agrees with the engine's statistics."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.parsers.trace import (
    ACTION_FETCH,
    ACTION_HIT,
    ACTION_SUBSTITUTE,
    ExpertTrace,
    decode_order,
    read_expert_trace,
    read_trace_header,
    recorded_actions,
    synthetic_trace,
    trace_dtype,
    write_expert_trace,
)
from harness.tools.synth import SynthSpec, synth_text, write_synth_model


def small_trace() -> ExpertTrace:
    """Two layers, two tokens each, k=3, top_m=4, in ubatch order (layer by layer); version 1 (no prediction)."""
    rec = np.zeros(4, dtype=trace_dtype(3, 4, 1))
    rows = [  # layer, token, ids, weights, used, action
        (0, 0, [5, 1, 2], [0.5, 0.3, 0.2], [5, 1, 7], [ACTION_HIT, ACTION_FETCH, ACTION_SUBSTITUTE]),
        (0, 1, [1, 2, 3], [0.6, 0.25, 0.15], [1, 2, 3], [ACTION_HIT, ACTION_HIT, ACTION_HIT]),
        (1, 0, [0, 4, 6], [0.7, 0.2, 0.1], [0, 7, 5], [ACTION_FETCH, ACTION_SUBSTITUTE, ACTION_SUBSTITUTE]),
        (1, 1, [6, 0, 4], [0.4, 0.4, 0.2], [6, 0, 4], [ACTION_HIT, ACTION_HIT, ACTION_FETCH]),
    ]
    for i, (layer, tok, ids, w, used, act) in enumerate(rows):
        rec[i]["layer"], rec[i]["token"], rec[i]["ids"], rec[i]["weights"], rec[i]["used"] = layer, tok, ids, w, used
        rec[i]["action"][:3] = act
        rec[i]["top_ids"] = [*ids, 7]
        rec[i]["top_score"] = [0.4, 0.3, 0.2, 0.1]
    return ExpertTrace(1, 2, 8, 3, 4, 4, rec)


def test_round_trip_small(tmp_path: Path) -> None:
    t = small_trace()
    path = write_expert_trace(tmp_path / "t.bin", t)
    assert path.stat().st_size == 64 + 4 * (8 + 12 * 3 + 4 + 8 * 4)
    back = read_expert_trace(path)
    assert (back.version, back.n_layer, back.n_expert, back.k, back.top_m, back.n_slots) == (1, 2, 8, 3, 4, 4)
    assert back.records.tobytes() == t.records.tobytes()
    h = read_trace_header(path)
    assert (h.n_layer, h.n_expert, h.k, h.top_m, h.n_slots, h.n_records) == (2, 8, 3, 4, 4, 4)
    assert h.file_size == path.stat().st_size
    # writing what was read gives the same bytes
    assert write_expert_trace(tmp_path / "u.bin", back).read_bytes() == path.read_bytes()


def test_round_trip_version_2(tmp_path: Path) -> None:
    """Version 2 adds pred[k] at the end of each record (the prefetch prediction; -1: none); both versions are read."""
    t1 = small_trace()
    rec = np.zeros(4, dtype=trace_dtype(3, 4))
    for name in t1.records.dtype.names or ():
        rec[name] = t1.records[name]
    rec["pred"] = [[-1, -1, -1], [-1, -1, -1], [5, 1, 2], [1, 2, 3]]
    t = ExpertTrace(2, 2, 8, 3, 4, 4, rec)
    path = write_expert_trace(tmp_path / "t2.bin", t)
    assert path.stat().st_size == 64 + 4 * (8 + 12 * 3 + 4 + 8 * 4 + 4 * 3)
    back = read_expert_trace(path)
    assert back.version == 2 and back.has_pred and not t1.has_pred
    assert back.records.tobytes() == rec.tobytes()
    assert read_trace_header(path).record_size == 92
    # a damaged prediction is named
    rec2 = rec.copy()
    rec2["pred"][2, 1] = 8
    path.write_bytes(path.read_bytes()[:64] + rec2.tobytes())
    with pytest.raises(HarnessError, match=re.escape("record 2 has a predicted expert id outside [-1, 8)")):
        read_expert_trace(path)
    with pytest.raises(HarnessError, match="version-1 layout"):
        write_expert_trace(tmp_path / "x.bin", ExpertTrace(1, 2, 8, 3, 4, 4, rec))


def test_round_trip_synthetic_without_scores(tmp_path: Path) -> None:
    t = synthetic_trace(n_layer=3, n_expert=32, k=5, n_tokens=40, top_m=0, seed=1)
    back = read_expert_trace(write_expert_trace(tmp_path / "s.bin", t))
    assert back.top_m == 0 and "top_ids" not in (back.records.dtype.names or ())
    assert back.records.tobytes() == t.records.tobytes()


def test_header_errors(tmp_path: Path) -> None:
    path = write_expert_trace(tmp_path / "t.bin", small_trace())
    data = path.read_bytes()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"NOTATRACE" + data[9:])
    with pytest.raises(HarnessError, match="not an expert-cache router trace"):
        read_trace_header(bad)
    bad.write_bytes(data[:-5])
    with pytest.raises(HarnessError, match="truncated trace"):
        read_trace_header(bad)
    bad.write_bytes(data[:8] + (3).to_bytes(4, "little") + data[12:])
    with pytest.raises(HarnessError, match="version 3"):
        read_trace_header(bad)
    # a version-1 file relabelled version 2: its records lack the prediction
    bad.write_bytes(data[:8] + (2).to_bytes(4, "little") + data[12:])
    with pytest.raises(HarnessError, match="record size 80 does not match version 2"):
        read_trace_header(bad)
    bad.write_bytes(data[:40])
    with pytest.raises(HarnessError, match="truncated trace header"):
        read_trace_header(bad)
    with pytest.raises(HarnessError, match="cannot read"):
        read_trace_header(tmp_path / "missing.bin")


def test_decode_order_and_recorded_actions() -> None:
    t = small_trace()
    d = decode_order(t)
    assert [(int(r["token"]), int(r["layer"])) for r in d] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    a = recorded_actions(t)
    assert (a.token_layers, a.calls, a.hits, a.fetches, a.substitutions, a.drops) == (4, 12, 6, 3, 3, 0)
    assert a.subst_mass_sum == pytest.approx(0.2 + 0.2 + 0.1)


def test_synthetic_trace_is_a_plausible_router_trace() -> None:
    k, m = 6, 10
    t = synthetic_trace(n_layer=2, n_expert=48, k=k, n_tokens=300, top_m=m, topic_every=100, seed=2)
    r = t.records
    assert len(r) == 600
    # decode order: token by token, layer by layer
    assert list(r["token"][:4]) == [0, 0, 1, 1] and list(r["layer"][:4]) == [0, 1, 0, 1]
    assert all(len(set(ids)) == k for ids in r["ids"])  # k distinct experts
    assert np.allclose(r["weights"].sum(axis=1), 1.0, atol=1e-5)
    assert np.all(np.diff(r["weights"], axis=1) <= 1e-7)  # rank order: weights descending
    assert np.all(np.diff(r["top_score"], axis=1) <= 0)
    assert np.array_equal(r["top_ids"][:, :k], r["ids"])  # the selected are the top k by score
    assert np.array_equal(r["used"], r["ids"]) and not r["action"].any()
    # skewed popularity: the 25% most selected experts of a topic take well over 25% of the calls
    ids = r["ids"][(r["layer"] == 0) & (r["token"] < 100)].ravel()
    counts = np.sort(np.bincount(ids, minlength=48))[::-1]
    assert counts[:12].sum() / counts.sum() > 0.4
    with pytest.raises(HarnessError):
        synthetic_trace(n_layer=1, n_expert=4, k=5, n_tokens=1)


# ---- a trace the engine wrote ------------------------------------------------------------------------------------

@pytest.mark.build
def test_engine_trace_matches_engine_statistics(patched_build: Build, tmp_path: Path) -> None:
    model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=32, n_expert_used=4, n_layer=2, seed=5),
                              tmp_path / "m.gguf")
    text = tmp_path / "t.txt"
    text.write_text(synth_text(6000, seed=2))
    trace, stats = tmp_path / "trace.bin", tmp_path / "stats.json"
    env = {**os.environ, "LLAMA_MOE_CACHE": f"mode=emulate,policy=quality,slots=25%,trace={trace},stats={stats}"}
    res = subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "128",
                          "-b", "128", "--chunks", "3", "-t", "2"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(stats.read_text())
    t = read_expert_trace(trace)
    h = read_trace_header(trace)
    assert (h.n_layer, h.n_expert, h.k, h.top_m, h.n_slots) == (2, 32, 4, 16, 8)
    a = recorded_actions(t)
    total = doc["total"]
    assert (a.token_layers, a.calls, a.hits, a.fetches, a.substitutions) == (
        total["token_layers"], total["calls"], total["hits"], total["fetches"], total["substitutions"])
    assert a.subst_mass_sum == pytest.approx(total["subst_mass_sum"], rel=1e-6)
    # the rewritten trace is byte-identical to the engine's
    assert write_expert_trace(tmp_path / "again.bin", t).read_bytes() == trace.read_bytes()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("header top_m", 1 << 30, "damaged trace header"),
    ("header k", 0, "damaged trace header"),
    ("ids", 8, "an expert id outside [0, 8)"),
    ("ids", -1, "an expert id outside [0, 8)"),
    ("weights", float("nan"), "a gate weight not finite or < 0"),
    ("weights", -0.5, "a gate weight not finite or < 0"),
    ("top_ids", 99, "a top expert id outside [0, 8)"),
    ("top_score", float("inf"), "a router score that is not finite"),
    ("layer", 2, "a layer >= n_layer 2"),
])
def test_damaged_traces_are_one_line_errors(field: str, value: float, message: str, tmp_path: Path) -> None:
    """Found by scripts/fuzz_inputs.py: a flipped top_m made numpy raise ValueError (a traceback), and damaged
    records were read as if valid; both readers now name the damage (llama-moe-sim makes the same checks)."""
    import struct

    from harness.parsers.trace import read_expert_trace, read_trace_header, synthetic_trace, write_expert_trace

    path = write_expert_trace(tmp_path / "t.bin", synthetic_trace(n_layer=2, n_expert=8, k=2, n_tokens=8, top_m=4))
    data = bytearray(path.read_bytes())
    if field.startswith("header"):
        struct.pack_into("<I", data, {"header k": 24, "header top_m": 28}[field], int(value))
    else:
        t = read_expert_trace(path)
        rec = t.records.copy()
        rec[field][5] = value
        data[64:] = rec.tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(HarnessError, match=re.escape(message)):
        read_expert_trace(path)
    if field.startswith("header"):
        with pytest.raises(HarnessError, match=re.escape(message)):
            read_trace_header(path)


@pytest.mark.build
@pytest.mark.parametrize(("field", "value", "message"), [("weights", float("nan"), "has gate weight nan"),
                                                         ("weights", -1.0, "has gate weight -1.000000"),
                                                         ("top_score", float("inf"), "has router score inf")])
def test_moe_sim_refuses_non_finite_weights(field: str, value: float, message: str, patched_build: Build,
                                            tmp_path: Path) -> None:
    """llama-moe-sim replayed NaN or negative gate weights and non-finite router scores as if valid (every decision
    then depends on garbage): one line naming the record, exit non-zero."""
    from harness.parsers.trace import read_expert_trace, synthetic_trace, write_expert_trace

    path = write_expert_trace(tmp_path / "t.bin", synthetic_trace(n_layer=2, n_expert=8, k=2, n_tokens=8, top_m=4))
    t = read_expert_trace(path)
    rec = t.records.copy()
    rec[field][3] = value
    path.write_bytes(path.read_bytes()[:64] + rec.tobytes())
    r = subprocess.run([str(patched_build.tool("llama-moe-sim")), "--trace", str(path), "-q"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and f"record 3 {message}" in r.stderr, r.stderr
