"""The project's own perplexity regression gate: the trained model under the recorded policies."""

from pathlib import Path

import pytest

from harness.cli import main
from harness.core import project
from harness.core.project import Build

BASELINE = project.project_root() / "eval" / "baselines" / "tinymoe.json"


@pytest.mark.build
def test_trained_model_passes_the_recorded_gate(tmp_path: Path, stock_build: Build, patched_build: Build,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert BASELINE.is_file()
    rc = main(["check", "--baseline", str(BASELINE), "--out", str(tmp_path / "check"), "--threads", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for policy in ("quality", "speed", "fetch-all", "substitute-all"):
        assert f"ok   {policy}" in out
