"""A memory limit for the tools a command runs: a memory cgroup of our own, inside this process's own memory cgroup
(v1 or v2), whose limit counts the page cache, so that a model read through mmap is limited like anonymous memory.

`MemoryCgroup(limit)` makes it (one line of HarnessError when it cannot: no writable memory cgroup), `run()` or
`preexec` put a child process into it, `measure()` gives the peak of one run (v2 memory.peak, v1
memory.max_usage_in_bytes), `close()` removes it (also on Ctrl-C: `with MemoryCgroup(...)`). `drop_page_cache()`
drops a file's clean pages from the page cache (posix_fadvise DONTNEED, no root needed), so that no run inherits
another's cache; `check_ram_limit()` refuses a limit above MemAvailable less a margin (never starve the machine).
Used by `harness compare --ram` and scripts/bench_tiers.py.

A harness killed by SIGKILL cannot remove its cgroup, and the tool running in it (llama-bench) keeps running. So
making a cgroup first removes the stale ones beside it (`remove_stale_cgroups`): only ours, by name
(`moe-subst[-word...]-<pid>`), and only those whose owner pid is dead (or now another process, started after the
cgroup was made); their processes, the dead harness's tools, are killed first. `MemoryCgroup.cleaned` says what was
removed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from harness.core.errors import HarnessError
from harness.core.sizes import format_bytes

RAM_MARGIN = 2 << 30  # MemAvailable less this is the largest limit allowed
CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupError(HarnessError):
    exit_code = 2


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise HarnessError(f"{meminfo} has no MemAvailable line")


def check_ram_limit(limit: int, available: int, margin: int = RAM_MARGIN, what: str = "--ram") -> None:
    """Refuse a limit above MemAvailable less `margin` (one line naming both figures)."""
    if limit > available - margin:
        raise HarnessError(f"{what} {format_bytes(limit)} is more than MemAvailable ({format_bytes(available)}) less "
                           f"a {format_bytes(margin)} margin ({format_bytes(max(0, available - margin))}): give a "
                           "smaller limit, or free memory")


def drop_page_cache(path: Path) -> None:
    """Drop `path`'s clean pages from the page cache (pages mapped by a running process stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


STALE_NAME = re.compile(r"^moe-subst(?:-[a-z]+)*-(\d+)$")  # the names MemoryCgroup gives: prefix-<owner pid>


def _pid_start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, from /proc), None when it does not exist. A zombie
    counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                     if ln.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime field 22
    if fields[0] in ("Z", "X"):
        return None
    return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


StartTime = Callable[[int], float | None]  # a pid's start (seconds since the epoch), None: no such process


def stale_cgroups(parent: Path, *, start_time: StartTime = _pid_start_time) -> list[tuple[Path, int]]:
    """The cgroups below `parent` named as ours (STALE_NAME) whose owner is gone: no process of that pid, or one
    that started after the cgroup was made (the pid reused). This process's own are never stale."""
    out: list[tuple[Path, int]] = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return out
    for d in entries:
        m = STALE_NAME.match(d.name)
        if m is None or not d.is_dir():
            continue
        owner = int(m.group(1))
        if owner == os.getpid():
            continue
        started = start_time(owner)
        try:
            made = d.stat().st_ctime
        except OSError:
            continue
        if started is None or started > made + 1.0:
            out.append((d, owner))
    return out


def remove_stale_cgroups(parent: Path) -> list[str]:
    """Remove the stale cgroups below `parent` (stale_cgroups), killing the processes left in each (the dead
    harness's tools) first. One line per cgroup for the user: what was removed, or why it could not be."""
    lines: list[str] = []
    for path, owner in stale_cgroups(parent):
        killed: dict[int, str] = {}  # pid -> its command name
        for _ in range(50):
            pids = _cgroup_pids(path)
            if not pids:
                break
            for pid in pids:
                killed.setdefault(pid, _comm(pid))
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.1)
        try:
            _rmdir_retrying(path)
        except OSError as e:
            lines.append(f"could not remove the stale memory cgroup {path} of a killed harness (pid {owner}): "
                         f"{e.strerror}; rmdir it by hand")
            continue
        ended = ", ".join(f"{name} (pid {pid})" for pid, name in killed.items())
        what = f", and ended what still ran in it: {ended}" if ended else ""
        lines.append(f"removed the stale memory cgroup {path.name} of a harness that was killed (pid {owner}){what}")
    return lines


def _cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "a process"
    except OSError:
        return "a process"


def _rmdir_retrying(path: Path, tries: int = 50) -> None:
    """rmdir a cgroup, retrying for tries/10 s while the kernel finishes its last exits."""
    for i in range(tries):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if i == tries - 1:
                raise
            time.sleep(0.1)


def _own_cgroup_dir(root: Path, proc_cgroup: str) -> tuple[Path, int]:
    """The folder of this process's memory cgroup and the hierarchy's version (2 where the unified hierarchy has
    the memory controller, else 1)."""
    lines = proc_cgroup.splitlines()
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        rel = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), "/")
        return root / rel.lstrip("/"), 2
    found = [ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":")[1].split(",")]
    if not found or not (root / "memory").is_dir():
        raise CgroupError("no memory cgroup on this machine (neither cgroup v2 with the memory controller nor a v1 "
                          "memory hierarchy under /sys/fs/cgroup): run without --ram, or on a machine with one")
    return root / "memory" / found[0].lstrip("/"), 1


