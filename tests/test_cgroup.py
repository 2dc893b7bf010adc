"""harness.tools.cgroup: the memory cgroup of `harness compare --ram` and scripts/bench_tiers.py. The parts that
need a real writable memory cgroup (v1 or v2, below this process's own) are skipped, with the reason, where there
is none."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.tools.cgroup import CgroupError, MemoryCgroup, check_ram_limit, drop_page_cache, mem_available
from harness.tools.runners import ToolCrashedError, run_tool

MiB = 2**20


def test_a_limit_above_mem_available_less_the_margin_is_refused() -> None:
    check_ram_limit(6 << 30, 8 << 30)  # 8 GiB available less 2 GiB: 6 GiB is allowed
    with pytest.raises(HarnessError) as e:
        check_ram_limit(7 << 30, 8 << 30)
    msg = str(e.value)
    assert "\n" not in msg and "--ram 7 GiB" in msg and "MemAvailable (8 GiB)" in msg and "a 2 GiB margin" in msg


def test_mem_available_reads_meminfo(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert mem_available(tmp_path / "meminfo") == 2 * MiB
    assert 0 < mem_available()


def test_the_cgroup_is_made_below_our_own_v1(tmp_path: Path) -> None:
    own = tmp_path / "memory" / "a" / "b"
    own.mkdir(parents=True)
    cg = MemoryCgroup(64 * MiB, "t", root=tmp_path, proc_cgroup="5:cpu,cpuacct:/\n4:memory:/a/b\n0::/\n")
    assert cg.version == 1 and cg.path == own / f"t-{os.getpid()}"
    assert (own / f"t-{os.getpid()}" / "memory.limit_in_bytes").read_text() == str(64 * MiB)
    (cg.path / "memory.limit_in_bytes").unlink()  # a real cgroup's files vanish with it
    cg.close()
    assert not (own / f"t-{os.getpid()}").exists()


def test_the_cgroup_is_made_below_our_own_v2(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    own = tmp_path / "user.slice" / "x.scope"
    own.mkdir(parents=True)
    cg = MemoryCgroup(64 * MiB, "t", root=tmp_path, proc_cgroup="0::/user.slice/x.scope\n")
    assert cg.version == 2 and cg.limit_file == "memory.max" and cg.peak_file == "memory.peak"
    assert (own / "cgroup.subtree_control").read_text() == "+memory"  # a fake root has no memory.max yet


def test_no_memory_cgroup_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(CgroupError) as e:
        MemoryCgroup(64 * MiB, root=tmp_path, proc_cgroup="0::/\n")
    assert "\n" not in str(e.value) and "no memory cgroup" in str(e.value) and "without --ram" in str(e.value)


def test_an_unwritable_cgroup_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    # our own cgroup's folder does not exist: mkdir below it fails as when it is not writable
    with pytest.raises(CgroupError) as e:
        MemoryCgroup(64 * MiB, root=tmp_path, proc_cgroup="4:memory:/gone/away\n")
    msg = str(e.value)
    assert "\n" not in msg and "cannot make a memory cgroup" in msg and "writable memory cgroup" in msg


def _real(limit: int) -> MemoryCgroup:
    try:
        return MemoryCgroup(limit, "moe-subst-test")
    except CgroupError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")


def _alloc(mib: int) -> list[str]:
    """A child that touches `mib` MiB of anonymous memory."""
    return [sys.executable, "-c", f"b = bytearray({mib} << 20)"]


def test_a_real_cgroup_limits_measures_and_goes() -> None:
    with _real(128 * MiB) as cg:
        path = cg.path
        assert path is not None and path.is_dir()
        with cg.measure() as small:
            rc, _, _ = cg.run(_alloc(40), os.environ, 60)
        assert rc == 0
        assert small.peak is not None and 40 * MiB < small.peak <= 128 * MiB
        with cg.measure() as big:
            rc, _, _ = cg.run(_alloc(300), os.environ, 60)
        assert rc == -9  # killed by the cgroup's OOM killer, not the machine's
        assert big.peak is not None and small.peak < big.peak <= 128 * MiB
        with cg.measure() as again:  # the peak is per run
            rc, _, _ = cg.run(_alloc(1), os.environ, 60)
        if cg.version == 1:
            assert again.peak is not None and again.peak < big.peak
    assert cg.path is None and not path.exists()


def test_the_cgroup_goes_on_ctrl_c() -> None:
    cg = _real(64 * MiB)
    path = cg.path
    assert path is not None
    with pytest.raises(KeyboardInterrupt), cg:
        raise KeyboardInterrupt
    assert not path.exists()


def test_run_tool_inside_a_cgroup_records_the_peak_and_names_the_oom_killer(tmp_path: Path) -> None:
    model = tmp_path / "model.bin"
    model.write_bytes(b"\0" * MiB)
    with _real(96 * MiB) as cg:
        out = run_tool(Path(sys.executable), ["-c", "b = bytearray(30 << 20)"], cgroup=cg, uncached=model,
                       sample_gpu=False)
        assert out.peak_ram_bytes is not None and 30 * MiB < out.peak_ram_bytes <= 96 * MiB
        assert out.ram_limit_bytes == 96 * MiB and out.peak_ram_source.startswith(f"cgroup v{cg.version} ")
        with pytest.raises(ToolCrashedError, match="OOM killer.*give a larger --ram"):
            run_tool(Path(sys.executable), ["-c", "b = bytearray(300 << 20)"], cgroup=cg, sample_gpu=False)


def test_drop_page_cache_takes_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 4096)
    drop_page_cache(f)
    with pytest.raises(FileNotFoundError):
        drop_page_cache(tmp_path / "missing")
