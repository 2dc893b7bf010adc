"""The block device's readahead (`/sys/block/<dev>/queue/read_ahead_kb`) of the device holding a file: found from
the file's st_dev (`/sys/dev/block/MAJ:MIN`, a partition's parent disk), read, set for a run and always restored.

Stock llama.cpp pages experts in through mmap faults, and how much each fault reads around itself is this setting
(llama.cpp's POSIX_FADV_SEQUENTIAL doubles it for its file): a stock baseline must say which readahead it ran at
(issue 23). `ReadAhead.for_file(path)` finds the file (or says in one line why there is none: no block device, a
file system on several devices); `with ra.set_for_run(128):` sets it and restores the value it found on leaving the
block, by an exception or Ctrl-C too; SIGTERM and SIGHUP inside the block raise KeyboardInterrupt, so that a killed
benchmark restores it as well (SIGKILL cannot be caught: the value to restore is in the benchmark's records).
`sysfs` is a parameter so that tests run on a fake tree.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from harness.core.errors import HarnessError

SYSFS = Path("/sys")


def read_ahead_file(path: Path, sysfs: Path = SYSFS) -> Path:
    """The read_ahead_kb file of the block device holding `path`; HarnessError (one line) when there is none."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        raise HarnessError(f"{path} is on a file system without a block device (device {major}:{minor}: tmpfs, "
                           "overlay, a network file system): no readahead to set")
    dev = sysfs / "dev" / "block" / f"{major}:{minor}"
    if not dev.exists():
        raise HarnessError(f"{path}: no {dev} for its device {major}:{minor}")
    d = dev.resolve()
    if (d / "partition").exists():  # a partition: the queue is its disk's
        d = d.parent
    f = d / "queue" / "read_ahead_kb"
    if not f.is_file():
        raise HarnessError(f"{path}: its device {d.name} has no {f.relative_to(d)} (a device-mapper or md device "
                           "stacks others; set theirs by hand)")
    return f


def _term_as_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class ReadAhead:
    """The readahead of one block device: `value()` now, `original` as found, `set_for_run(kb)` to change it for
    a block and restore it after."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.original = self.value()

    @classmethod
    def for_file(cls, path: Path, sysfs: Path = SYSFS) -> ReadAhead:
        return cls(read_ahead_file(path, sysfs))

    @property
    def device(self) -> str:
        return self.file.parent.parent.name

    def value(self) -> int:
        try:
            return int(self.file.read_text().strip())
        except (OSError, ValueError) as e:
            raise HarnessError(f"cannot read {self.file}: {e}") from None

    def writable(self) -> bool:
        return os.access(self.file, os.W_OK)

    def _write(self, kb: int) -> None:
        try:
            self.file.write_text(f"{kb}\n")
        except OSError as e:
            raise HarnessError(f"cannot set {self.file} to {kb}: {e.strerror} (root is needed)") from None

    @contextmanager
    def set_for_run(self, kb: int) -> Iterator[None]:
        """read_ahead_kb = kb inside the block; the original value back on leaving it, whatever the way out."""
        old: dict[signal.Signals, object] = {}
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                old[sig] = signal.signal(sig, _term_as_interrupt)
            except ValueError:  # not the main thread
                pass
        try:
            self._write(kb)
            yield
        finally:
            self.restore()
            for sig, h in old.items():
                signal.signal(sig, h)  # type: ignore[arg-type]

    def restore(self) -> None:
        """Put the value found at construction back (if it changed)."""
        if self.value() != self.original:
            self._write(self.original)
