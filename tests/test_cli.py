"""The CLI exposes every documented command, and each parses its --help."""

from pathlib import Path

import pytest

from harness.cli import build_parser, main

COMMANDS = ("doctor", "info", "synth", "compare", "sweep", "frontier", "check", "report", "topics", "study", "simulate",
            "calibrate", "composition", "generate", "bpb")


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


OUT_COMMANDS = (["compare"], ["sweep"], ["frontier"], ["topics"], ["study"], ["check", "--baseline", "b.json"],
                ["composition"], ["generate"])


@pytest.mark.parametrize("command", OUT_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("where", ["file", "under-a-file", "proc"])
def test_a_bad_out_is_one_line_before_anything_runs(command: list[str], where: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--out that is a file, lies under a file, or cannot be created: one line and exit 2, not a traceback;
    nothing runs (the model is not even looked for: a run would need one)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("x")
    out = {"file": tmp_path / "f", "under-a-file": tmp_path / "f" / "sub", "proc": Path("/proc/forbidden")}[where]
    if where == "proc" and not Path("/proc").is_dir():
        pytest.skip("no /proc")
    from harness.orchestration import compare

    def no_model(root: Path | None = None) -> Path:
        raise AssertionError("the model was looked for before --out was checked")

    monkeypatch.setattr(compare, "default_model", no_model)
    assert main([*command, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()  # the progress bar of compare and sweep leaves an empty line
    assert err.startswith(f"harness: error: --out {out}") and "\n" not in err, err
    assert "Traceback" not in err
