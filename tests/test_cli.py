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


def test_progress_in_a_log_is_one_line_per_step() -> None:
    """Where stderr is not a terminal (a log file) rich draws no bar: the commands write a plain line when a step
    starts or ends, at the end, and for a counter that moves under one label at most every `every_s` seconds."""
    import io

    from harness.cli.app import _progress_lines

    out = io.StringIO()
    progress = _progress_lines("study", out, every_s=3600)
    progress(0, 3, "full")
    progress(1, 3, "full (peak 12 MiB)")
    progress(1, 3, "rule-0.15")
    for done in range(100):  # bytes under one label: throttled
        progress(done, 1000, "pack layer 0")
    progress(1000, 1000, "pack layer 0")
    lines = out.getvalue().splitlines()
    assert [line.rsplit(" (", 1)[0] for line in lines] == [
        "study: 0/3 full", "study: 1/3 full (peak 12 MiB)", "study: 1/3 rule-0.15", "study: 0/1000 pack layer 0",
        "study: 1000/1000 pack layer 0"]
    assert all(line.endswith(" s)") for line in lines)
