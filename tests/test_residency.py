"""The one residency -> slots rule (harness.domain.plan.slots_for_residency) is the engine's: the patched build,
given `slots=P%`, runs with the slots that the harness computes for P / 100, at the percentages where a half is
rounded (where Python's round(), to even, differs) and around them. The hand-computed values are in
tests/test_plan.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.core.project import Build
from harness.domain.plan import slots_for_residency
from harness.tools.synth import SynthSpec, write_synth_model

N_EXPERT, K = 64, 8
# 64 * P / 100 = 8.5, 10.5, 12.5 (round() gives 8, 10, 12; the engine 9, 11, 13), 9.5 (both 10), and neighbours
PERCENTS = ("13.28125", "16.40625", "19.53125", "14.84375", "13.2", "13.3", "25", "12.5")


@pytest.mark.build
def test_the_engine_rounds_a_residency_as_the_harness(patched_build: Build, synth_text_file: Path,
                                                      tmp_path: Path) -> None:
    model = write_synth_model(SynthSpec(n_expert=N_EXPERT, n_expert_used=K, seed=4), tmp_path / "m.gguf")
    got, want = {}, {}
    for pct in PERCENTS:
        stats = tmp_path / f"stats-{pct}.json"
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
        env["LLAMA_MOE_CACHE"] = f"mode=emulate,policy=quality,slots={pct}%,stats={stats}"
        r = subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(model), "-f", str(synth_text_file),
                            "-c", "64", "-b", "64", "--chunks", "1", "-t", "2"], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and stats.is_file(), (r.stdout + r.stderr)[-2000:]
        got[pct] = json.loads(stats.read_text())["config"]["slots"]
        want[pct] = slots_for_residency(float(pct) / 100, N_EXPERT, K)
    assert got == want
    # the halves: where the old rounding (Python's round) was not the engine's
    assert [got[p] for p in PERCENTS[:3]] == [9, 11, 13]
    assert [round(float(p) / 100 * N_EXPERT) for p in PERCENTS[:3]] == [8, 10, 12]
