"""Every command of the front door (README.md's indented command lines) is run by a test (issue 39): a command added
to the README without a runner here fails `test_every_readme_command_has_a_runner`, and a runner whose command left
the README fails it too.

Each runner runs the README's line as written, with two kinds of change, both stated in its runner: `model.gguf`
(the reader's own model) is the project's quick trained model (models/tinymoe-f16.gguf), and options that only make
a run shorter or keep it out of the repository and the user's profile directory are appended (`--out`,
`--profile-out`, fewer chunks, runs and tokens). The README's own test command is the one CI runs (`.ci/run`); its
runner checks that .ci/run runs it rather than running pytest inside pytest.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.core.project import Build, project_root
from harness.tools.cgroup import CgroupError, MemoryCgroup

ROOT = project_root()
README = ROOT / "README.md"
QUICK_MODEL = ROOT / "models" / "tinymoe-f16.gguf"
MiB = 1 << 20


def readme_commands(text: str) -> list[str]:
    """The README's indented command lines (4 spaces, outside tables), each without its trailing `# comment`."""
    out = []
    for line in text.splitlines():
        if line.startswith("    ") and line.strip() and not line.lstrip().startswith("|"):
            out.append(re.sub(r"\s{2,}#.*$", "", line.strip()))
    return out


def test_readme_commands_are_found() -> None:
    text = "intro\n\n    ./build.sh && x      # a comment\n    y --a b\n\n| table |\n"
    assert readme_commands(text) == ["./build.sh && x", "y --a b"]


