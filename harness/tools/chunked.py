"""llama-perplexity as a decode benchmark of distinct sequences: each chunk is a distinct sequence of n_ctx tokens
of a real text, teacher-forced one token per ubatch (`-ub 1`: the decode path), and the moment each chunk's result
(`[i]ppl,`) arrives on its stdout is taken here, with the process's storage reads at that moment
(/proc/PID/io `read_bytes`: every byte the process and its threads had the block layer read, page faults' readahead
and O_DIRECT alike). So one process gives one t/s sample and one bytes-read figure per sequence, its model loaded
once. At exit the process is waited for without being reaped (waitid WNOWAIT), so that its final read_bytes can still
be read. llama.cpp's log worker can lose the last lines at exit (upstream issue 22142): ask for one chunk more than
is measured.
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CHUNK_RE = re.compile(r"\[(\d+)\][^,\[\s]*,")
START_MARK = "calculating perplexity over"


@dataclass(frozen=True)
class ChunkedRun:
    returncode: int
    start: float | None  # seconds after the start of the process: the chunk loop began (START_MARK on stderr)
    start_read_bytes: int | None
    chunk_end: tuple[float, ...]  # seconds after the start of the process: chunk i's result arrived
    chunk_read_bytes: tuple[int, ...]  # read_bytes at those moments
    end_read_bytes: int | None  # at exit
    stdout: str
    stderr: str

    def chunk_seconds(self) -> list[float]:
        """Each chunk's wall time (the first from the loop's start)."""
        if self.start is None:
            return []
        edges = [self.start, *self.chunk_end]
        return [b - a for a, b in zip(edges, edges[1:], strict=False)]

    def chunk_reads(self) -> list[int]:
        """Each chunk's storage reads (the first from the loop's start)."""
        if self.start_read_bytes is None:
            return []
        edges = [self.start_read_bytes, *self.chunk_read_bytes]
        return [b - a for a, b in zip(edges, edges[1:], strict=False)]


def proc_read_bytes(pid: int, proc: Path = Path("/proc")) -> int | None:
    """/proc/PID/io read_bytes (None where it cannot be read)."""
    try:
        for line in (proc / str(pid) / "io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def run_chunked_perplexity(args: Sequence[str], env: Mapping[str, str], *, timeout: float,
                           preexec: Callable[[], None] | None = None) -> ChunkedRun:
    """Run llama-perplexity (args), timing each chunk as its result arrives; killed after `timeout` seconds."""
    t0 = time.perf_counter()
    p = subprocess.Popen(list(args), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=preexec)
    assert p.stdout is not None and p.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ, "out")
    sel.register(p.stderr, selectors.EVENT_READ, "err")
    out, err = bytearray(), bytearray()
    start: float | None = None
    start_read: int | None = None
    ends: list[float] = []
    reads: list[int] = []
    deadline = t0 + timeout
    killed = False
    try:
        while sel.get_map():
            left = deadline - time.perf_counter()
            if left <= 0:
                p.kill()
                killed = True
                left = 5.0
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                now = time.perf_counter() - t0
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if key.data == "err":
                    err += chunk
                    if start is None and START_MARK.encode() in err:
                        start, start_read = now, proc_read_bytes(p.pid)
                else:
                    out += chunk
                    n = len(CHUNK_RE.findall(out.decode(errors="replace")))
                    if n > len(ends):
                        rb = proc_read_bytes(p.pid)
                        for _ in range(n - len(ends)):
                            ends.append(now)
                            reads.append(rb if rb is not None else -1)
            if killed and time.perf_counter() > deadline + 5.0:
                break
    except BaseException:  # Ctrl-C, SIGTERM as KeyboardInterrupt: the run ends with us (its cgroup must empty)
        p.kill()
        p.wait()
        raise
    sel.close()
    end_read: int | None = None
    try:
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
        end_read = proc_read_bytes(p.pid)
    except ChildProcessError:
        pass
    rc = p.wait()
    text_err = err.decode(errors="replace") + (f"\nkilled after {timeout:.0f} s" if killed else "")
    return ChunkedRun(rc, start, start_read, tuple(ends), tuple(reads), end_read, out.decode(errors="replace"),
                      text_err)
