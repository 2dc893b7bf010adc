"""host=file's mapping: the non-expert weights' ranges read without readahead into the experts
(src/llama/llama-expert-mapping.cpp; its unit test tests/cpp/test_expert_mapping.cpp), and a running engine's
mapping carries it (llama-server's /proc/PID/smaps)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUR_SRC = ROOT / "src"


def test_expert_mapping_unit(tmp_path: Path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "test_expert_mapping"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{OUR_SRC / 'llama'}",
                    str(ROOT / "tests" / "cpp" / "test_expert_mapping.cpp"),
                    str(OUR_SRC / "llama" / "llama-expert-mapping.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all expert mapping tests passed" in res.stdout
