"""harness.report: the renderers, on a comparison run with the fake runner of test_compare."""

from __future__ import annotations

from pathlib import Path

from test_compare import FakeEnv, FakeRunner, _info

from harness.compare import CompareOptions, CompareResult, run_compare
from harness.report import render_compare_markdown, render_compare_text


def _result(tmp_path: Path, gpu: str = "none", runs: int = 3) -> CompareResult:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = CompareOptions(model=model, out=tmp_path / "out", policies=("quality", "speed"), text=text, runs=runs,
                          argv=("harness", "compare", "--runs", str(runs)))
    return run_compare(opts, FakeRunner(peak_mib=20.0), _info(), env=FakeEnv(tmp_path, gpu=gpu))


def test_terminal_text(tmp_path: Path) -> None:
    out = render_compare_text(_result(tmp_path), width=200)
    assert "stock: non-expert weights + 1 of 4 MoE layers' experts on the device (--n-cpu-moe 3)" in out
    assert "patched: non-expert weights + 2 cache slots per layer (25.0% of the experts" in out
    assert "PPL ± one SE" in out and "95% CI by block bootstrap" in out
    assert "tokens/s (CPU build)" in out
    assert "+5.13% [+5.13, +5.13]" in out  # speed: a constant 0.05-nat shift
    assert "(reference)" in out and "full model (cache off)" in out and "stock llama.cpp" in out
    assert "10.00%" in out  # substitution rate from the cache statistics
    assert "no GPU on this machine" in out
    assert "only 3 samples" in out  # pyperf-like warning for few runs
    assert "13 runs now, 0 resumed" in out


def test_markdown(tmp_path: Path) -> None:
    md = render_compare_markdown(_result(tmp_path, gpu="NVIDIA RTX 3090"))
    assert md.startswith("# harness compare\n")
    assert "| configuration | PPL ± SE | delta PPL [95% CI] | substituted | mass | fetches/token |" in md
    assert "| speed | " in md and "+5.13% [+5.13, +5.13]" in md
    assert "tokens/s: mean ± 95% CI (Student t) over 3 interleaved repetitions" in md
    assert "CPU build" not in md
    assert "every run stayed within the budget" in md
    assert "`harness compare --runs 3`" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| quality | tg128")]
    assert len(rows) == 1
    ratio = float(rows[0].split("|")[6].split("x")[0])
    assert 2.4 < ratio < 2.6  # 25 against 10 tokens/s, with the fake's jitter


def test_estimates_are_labelled_as_estimates(tmp_path: Path) -> None:
    res = _result(tmp_path)
    assert res.estimate_profile == "rtx3090"
    assert [e.config for e in res.estimates] == ["stock", "quality", "speed"]
    assert all(e.ms_per_token > 0 for e in res.estimates)
    stock_ms = res.estimates[0].ms_per_token
    assert res.estimates[1].vs_stock is not None
    assert abs(res.estimates[1].vs_stock - stock_ms / res.estimates[1].ms_per_token) < 1e-12
    text = render_compare_text(res, width=200)
    assert "ESTIMATED decode speed on a rtx3090" in text and "not a measurement" in text
    md = render_compare_markdown(res)
    assert "## Estimated decode speed (not measured)" in md
    (tmp_path / "g").mkdir()
    gpu = _result(tmp_path / "g", gpu="NVIDIA RTX 3090")
    assert gpu.estimates == () and "ESTIMATED" not in render_compare_text(gpu)
