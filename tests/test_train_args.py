"""scripts/train_moe.py's options over a shape: an option left out keeps the shape's value (the localmoe run of
issue 36 was trained with batch-scope balancing because --aux-scope's default overrode the shape's "global").

No torch needed: the module imports torch only where it trains."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import train_moe as tm  # noqa: E402


def _cfg(*argv: str) -> tm.Config:
    ap = tm.build_parser()
    return tm.config_from_args(ap.parse_args(["--stage", "export", *argv]), ap.error)


def test_left_out_options_keep_the_shapes_levers() -> None:
    cfg = _cfg("--shape", "localmoe")
    shape = tm.SHAPES["localmoe"]
    assert cfg.aux_scope == shape["aux_scope"] == "global"
    assert (cfg.aux_loss_coef, cfg.capacity_factor, cfg.locality_coef, cfg.locality_window, cfg.lr) == (
        shape["aux_loss_coef"], shape["capacity_factor"], shape["locality_coef"], shape["locality_window"], shape["lr"])


def test_given_options_override_the_shape() -> None:
    cfg = _cfg("--shape", "localmoe", "--aux-scope", "batch", "--aux-coef", "0.1", "--locality-window", "16")
    assert (cfg.aux_scope, cfg.aux_loss_coef, cfg.locality_window) == ("batch", 0.1, 16)
    assert _cfg("--shape", "studymoe").aux_scope == tm.Config(**tm.SHAPES["studymoe"]).aux_scope


@pytest.mark.parametrize("argv, message", [(["--locality-window", "7"], "--locality-window"),
                                           (["--aux-ema", "1.5"], "--aux-ema"),
                                           (["--stable-steps", "10"], "--stable-steps")])
def test_bad_options_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _cfg("--shape", "studymoe", *argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
