"""harness.report.plots and `harness report --plots`: figures of the study's real sweep folder, the fitted line against
numpy, and the one-line error without matplotlib."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.cli import main
from harness.core.errors import HarnessError
from harness.domain.plan import SweepPoint
from harness.domain.results import SweepRow
from harness.orchestration.sweep import mass_hypothesis, reload_sweep
from harness.report import plots
from harness.stats.intervals import DeltaPPL

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "eval" / "study-tinymoe" / "sweep"
MODEL = ROOT / "models" / "tinymoe-f16.gguf"


@pytest.fixture
def sweep_copy(tmp_path: Path) -> Path:
    if not (SWEEP / "results.jsonl").is_file() or not MODEL.is_file():
        pytest.skip("the study's sweep folder or the trained model is not in this checkout")
    out = tmp_path / "sweep"
    shutil.copytree(SWEEP, out, ignore=shutil.ignore_patterns("plots"))
    return out


def _row(rule: str, mass: float, delta: float, ms: float | None = 1.0, tau: float | None = None) -> SweepRow:
    p = SweepPoint(f"{rule} {tau} {mass}", rule, tau, "off", "lfu", 0.25, 4)
    d = DeltaPPL(delta, delta - 0.2, delta + 0.3, 10.0, 10.0, 100, 4, 100, 0)
    return SweepRow(p, 10.0, d, 0.1, mass, 2.0 - mass, ms)


def test_report_plots_writes_png_and_svg(sweep_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(sweep_copy), "--model", str(MODEL), "--plots"]) == 0
    out = capsys.readouterr().out
    for name in ("frontier.png", "frontier.svg", "mass.png", "mass.svg"):
        path = sweep_copy / "plots" / name
        assert path.stat().st_size > 1000, name
        assert f"plot: {path}" in out.replace("\n", "")
    assert (sweep_copy / "plots" / "mass.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (sweep_copy / "plots" / "frontier.svg").read_text()
    assert "<svg" in svg and "ESTIMATE" in svg  # the axis says the speed is a cost-model estimate


def test_fitted_line_in_the_plot_is_numpys_polyfit(sweep_copy: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    result = reload_sweep(sweep_copy, model=MODEL)
    figs: list[Any] = []
    save = plots._save

    def keep(fig: Any, stem: Path) -> tuple[Path, ...]:
        figs.append(fig)
        return save(fig, stem)

    monkeypatch.setattr(plots, "_save", keep)
    _, line = plots.plot_mass(result.rows, result.mass, tmp_path / "mass")
    pts = plots.mass_rows(result.rows)
    assert result.mass.correlation is not None and len(pts) == result.mass.n_points == result.mass.correlation.n
    xs = np.array([r.substituted_mass for r in pts], dtype=float)
    ys = np.array([r.delta.delta_pct for r in pts if r.delta], dtype=float)
    slope, intercept = np.polyfit(xs, ys, 1)
    assert line.slope == pytest.approx(slope, rel=1e-9) and line.intercept == pytest.approx(intercept, abs=1e-9)
    drawn = [ln for ln in figs[0].axes[0].get_lines() if ln.get_label().startswith("least squares")]
    assert len(drawn) == 1
    x, y = drawn[0].get_data()
    assert list(x) == [xs.min(), xs.max()]
    assert np.allclose(y, slope * np.asarray(x) + intercept, rtol=1e-9, atol=1e-12)
    c = result.mass.correlation
    assert f"r = {c.r:.3f} [95% CI {c.low:.3f}, {c.high:.3f}]" in figs[0].axes[0].get_title()


def test_synthetic_rows_frontier_falls_back_to_fetches(tmp_path: Path) -> None:
    rows = [_row("threshold", m, 5 * m, ms=None, tau=m) for m in (0.0, 0.1, 0.2, 0.3)]
    rows.append(_row("substitute-all", 0.5, 1.0, ms=None))
    paths = plots.plot_frontier(rows, (), tmp_path / "f")
    assert [p.name for p in paths] == ["f.png", "f.svg"] and all(p.stat().st_size > 0 for p in paths)
    assert "fetches per token" in paths[1].read_text()
    mass = mass_hypothesis(rows)
    _, line = plots.plot_mass(rows, mass, tmp_path / "m")  # substitute-all is left out, as in the hypothesis
    assert line.slope == pytest.approx(5.0) and line.intercept == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(HarnessError, match="at least 4"):
        plots.plot_mass(rows[:3], mass_hypothesis(rows[:3]), tmp_path / "m2")


def test_without_matplotlib_one_line_error(sweep_copy: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert main(["report", str(sweep_copy), "--model", str(MODEL), "--plots"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "harness: error: plots need matplotlib: pip install -e '.[plot]'"
    assert "Traceback" not in err


def test_compare_folder_says_plots_need_a_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "results.jsonl").write_text('{"schema_version": 1, "key": "meta", "kind": "meta", '
                                            '"command": "compare"}\n')
    assert main(["report", str(tmp_path), "--plots"]) == 2
    assert "plots need a sweep folder" in capsys.readouterr().err
