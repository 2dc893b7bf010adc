"""The bounded sanitizer run in CI (issue 15): our policy module, which takes every decision of the cache and parses
every spec, compiled with AddressSanitizer and UndefinedBehaviorSanitizer, runs its unit tests
(tests/cpp/test_expert_policy.cpp; test_expert_machine.cpp and test_expert_auto.cpp for the machine's facts and
--moe-cache auto) and a fuzz loop of random and mutated specs (tests/cpp/spec_parse.cpp) without a report. The full
run (the whole patched tree sanitized, the engine tests against it) is scripts/sanitize.sh.

A planted out-of-bounds read first proves that the sanitizers report here at all: otherwise a clean run would
mean nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from harness.core import project

ROOT = project.project_root()
SRC = ROOT / "src"
FLAGS = ["-std=c++17", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=all"]
ENV = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:halt_on_error=1",
       "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "PATH": "/usr/bin:/bin"}


def _cxx() -> str:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    return cxx


def _build(tmp: Path, name: str, *sources: Path) -> Path:
    exe = tmp / name
    r = subprocess.run([_cxx(), *FLAGS, f"-I{SRC / 'llama'}", f"-I{SRC / 'include'}", *map(str, sources), "-o",
                        str(exe)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "sanitize" in r.stderr and "unrecognized" in r.stderr:
        pytest.skip(f"the compiler has no sanitizers: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


@pytest.fixture(scope="module")
def policy_obj(tmp_path_factory: pytest.TempPathFactory, policy_sources: list[Path]) -> list[Path]:
    """The model-free sources (llama-expert-policy.cpp and its rooms) compiled once, sanitized, for both programs."""
    out = tmp_path_factory.mktemp("asan")
    objs = []
    for src in policy_sources:
        obj = out / (src.stem + ".o")
        r = subprocess.run([_cxx(), *FLAGS, "-c", f"-I{SRC / 'llama'}", f"-I{SRC / 'include'}", str(src), "-o",
                            str(obj)], capture_output=True, text=True, timeout=600)
        if r.returncode != 0 and "sanitize" in r.stderr and "unrecognized" in r.stderr:
            pytest.skip(f"the compiler has no sanitizers: {r.stderr.strip().splitlines()[-1]}")
        assert r.returncode == 0, r.stderr[-3000:]
        objs.append(obj)
    return objs


def _run(exe: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=ENV)


def _reports(res: subprocess.CompletedProcess[str]) -> bool:
    out = res.stdout + res.stderr
    return "ERROR: AddressSanitizer" in out or "runtime error:" in out or "ERROR: LeakSanitizer" in out


def test_the_sanitizers_report_a_planted_bug(tmp_path: Path) -> None:
    src = tmp_path / "planted.cpp"
    src.write_text("#include <vector>\n#include <cstdio>\nint main(int argc, char **) {\n"
                   "    std::vector<int> v(4, 1);\n    std::printf(\"%d\\n\", v.data()[3 + argc]);\n}\n")
    res = _run(_build(tmp_path, "planted", src))
    assert res.returncode != 0 and _reports(res), res.stdout + res.stderr


def test_policy_unit_tests_under_asan_and_ubsan(tmp_path: Path, policy_obj: list[Path]) -> None:
    exe = _build(tmp_path, "test_expert_policy", ROOT / "tests" / "cpp" / "test_expert_policy.cpp", *policy_obj)
    res = _run(exe)
    assert res.returncode == 0 and not _reports(res), (res.stdout + res.stderr)[-4000:]
    assert "all expert policy tests passed" in res.stdout


@pytest.mark.parametrize("room", ["machine", "auto"])
def test_machine_and_auto_unit_tests_under_asan_and_ubsan(tmp_path: Path, policy_obj: list[Path], room: str) -> None:
    """The parsers of /proc and /sys text (llama-expert-machine) and --moe-cache auto's decision, on fake facts."""
    exe = _build(tmp_path, f"test_expert_{room}", ROOT / "tests" / "cpp" / f"test_expert_{room}.cpp", *policy_obj)
    res = _run(exe)
    assert res.returncode == 0 and not _reports(res), (res.stdout + res.stderr)[-4000:]
    assert f"all expert {room} tests passed" in res.stdout


def test_spec_fuzz_under_asan_and_ubsan(tmp_path: Path, policy_obj: list[Path]) -> None:
    exe = _build(tmp_path, "spec_parse", ROOT / "tests" / "cpp" / "spec_parse.cpp", *policy_obj)
    res = _run(exe, "--fuzz", "20000", "7")
    assert res.returncode == 0 and not _reports(res), (res.stdout + res.stderr)[-4000:]
    assert res.stdout.startswith("fuzz: 20000 specs,"), res.stdout


def _script_options(reports_dir: Path) -> dict[str, str]:
    """ASAN_OPTIONS and UBSAN_OPTIONS as scripts/sanitize.sh exports them, its reports folder replaced."""
    env = dict(ENV)
    for line in (ROOT / "scripts" / "sanitize.sh").read_text().splitlines():
        for name in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
            if line.startswith(f'export {name}="'):
                env[name] = line.split('"')[1].replace("$reports_dir", str(reports_dir))
    assert "log_path=" in env["ASAN_OPTIONS"] and "log_path=" in env["UBSAN_OPTIONS"], env
    return env


def test_sanitize_sh_keeps_a_report_on_an_error_path(tmp_path: Path) -> None:
    """Before, scripts/sanitize.sh grepped the output of failing tests only; a report on an error path (a refusal
    test expects a non-zero exit, so it passes) was never seen. Now the reports go to log_path files, which the
    script counts after every run: a planted bug on an error path, run with the script's options, exits non-zero as
    the refusal would, prints nothing of the report, and leaves it in reports/asan.<pid>."""
    src = tmp_path / "refusal.cpp"
    src.write_text("#include <vector>\n#include <cstdio>\nint main(int argc, char **) {\n"
                   "    std::vector<int> v(4, 1);\n"
                   "    std::fprintf(stderr, \"error: bad value (%d)\\n\", v.data()[3 + argc]);\n    return 1;\n}\n")
    exe = _build(tmp_path, "refusal", src)
    reports = tmp_path / "reports"
    reports.mkdir()
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=_script_options(reports))
    assert res.returncode != 0 and not _reports(res), res.stdout + res.stderr  # a refusal test would pass
    files = [f for f in reports.iterdir() if f.stat().st_size > 0]
    assert len(files) == 1 and files[0].name == f"asan.{files[0].name.split('.')[-1]}", files
    assert "ERROR: AddressSanitizer" in files[0].read_text()
