"""The log-drain preload makes stock tools print their last lines (upstream issue 22142)."""

import os
import subprocess
from pathlib import Path

import pytest

from harness.core.project import Build, log_drain_preload


@pytest.mark.build
def test_stock_perplexity_always_prints_its_final_line(stock_build: Build, dense_model: Path,
                                                       synth_text_file: Path) -> None:
    shim = log_drain_preload()
    assert shim is not None, "build/liblogdrain.so is missing: ./build.sh builds it"
    assert str(shim) in os.environ.get("LD_PRELOAD", "")  # conftest preloads it for every tool
    cmd = [str(stock_build.tool("llama-perplexity")), "-m", str(dense_model), "-f", str(synth_text_file),
           "-c", "128", "-b", "128", "-t", "2", "--chunks", "4"]
    for _ in range(10):  # without the drain, about half of these runs lose the line
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0
        assert "Final estimate: PPL = " in out.stdout + out.stderr
