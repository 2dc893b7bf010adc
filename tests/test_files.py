"""harness.core.files: special files (FIFOs, devices, sockets, folders) refused up front, in one line, for every
path the harness reads or passes to a tool. Opening a FIFO blocks until a writer comes, so every case here runs
under an alarm: a regression fails the test instead of hanging the suite."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness.core.errors import HarnessError
from harness.core.files import CACHE_PATH_KEYS, refuse_special, require_regular_file, special_kind
from harness.tools.runners import CACHE_ENV_VAR, run_tool


@contextmanager
def _no_hang(seconds: int = 20) -> Iterator[None]:
    def fire(signum: int, frame: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s: the special file was opened")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def _refused(call: Callable[[], Any], *parts: str) -> str:
    with _no_hang(), pytest.raises(HarnessError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg
    return msg


def test_special_kinds(tmp_path: Path, fifo: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    (tmp_path / "link").symlink_to(f)
    assert special_kind(f) is None and special_kind(tmp_path / "link") is None
    assert special_kind(tmp_path / "missing") is None
    assert special_kind(fifo) == "a FIFO (named pipe)"
    assert special_kind("/dev/null") == "a character device"
    assert special_kind(tmp_path) == "a folder"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        assert special_kind(tmp_path / "sock") == "a socket"
    refuse_special(tmp_path / "missing", "stats=")  # an output that does not exist yet passes
    assert _refused(lambda: refuse_special(fifo, "stats="), f"stats={fifo} is a FIFO (named pipe)")
    _refused(lambda: require_regular_file(tmp_path / "missing", "the model"), "the model", "no such file")
    _refused(lambda: require_regular_file(tmp_path, "the model"), "is a folder, not a file")


@pytest.mark.parametrize("key", CACHE_PATH_KEYS)
def test_a_tool_is_not_started_with_a_special_file_in_its_cache_spec(tmp_path: Path, fifo: Path, key: str) -> None:
    """Before: profile=, stats=, trace= or profile_out= naming a FIFO blocked the tool forever in open(). Now the
    harness refuses it before starting the tool (the tool here would write a marker file if it were started)."""
    marker = tmp_path / "started"
    tool = tmp_path / "llama-bench"
    tool.write_text(f"#!/bin/sh\ntouch {marker}\n")
    tool.chmod(0o755)
    env = {CACHE_ENV_VAR: f"mode=emulate,policy=quality,{key}={fifo},slots=4"}
    _refused(lambda: run_tool(tool, ["-m", str(tmp_path / "m.gguf")], env=env, sample_gpu=False),
             f"{key}={fifo} is a FIFO (named pipe), not a regular file")
    env = {CACHE_ENV_VAR: f"mode=emulate, {key} = /dev/zero"}  # spaces as the engine's parser allows them
    _refused(lambda: run_tool(tool, [], env=env, sample_gpu=False), f"{key}=/dev/zero is a character device")
    _refused(lambda: run_tool(tmp_path / "llama-moe-sim", ["--trace", str(tmp_path / "t"), "--spec",
                                                            f"policy=quality,{key}={fifo}"], sample_gpu=False),
             f"{key}={fifo} is a FIFO")
    assert not marker.exists()
    run_tool(tool, ["-m", str(tmp_path / "m.gguf")], env={CACHE_ENV_VAR: f"mode=emulate,{key}={tmp_path / 'out'}"},
             sample_gpu=False)  # a path that does not exist yet (an output) is fine
    assert marker.exists()
    marker.unlink()
    run_tool(tool, [], env={CACHE_ENV_VAR: f"mode=emulate,{key}=/dev/stdout"}, sample_gpu=False)
    assert marker.exists()  # a standard stream is open already: allowed, as the engine allows it


@pytest.mark.parametrize(("flag", "what"), [("-m", "the model"), ("-f", "the text"), ("--nll-dump", "--nll-dump"),
                                            ("--trace", "--trace"), ("--stats", "--stats")])
def test_a_tool_is_not_started_with_a_special_file_as_an_argument(tmp_path: Path, fifo: Path, flag: str,
                                                                  what: str) -> None:
    _refused(lambda: run_tool(tmp_path / "llama-perplexity", [flag, str(fifo)], sample_gpu=False),
             f"{what} {fifo} is a FIFO")


def test_the_harness_own_inputs_refuse_special_files(tmp_path: Path, fifo: Path) -> None:
    from harness.domain.costmodel import load_profile_file
    from harness.orchestration.compare import resolve_text
    from harness.orchestration.simulate import SimulateOptions, run_calibrate, simulate
    from harness.parsers.gguf_model import read_model_info
    from harness.parsers.nll_dump import read_nll_dump_file
    from harness.parsers.trace import read_expert_trace, read_trace_header
    from harness.tools.datasets import read_prompts

    _refused(lambda: read_model_info(fifo), f"the model {fifo} is a FIFO")
    _refused(lambda: read_model_info(tmp_path), f"the model {tmp_path} is a folder")
    _refused(lambda: resolve_text(fifo, None), f"the text {fifo} is a FIFO")
    _refused(lambda: read_trace_header(fifo), f"the trace {fifo} is a FIFO")
    _refused(lambda: read_expert_trace(fifo), f"the trace {fifo} is a FIFO")
    _refused(lambda: read_nll_dump_file(fifo), f"the NLL dump {fifo} is a FIFO")
    _refused(lambda: load_profile_file(fifo), f"the hardware profile {fifo} is a FIFO")
    _refused(lambda: run_calibrate(fifo, "rtx3090", tmp_path / "p.json"), f"the measured runs {fifo} is a FIFO")
    _refused(lambda: read_prompts(fifo), f"the prompt file {fifo} is a FIFO")
    _refused(lambda: simulate(SimulateOptions(trace=fifo, model=tmp_path / "m.gguf")), f"--trace {fifo} is a FIFO")


def test_the_cli_refuses_special_files_in_one_line(tmp_path: Path, fifo: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Through the commands: compare's --model and --text, check's --baseline (which --update would write into),
    info, simulate's --trace: exit 2 and one line, nothing blocks."""
    from harness.cli.app import main
    from harness.tools.synth import SynthSpec, write_synth_model

    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    for argv, message in (
            (["info", str(fifo)], f"the model {fifo} is a FIFO"),
            (["compare", "--model", str(fifo), "--out", str(tmp_path / "o1")], f"the model {fifo} is a FIFO"),
            (["compare", "--model", str(model), "--text", str(fifo), "--out", str(tmp_path / "o2")],
             f"the text {fifo} is a FIFO"),
            (["check", "--baseline", str(fifo), "--update", "--out", str(tmp_path / "o3")],
             f"--baseline {fifo} is a FIFO"),
            (["simulate", "--trace", str(fifo), "--model", str(model)], f"--trace {fifo} is a FIFO")):
        with _no_hang():
            assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("harness: error: ") and message in err and "\n" not in err, err


