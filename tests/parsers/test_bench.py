"""parse_bench_json on a captured `llama-bench -o json` of the pinned stock build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.parsers import ParseError, parse_bench_json

DATA = Path(__file__).resolve().parent.parent / "data" / "stock-cpu"


def test_captured_json_keeps_samples() -> None:
    pp, tg = parse_bench_json((DATA / "bench.json").read_text())
    assert (pp.test, tg.test) == ("pp64", "tg16")
    assert pp.samples_ns == (1650962, 1603019, 5676008)
    assert tg.samples_ns == (9528441, 1770366, 5639231)
    assert pp.backends == "CPU" and pp.gpu_info == "" and pp.n_cpu_moe == 1 and pp.n_gpu_layers == 99
    assert pp.build_commit == "llama-cpp-python-0.3.36"
    # tokens/s per sample, as llama-bench computes them (its samples_ts, printed to 6 significant digits)
    assert pp.samples_ts == pytest.approx((38765.3, 39924.7, 11275.5), rel=1e-5)
    assert tg.samples_ts == pytest.approx((1679.18, 9037.68, 2837.27), rel=1e-5)
    assert pp.avg_ts == pytest.approx(29988.491622)


def test_log_lines_before_the_json_are_skipped() -> None:
    text = "ggml_cuda_init: found 1 CUDA devices\n" + (DATA / "bench.json").read_text()
    assert len(parse_bench_json(text)) == 2


def test_bad_json() -> None:
    with pytest.raises(ParseError, match="no JSON array"):
        parse_bench_json("error: failed to load model\n")
    with pytest.raises(ParseError, match="does not parse"):
        parse_bench_json((DATA / "bench.json").read_text()[:-20])  # cut short by a crash
    data = json.loads((DATA / "bench.json").read_text())
    del data[0]["samples_ns"]
    with pytest.raises(ParseError, match="lacks samples_ns"):
        parse_bench_json(json.dumps(data))
    data = json.loads((DATA / "bench.json").read_text())
    data[1]["samples_ns"] = []
    with pytest.raises(ParseError, match="positive integers"):
        parse_bench_json(json.dumps(data))


def test_depth_and_combined_test_names() -> None:
    data = json.loads((DATA / "bench.json").read_text())
    data[0].update(n_prompt=512, n_gen=128, n_depth=4096)
    (r, _) = parse_bench_json(json.dumps(data))
    assert r.test == "pp512+tg128 @ d4096" and r.n_tokens == 640