@dataclass
class PeakMeter:
    """The peak memory of one measured run (bytes), and where it was read."""

    peak: int | None = None
    source: str = ""


class MemoryCgroup:
    """A memory cgroup with a limit, below this process's memory cgroup; removed by close(). Making it removes the
    stale cgroups of killed harness runs beside it first (`cleaned`: one line for each)."""

    cleaned: tuple[str, ...] = ()

    def __init__(self, limit: int, prefix: str = "moe-subst", *, root: Path = CGROUP_ROOT,
                 proc_cgroup: str | None = None) -> None:
        self.limit = limit
        own, self.version = _own_cgroup_dir(root, proc_cgroup if proc_cgroup is not None
                                            else Path("/proc/self/cgroup").read_text())
        self.cleaned = tuple(remove_stale_cgroups(own))
        self.path: Path | None = own / f"{prefix}-{os.getpid()}"
        self.limit_file = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        self.peak_file = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            self.path.mkdir()
        except FileExistsError:
            pass
        except OSError as e:
            self.path = None
            raise CgroupError(f"cannot make a memory cgroup in {own} (cgroup v{self.version}): {e.strerror}; "
                              "a writable memory cgroup is needed (run as a user that may create cgroups there, "
                              "or under systemd-run --user --scope -p Delegate=yes), or run without --ram") from None
        if self.version == 2 and not (self.path / self.limit_file).exists():
            try:  # the memory controller for our cgroup's children
                (own / "cgroup.subtree_control").write_text("+memory")
            except OSError as e:
                self.close()
                raise CgroupError(f"cannot enable the memory controller below {own} (cgroup v2): {e.strerror}; "
                                  "run under a delegated scope (systemd-run --user --scope -p Delegate=yes), or "
                                  "without --ram") from None
        try:
            (self.path / self.limit_file).write_text(str(limit))
            got = int((self.path / self.limit_file).read_text().strip())
        except (OSError, ValueError) as e:
            self.close()
            raise CgroupError(f"cannot set the memory limit of the cgroup {own}/…: {e}; run without --ram") from None
        if got > limit:  # v1 rounds down to whole pages; more than asked is no limit
            self.close()
            raise CgroupError(f"the memory cgroup took a limit of {got} bytes for {limit}: it cannot enforce --ram")

    @property
    def peak_source(self) -> str:
        return f"cgroup v{self.version} {self.peak_file}"

    def _file(self, name: str) -> Path:
        if self.path is None:
            raise HarnessError("the memory cgroup was removed")
        return self.path / name

    def preexec(self) -> None:
        """For subprocess.Popen(preexec_fn=...): move the child into the cgroup before it execs."""
        with open(self._file("cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def usage(self) -> int:
        return int(self._file("memory.current" if self.version == 2 else "memory.usage_in_bytes").read_text())

    def oom_kills(self) -> int | None:
        """How many processes the cgroup's OOM killer has killed (None where the kernel does not say)."""
        try:
            if self.version == 2:
                text = self._file("memory.events").read_text()
                key = "oom_kill"
            else:
                text = self._file("memory.oom_control").read_text()
                key = "oom_kill"
        except OSError:
            return None
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
        return None

    @contextmanager
    def measure(self) -> Iterator[PeakMeter]:
        """The peak of what runs inside the block. v1: memory.max_usage_in_bytes is reset before (writing 0).
        v2: memory.peak is reset through its file descriptor (Linux 6.12+); on older kernels it is the peak since
        the cgroup was made, which says so in the meter's source."""
        meter = PeakMeter(source=self.peak_source)
        fd: int | None = None
        if self.version == 1:
            self._file(self.peak_file).write_text("0")
        else:
            try:
                fd = os.open(self._file(self.peak_file), os.O_RDWR)
                os.write(fd, b"reset\n")
            except OSError:
                if fd is not None:
                    os.close(fd)
                fd = None
                meter.source += " (since the cgroup was made: this kernel cannot reset it)"
        try:
            yield meter
        finally:
            try:
                if fd is not None:
                    meter.peak = int(os.pread(fd, 64, 0).decode().strip())
                else:
                    meter.peak = int(self._file(self.peak_file).read_text().strip())
            except (OSError, ValueError):
                meter.peak = None
            if fd is not None:
                os.close(fd)

    def run(self, args: Sequence[str], env: Mapping[str, str], timeout: float) -> tuple[int, str, str]:
        """Run args inside the cgroup: (returncode, stdout, stderr); killed after `timeout` seconds."""
        p = subprocess.Popen(list(args), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=self.preexec)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += f"\nkilled after {timeout:.0f} s"
        return p.returncode, out, err

    def close(self) -> None:
        """Remove the cgroup (its processes must have exited; a v1 cgroup's remaining page cache goes to the
        parent). Retries for 5 s while the kernel finishes the last exit."""
        path, self.path = self.path, None
        if path is None or not path.exists():
            return
        try:
            _rmdir_retrying(path)
        except OSError:
            raise HarnessError(f"could not remove the memory cgroup {path} (a process still in it?): rmdir it by "
                               "hand") from None

    def __enter__(self) -> MemoryCgroup:
        """Inside `with`, SIGTERM raises KeyboardInterrupt (like Ctrl-C), so that the cgroup is removed."""
        self._old_term: object = None
        try:
            self._old_term = signal.signal(signal.SIGTERM, _term_as_interrupt)
        except ValueError:  # not the main thread
            self._old_term = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)  # type: ignore[arg-type]
        self.close()


def _term_as_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
