"""harness.tools.cgroup: the memory cgroup of `harness compare --ram` and scripts/bench_tiers.py. The parts that
need a real writable memory cgroup (v1 or v2, below this process's own) are skipped, with the reason, where there
is none."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.tools.cgroup import (
    CgroupError,
    MemoryCgroup,
    check_ram_limit,
    drop_page_cache,
    mem_available,
    stale_cgroups,
)
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


def test_stale_cgroups_are_ours_by_name_and_dead_owner(tmp_path: Path) -> None:
    """Only our names (moe-subst[-word]-<pid>), only a dead owner or a pid reused since the cgroup was made; never
    this process's own, never another program's cgroup."""
    import time

    now = time.time()
    for name in ("moe-subst-compare-111", "moe-subst-compare-222", "moe-subst-bench-333", "moe-subst-444",
                 f"moe-subst-test-{os.getpid()}", "other-555", "moe-subst-compare-abc", "moe-subst-compare-666-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "moe-subst-777").write_text("")  # a file, not a cgroup
    starts = {222: now - 3600, 333: now + 60, 444: now - 1, os.getpid(): now - 3600, 555: None, 777: None}
    found = stale_cgroups(tmp_path, start_time=lambda pid: starts.get(pid))
    # 111: no such process; 333: a process that started after the cgroup was made (the pid reused)
    assert found == [(tmp_path / "moe-subst-bench-333", 333), (tmp_path / "moe-subst-compare-111", 111)]


_HARNESS_LIKE = """
import subprocess, sys, time
from harness.tools.cgroup import MemoryCgroup
cg = MemoryCgroup(64 << 20, "moe-subst-compare")  # as `harness compare --ram` makes it
tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], preexec_fn=cg.preexec)
print(cg.path, tool.pid, flush=True)
time.sleep(300)
"""


def test_a_killed_harness_leaves_nothing_behind() -> None:
    """Before: SIGKILL of `harness compare --ram` left its moe-subst-compare-<pid> cgroup and the tool running in it
    behind, and the next run did not clean them up. Now the next cgroup made beside it removes both (and says so);
    the process in it here stands for llama-bench."""
    import signal
    import subprocess

    probe = _real(64 * MiB)  # skips without a writable memory cgroup
    probe.close()
    harness = subprocess.Popen([sys.executable, "-c", _HARNESS_LIKE], stdout=subprocess.PIPE, text=True)
    assert harness.stdout is not None
    path_s, tool_s = harness.stdout.readline().split()
    path, tool = Path(path_s), int(tool_s)
    try:
        assert tool in [int(x) for x in (path / "cgroup.procs").read_text().split()]
        harness.send_signal(signal.SIGKILL)
        harness.wait()
        assert path.is_dir() and _running(tool)  # what SIGKILL leaves
        with _real(64 * MiB) as cg:
            assert not path.exists() and not _running(tool)
            assert len(cg.cleaned) == 1, cg.cleaned
            assert cg.cleaned[0].startswith(f"removed the stale memory cgroup {path.name} of a harness that was "
                                            f"killed (pid {harness.pid}), and ended what still ran in it: ")
            assert f"(pid {tool})" in cg.cleaned[0]
        with _real(64 * MiB) as cg:
            assert cg.cleaned == ()  # nothing stale any more
    finally:  # a failed test leaves nothing either: the tool is this test's own process
        if _running(tool):
            os.kill(tool, signal.SIGKILL)
        if path.exists():
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except OSError:
                    import time

                    time.sleep(0.1)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan may wait for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_drop_page_cache_takes_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 4096)
    drop_page_cache(f)
    with pytest.raises(FileNotFoundError):
        drop_page_cache(tmp_path / "missing")


def _written(path: Path, size: int) -> Path:
    """A file of `size` random bytes, written back to disk (DONTNEED drops clean pages only), then read: cached."""
    with path.open("wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    path.read_bytes()
    return path


def _resident_bytes(path: Path) -> int:
    """How much of `path` is in the page cache now (mincore(2) over a mapping that touches nothing)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    n_pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    with path.open("rb") as f:
        m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        anchor = ctypes.c_char.from_buffer(m)  # the mapping's address, for mincore
        vec = (ctypes.c_ubyte * n_pages)()
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        del anchor
        assert rc == 0, f"mincore: errno {ctypes.get_errno()}"
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
    finally:
        m.close()


def test_drop_page_cache_drops_the_files_pages(tmp_path: Path) -> None:
    """Before, the test only called it; a no-op passed. Now: a cached file is (almost) all resident before and
    (almost) none of it after."""
    f = _written(tmp_path / "f", 32 * MiB)
    assert _resident_bytes(f) >= 30 * MiB  # cached: the check below can tell a drop from none
    drop_page_cache(f)
    assert _resident_bytes(f) <= 2 * MiB


def _cache_bytes(cg: MemoryCgroup) -> int:
    """The page cache charged to the cgroup itself now (v1 memory.stat `cache`, v2 `file`)."""
    assert cg.path is not None
    key = "cache" if cg.version == 1 else "file"
    for line in (cg.path / "memory.stat").read_text().splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    raise AssertionError(f"no {key} in memory.stat")


_READ_BY_MMAP = ("import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
                 "print(sum(m[i] for i in range(0, len(m), mmap.PAGESIZE)))")


def test_page_cache_is_charged_to_the_tools_cgroup(tmp_path: Path) -> None:
    """The premise of `compare --ram` and scripts/bench_tiers.py: a model a tool reads through mmap counts against
    the tool's cgroup, because run_tool drops the model from the page cache first. Without the drop, pages cached
    before (here by writing the file) stay charged where they were and the tool's cgroup sees almost none: the
    limit would not hold the tool to what it reads."""
    size = 48 * MiB
    model = _written(tmp_path / "model.bin", size)
    with _real(256 * MiB) as cg:
        out = run_tool(Path(sys.executable), ["-c", _READ_BY_MMAP, str(model)], cgroup=cg, uncached=model,
                       sample_gpu=False)
        assert _cache_bytes(cg) >= size - 4 * MiB, _cache_bytes(cg)  # the file's pages, charged here
        assert out.peak_ram_bytes is not None and out.peak_ram_bytes >= size
    _written(model, size)  # cached again, charged to this process's cgroup
    with _real(256 * MiB) as cg:
        run_tool(Path(sys.executable), ["-c", _READ_BY_MMAP, str(model)], cgroup=cg, uncached=None, sample_gpu=False)
        assert _cache_bytes(cg) < 8 * MiB, _cache_bytes(cg)  # not dropped first: not charged to the tool
