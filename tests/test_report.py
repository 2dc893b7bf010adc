"""harness.report.markdown: the renderers, on a comparison run with the fake runner of test_compare."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from test_compare import FakeEnv, FakeRunner, _info

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.core.sizes import parse_size
from harness.domain.options import CompareOptions
from harness.domain.results import CompareResult
from harness.orchestration.compare import compare, reload_compare, run_compare
from harness.orchestration.sweep import reload_sweep
from harness.parsers.nll_dump import NllDump
from harness.report.markdown import render_compare_markdown
from harness.report.terminal import render_compare_text
from harness.tools.requests import PerplexityRequest, PerplexityRun


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


def _write_dump(path: Path, d: NllDump) -> None:
    # the documented format (docs/expert-cache.md, "Per-token NLL dump")
    count = d.nll.size
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"LLNLLDMP" + struct.pack("<4IQ", 1, d.n_ctx, d.first, d.n_chunk, count)
                     + d.tokens.astype("<i4").tobytes() + d.nll.astype("<f8").tobytes())


class FileFake(FakeRunner):
    """The fake runner, writing its NLL dumps to disk as llama-perplexity does."""

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        run = super().perplexity(build, req)
        if req.nll_dump is not None:
            _write_dump(req.nll_dump, self.dumps[req.nll_dump])
        return run


def test_reload_compare_renders_the_same_report(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = CompareOptions(out=tmp_path / "out", model=synth_models["qwen3moe"], text=text, runs=2,
                          policies=("quality", "speed"), vram=parse_size("80%"), argv=("harness", "compare"))
    first = compare(opts, runner=FileFake(), env=FakeEnv(tmp_path))
    again = reload_compare(tmp_path / "out")
    assert again.options.vram == parse_size("80%") and again.plan.budget_bytes == first.plan.budget_bytes
    assert [(q.config, q.ppl, q.delta) for q in again.quality] == [(q.config, q.ppl, q.delta) for q in first.quality]
    assert [(r.config, r.test, r.tokens_per_s) for r in again.speed] == [
        (r.config, r.test, r.tokens_per_s) for r in first.speed]
    assert render_compare_markdown(again).split("## Provenance")[0] == (
        render_compare_markdown(first).split("## Provenance")[0])
    with pytest.raises(HarnessError, match="not sweep"):
        reload_sweep(tmp_path / "out")
    with pytest.raises(HarnessError, match="no meta record"):
        reload_compare(tmp_path)


def test_rerender_dispatches_on_the_meta_record(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    from harness.orchestration.rerender import rerender

    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = CompareOptions(out=tmp_path / "out", model=synth_models["qwen3moe"], text=text, runs=1,
                          policies=("quality",), speed=False)
    compare(opts, runner=FileFake(), env=FakeEnv(tmp_path))
    (tmp_path / "out" / "report.md").unlink()
    r = rerender(tmp_path / "out" / "results.jsonl")
    assert r.command == "compare" and r.report_path.read_text() == r.markdown
    assert "## Quality" in r.markdown and "## Speed" not in r.markdown
    with pytest.raises(HarnessError, match="no results"):
        rerender(tmp_path)


def test_report_on_a_file_says_what_it_takes(tmp_path: Path, synth_models: dict[str, Path],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `harness report MODEL.gguf` died with UnicodeDecodeError (the model read as JSON Lines). Now a file
    that is not a results.jsonl is one line saying what the command takes; a damaged line in results.jsonl is
    skipped with a warning and the report is still rendered."""
    from harness.cli.app import main
    from harness.orchestration.rerender import rerender

    other = tmp_path / "notes.txt"
    other.write_bytes(b"\xff\xfe not a results file")
    for path, what in ((synth_models["qwen3moe"], "a GGUF model (a moved model goes with --model FILE)"),
                       (other, "a file")):
        with pytest.raises(HarnessError) as e:
            rerender(path)
        assert str(e.value) == (f"{path} is {what}, not a results folder: harness report takes the --out folder of "
                                "a compare, sweep or frontier run (or the results.jsonl in it)")
        assert main(["report", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("harness: error: ") and "\n" not in err and "Traceback" not in err
    text = tmp_path / "t.txt"
    text.write_text("text")
    opts = CompareOptions(out=tmp_path / "out", model=synth_models["qwen3moe"], text=text, runs=1,
                          policies=("quality",), speed=False)
    compare(opts, runner=FileFake(), env=FakeEnv(tmp_path))
    results = tmp_path / "out" / "results.jsonl"
    lines = results.read_bytes().split(b"\n")
    lines.insert(1, b'{"key": "\xff"}')  # one undecodable record, then a report's and a resumed run's reading
    results.write_bytes(b"\n".join(lines))
    assert main(["report", str(tmp_path / "out")]) == 0
    assert "## Quality" in (tmp_path / "out" / "report.md").read_text()
    again = compare(opts, runner=FileFake(), env=FakeEnv(tmp_path))  # resumes: nothing to redo, no traceback
    assert again.n_run == 0 and any("damaged record skipped" in w for w in again.warnings)