def test_the_key_list_is_the_engines(tmp_path: Path) -> None:
    """CACHE_PATH_KEYS are the keys the engine's spec parser takes as file paths (one list in two languages)."""
    import re

    # the spec's key table (src/llama/llama-expert-spec.h): a path key is a row whose accepted text is "a file path"
    table = (Path(__file__).parents[1] / "src/llama/llama-expert-spec.h").read_text()
    keys = re.findall(r'X\((\w+),\s*"a file path"\)', table)
    assert keys and sorted(CACHE_PATH_KEYS) == sorted(keys)


@pytest.mark.build
def test_the_tools_refuse_a_fifo_without_the_harness(tmp_path: Path, fifo: Path, patched_build: Any,
                                                     synth_text_file: Path) -> None:
    """The engine's own check (src/llama/llama-expert-paths.h), for users who run the tools directly: a FIFO as
    stats=, profile_out=, profile= or trace= is refused when the spec is parsed, and llama-moe-sim's --trace and
    --stats, in one line; before, the tool blocked forever in open()."""
    import subprocess

    from harness.tools.synth import SynthSpec, write_synth_model

    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    base = {k: v for k, v in os.environ.items() if k != CACHE_ENV_VAR}
    for key in CACHE_PATH_KEYS:
        env = {**base, CACHE_ENV_VAR: f"mode=emulate,policy=quality,slots=50%,{key}={fifo}"}
        res = subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(model), "-f",
                              str(synth_text_file), "-c", "128", "--chunks", "1", "-t", "2"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode != 0, key
        assert f"{key}={fifo} is a FIFO (named pipe), not a regular file" in res.stdout + res.stderr, key
    sim = str(patched_build.tool("llama-moe-sim"))
    res = subprocess.run([sim, "--trace", str(fifo), "--spec", "policy=quality,slots=4"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and f"--trace {fifo} is a FIFO (named pipe)" in res.stderr, res.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("block", [1 << 20, 3])  # 3: the bad sequence can straddle two blocks
def test_a_text_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path, block: int) -> None:
    """llama.cpp's tokenizer aborts on an invalid UTF-8 sequence (stock too: std::invalid_argument, "invalid
    codepoint"), so the harness refuses such a text before a tool starts, naming the offending byte."""
    from harness.core.files import require_utf8_text

    good = tmp_path / "good.txt"
    good.write_text("déjà vu — 日本語\n" * 50, encoding="utf-8")
    require_utf8_text(good, block=block)
    bad = tmp_path / "bad.txt"
    bad.write_bytes("déjà vu ".encode() + b"\xff" + b"ok")
    msg = _refused(lambda: require_utf8_text(bad, block=block), f"the text {bad} is not UTF-8",
                   "byte 0xff at offset 10")
    assert "iconv" in msg
    cut = tmp_path / "cut.txt"  # ends inside a multi-byte sequence
    cut.write_bytes(b"abc" + "é".encode()[:1])
    _refused(lambda: require_utf8_text(cut, block=block), "is not UTF-8", "at offset 3")


def test_the_commands_refuse_a_text_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.cli.app import main
    from harness.tools.synth import SynthSpec, write_synth_model

    model = write_synth_model(SynthSpec(), tmp_path / "m.gguf")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    for cmd in ("compare", "sweep", "bpb"):
        argv = [cmd, "--model", str(model), "--text", str(bad), "--out", str(tmp_path / cmd)] if cmd != "bpb" \
            else [cmd, str(model), "--text", str(bad), "--out", str(tmp_path / cmd)]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("harness: error: ") and "is not UTF-8 (byte 0xe9 at offset 3)" in err, (cmd, err)
