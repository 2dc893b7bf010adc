"""The disk's bandwidth in the engine's own read pattern: `O_DIRECT` reads of given (offset, length) spans (one
expert's slice of one expert tensor, 4 KiB-aligned: harness.domain.tiers.expert_read_spans) by `readers` threads
at once, as the engine's reader threads read a step's misses (src/llama/llama-expert-io, `readers=`, default 4).
Where the file system refuses O_DIRECT, buffered reads with the pages dropped after each (the engine's own
fallback), and the sample says so.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.core.errors import HarnessError


@dataclass(frozen=True)
class DiskSample:
    bytes_read: int
    seconds: float
    reads: int
    readers: int
    direct: bool

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"bytes": self.bytes_read, "seconds": self.seconds, "reads": self.reads, "readers": self.readers,
                "direct": self.direct, "MBps": self.bytes_per_s / 1e6}


def _open(path: Path) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT")
    except OSError:
        return os.open(path, os.O_RDONLY), False


def read_bandwidth(path: Path, spans: Sequence[tuple[int, int]], readers: int) -> DiskSample:
    """Read every span once, `readers` threads taking the next span from a shared list; the wall time of all."""
    if readers < 1 or not spans:
        raise HarnessError("the disk probe needs readers >= 1 and at least one read")
    fd, direct = _open(path)
    try:
        largest = max(n for _, n in spans)
        try:  # one O_DIRECT read decides (EINVAL: the file system refuses it), as the engine's direct=auto does
            os.preadv(fd, [mmap.mmap(-1, largest)], spans[0][0])
        except OSError:
            if not direct:
                raise
            os.close(fd)
            fd, direct = os.open(path, os.O_RDONLY), False
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        lock = threading.Lock()
        todo = list(reversed(spans))
        done = [0]
        errors: list[str] = []

        def reader() -> None:
            buf = mmap.mmap(-1, largest)  # page-aligned, as O_DIRECT needs
            while True:
                with lock:
                    if not todo:
                        return
                    off, n = todo.pop()
                try:
                    got = os.preadv(fd, [memoryview(buf)[:n]], off)
                    if not direct:
                        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
                except OSError as e:
                    errors.append(f"{e.strerror} at offset {off}")
                    return
                with lock:
                    done[0] += got

        threads = [threading.Thread(target=reader) for _ in range(readers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise HarnessError(f"the disk probe could not read {path}: {errors[0]}")
    finally:
        os.close(fd)
    return DiskSample(done[0], seconds, len(spans), readers, direct)
