"""The CLI exposes every documented command, and each parses its --help."""

import pytest

from harness.cli import build_parser, main

COMMANDS = ("doctor", "info", "synth", "compare", "sweep", "check", "report", "topics", "study", "simulate",
            "calibrate")


def test_every_command_is_registered() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(COMMANDS) <= set(sub.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert f"harness {command}" in capsys.readouterr().out


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
