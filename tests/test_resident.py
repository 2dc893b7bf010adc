"""Near the fit, auto measures whether stock's weights stay resident (src/llama/llama-expert-resident.cpp; its unit
test tests/cpp/test_expert_resident.cpp): unit checks, and the measurement inside a real memory cgroup, where a file
above the limit, or one that fits only without the ballast, loses pages while it is touched."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUR_SRC = ROOT / "src"
MiB = 1 << 20


@pytest.fixture(scope="module")
def exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("resident") / "test_expert_resident"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{OUR_SRC / 'llama'}",
                    str(ROOT / "tests" / "cpp" / "test_expert_resident.cpp"),
                    str(OUR_SRC / "llama" / "llama-expert-resident.cpp"), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    return out


def test_expert_resident_unit(exe: Path) -> None:
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all expert resident tests passed" in res.stdout


def _measure(exe: Path, path: Path, ballast: int, preexec: Callable[[], None] | None = None) -> tuple[int, int]:
    from harness.tools.cgroup import drop_page_cache

    drop_page_cache(path)  # its pages are charged to whoever reads them next: the measured process
    res = subprocess.run([str(exe), str(path), str(ballast)], capture_output=True, text=True, timeout=120,
                         preexec_fn=preexec)
    assert res.returncode == 0, res.stdout + res.stderr
    f = res.stdout.split()
    assert f[0] == "touched" and f[6:8] == ["ok", "1"] and int(f[5]) == ballast, res.stdout
    return int(f[1]), int(f[3])


def test_the_measurement_sees_a_memory_limit(exe: Path, tmp_path: Path) -> None:
    """A 40 MiB file: all resident without a limit; in a 64 MiB cgroup all resident beside no ballast and short of
    that beside a 40 MiB one; in a 24 MiB cgroup, short. The planted bug (counting the touch, not mincore) would say
    all resident in every case."""
    from harness.tools.cgroup import CgroupError, MemoryCgroup, check_ram_limit, mem_available

    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(40 * MiB))
    touched, resident = _measure(exe, path, 0)
    assert touched == 40 * MiB and resident == touched
    check_ram_limit(64 * MiB, mem_available(), 512 * MiB, what="the test's cgroup")
    for limit, ballast, fits in ((64 * MiB, 0, True), (64 * MiB, 40 * MiB, False), (24 * MiB, 0, False)):
        try:
            cg = MemoryCgroup(limit, "moe-subst-residenttest")
        except CgroupError as e:
            pytest.skip(f"no writable memory cgroup here: {e}")
        with cg:
            touched, resident = _measure(exe, path, ballast, cg.preexec)
        assert touched == 40 * MiB, touched
        if fits:
            assert resident == touched, (limit, ballast, resident)
        else:
            assert resident < touched - 4 * MiB, (limit, ballast, resident)