def harness_cli(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _harness_argv(line: str) -> list[str]:
    argv = shlex.split(line)
    assert argv[0] == ".venv/bin/harness", line
    return argv[1:]


def _model(argv: list[str]) -> list[str]:
    if not QUICK_MODEL.is_file():
        pytest.skip(f"{QUICK_MODEL} is missing")
    return [str(QUICK_MODEL) if a == "model.gguf" else a for a in argv]


def run_build_and_compare(line: str, tmp_path: Path, builds: tuple[Build, Build]) -> None:
    build, compare_line = (part.strip() for part in line.split("&&"))
    res = subprocess.run(shlex.split(build), cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-2000:]  # built already: checks the pin and the trees, builds nothing
    # shorter: 8 chunks of perplexity and 2 llama-bench runs a configuration, 16 generated tokens
    res = harness_cli(*_harness_argv(compare_line), "--chunks", "8", "--runs", "2", "--n-gen", "16", "--n-prompt",
                      "64", "--out", str(tmp_path / "cmp"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "model: localmoe (qwen3moe), 6 MoE layers x 512 experts, top-10" in res.stdout  # the default model
    report = (tmp_path / "cmp" / "report.md").read_text()
    for config in ("stock llama.cpp", "quality", "speed", "fetch-all"):
        assert config in report


def run_compare_ram(line: str, tmp_path: Path, builds: tuple[Build, Build]) -> None:
    try:
        MemoryCgroup(64 * MiB, "moe-subst-probe").close()
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    # shorter: 4 chunks, 2 runs a configuration, 16 generated tokens
    res = harness_cli(*_harness_argv(line), "--chunks", "4", "--runs", "2", "--n-gen", "16", "--n-prompt", "32",
                      "--out", str(tmp_path / "ram"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "RAM limit: 80 MiB (0.96x the file)" in res.stdout, res.stdout[:2000]  # bigger than the limit
    assert "patched: mode=engine,host=file,slots=" in res.stdout
    peaks = re.findall(r"peak (\d+(?:\.\d+)?) MiB of the 80 MiB limit", res.stderr + res.stdout)
    assert peaks and all(float(p) <= 80 for p in peaks)
    assert "tg16" in (tmp_path / "ram" / "report.md").read_text()


def run_set_build_dir(line: str, tmp_path: Path, builds: tuple[Build, Build]) -> None:
    name, value = line.split("=", 1)
    assert name == "B"
    assert (ROOT / value / "llama-server").is_file(), f"{value}/llama-server: the README's B= names no build"
    assert Path(value) == builds[1].tool("llama-server").parent.relative_to(ROOT)


def run_server(line: str, tmp_path: Path, builds: tuple[Build, Build]) -> None:
    from harness.tools.server import llama_server

    argv = _model(shlex.split(line))
    assert argv[0] == "$B/llama-server" and argv[1] == "-m", line
    binary, model, extra = builds[1].tool("llama-server"), Path(argv[2]), argv[3:]
    with llama_server(binary, model, tmp_path / "server.log", ctx=512, threads=2, extra=extra) as s:
        assert s.complete("def add(a, b):", n_predict=8)
        metrics = s.metrics()
        log = s.log()
    spec = extra[extra.index("--moe-cache") + 1]
    if spec == "auto":  # the model fits this machine: auto says so in one line and leaves the cache off
        assert "auto: off: the model" in log, log[-2000:]
        assert metrics.cache is None
    else:  # the engine serves the request and counts it
        assert metrics.cache is not None and metrics.cache.counters["calls"] > 0, log[-2000:]


def run_tune(line: str, tmp_path: Path, builds: tuple[Build, Build]) -> None:
    # shorter: one threshold, one zero tau, one admission, 2 chunks; the profile and records into tmp_path (not next
    # to the model, where auto would take it up)
    res = harness_cli(*_model(_harness_argv(line)), "--taus", "0.1", "--zero-taus", "0.2", "--admits", "0.5",
                      "--evicts", "lfu", "--prefetch", "off", "--ctx", "256", "--chunks", "2", "--threads", "2",
                      "--profile-out", str(tmp_path / "m.moe-tune.json"), "--out", str(tmp_path / "tune"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "m.moe-tune.json").is_file() and (tmp_path / "tune" / "report.md").is_file()


def run_check(line: str, tmp_path: Path, builds: tuple[Build, Build]) -> None:
    res = harness_cli(*_harness_argv(line), "--out", str(tmp_path / "check"))
    assert res.returncode == 0, (res.stdout + res.stderr)[-2000:]  # the committed baseline passes on this build


def run_test_command(line: str, tmp_path: Path, builds: tuple[Build, Build]) -> None:
    build, test = (part.strip() for part in line.split("&&"))
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(build)}$", ci, re.M), "CI does not run the README's build"
    assert re.search(r"^(\S+=\S+ )*" + re.escape(test) + r"( -ra)?$", ci, re.M), "CI does not run the README's tests"
    res = subprocess.run(shlex.split(build), cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-2000:]  # installed already: checks the stamp, installs nothing


Runner = Callable[[str, Path, tuple[Build, Build]], None]
RUNNERS: dict[str, Runner] = {
    "./build.sh && .venv/bin/harness compare": run_build_and_compare,
    ".venv/bin/harness compare --ram 80M --reserve 16M": run_compare_ram,
    "B=vendor/llama.cpp-patched/build-cpu/bin": run_set_build_dir,
    "$B/llama-server -m model.gguf -nr --moe-cache auto --metrics": run_server,
    "$B/llama-server -m model.gguf -ngl 99 --cpu-moe --load-mode none --moe-cache mode=engine,policy=quality,vram=24G":
        run_server,
    "$B/llama-server -m model.gguf -nr --moe-cache mode=engine,policy=quality,host=file,ram=8G": run_server,
    ".venv/bin/harness tune model.gguf --max-delta-ppl 1%": run_tune,
    ".venv/bin/harness check --baseline eval/baselines/tinymoe.json": run_check,
    "./build.sh --bindings && .venv/bin/python -m pytest": run_test_command,
}


def test_every_readme_command_has_a_runner() -> None:
    found = readme_commands(README.read_text())
    assert sorted(found) == sorted(RUNNERS), {"without a runner": sorted(set(found) - set(RUNNERS)),
                                              "no longer in the README": sorted(set(RUNNERS) - set(found))}


@pytest.mark.build
@pytest.mark.parametrize("line", list(RUNNERS))
def test_the_readme_command_runs(line: str, tmp_path: Path, stock_build: Build, patched_build: Build) -> None:
    RUNNERS[line](line, tmp_path, (stock_build, patched_build))
