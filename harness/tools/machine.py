"""Measurements of this machine for `harness tune`: the model file's disk with the engine's read pattern, a host
memory copy, and the machine's CPUs, memory and GPUs. The decode rate is measured by the command itself (llama-bench
through its runner). The results are `harness.domain.tune.MachineFacts`.

The engine's read pattern (host=file, docs/expert-cache-engine.md): a missed expert is read as its slice of each
expert tensor of its layer, `O_DIRECT` where the file system allows it (else buffered), by `readers` threads. The
measurement reads random experts of random MoE layers that way, from a dropped page cache, with as many threads:
the time per expert, over all readers, is what the cost model charges a fetch.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.core.errors import HarnessError
from harness.tools.cgroup import drop_page_cache, mem_available
from harness.tools.host import detect_gpus

_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias|scale)$")
ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers aligned to the logical block (4096 covers 512 too)
MAX_BYTES = 128 << 20  # read at most this much


@dataclass(frozen=True)
class DiskRate:
    expert_bytes: int  # one expert: its slices of every expert tensor of its layer (the largest layer's)
    expert_s: float  # the time per expert, effective over all readers: the phase's wall time / experts read
    read_bytes: int  # the engine's read: one expert's slice of one tensor (the largest)
    readers: int
    direct: bool

    @property
    def gbs(self) -> float:
        return self.expert_bytes / self.expert_s / 1e9


def expert_slices(model: Path) -> tuple[int, dict[int, list[tuple[int, int]]]]:
    """The experts per layer and, per MoE layer, each routed-expert tensor's (file offset of expert 0, bytes of one
    expert's slice)."""
    import gguf

    reader = gguf.GGUFReader(str(model))
    out: dict[int, list[tuple[int, int]]] = {}
    n_expert = 0
    for t in reader.tensors:
        m = _EXPS.match(t.name)
        if m is None:
            continue
        n_expert = int(t.shape[-1])
        out.setdefault(int(m.group(1)), []).append((int(t.data_offset), int(t.n_bytes) // n_expert))
    if not out:
        raise HarnessError(f"{model}: no routed-expert tensors to read")
    return n_expert, out


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    """The file opened with O_DIRECT where asked and allowed, else buffered."""
    flag = getattr(os, "O_DIRECT", 0)
    if direct and flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, os.O_RDONLY), False


def _read(fd: int, buf: mmap.mmap, offset: int, length: int, direct: bool) -> int:
    if direct:
        start = offset // ALIGN * ALIGN
        end = -(-(offset + length) // ALIGN) * ALIGN
        return os.preadv(fd, [memoryview(buf)[: end - start]], start)
    return os.preadv(fd, [memoryview(buf)[:length]], offset)


def _parallel(readers: int, jobs: Sequence[Sequence[tuple[int, int]]], path: Path, buf_bytes: int,
              direct: bool) -> tuple[float, bool]:
    """Each reader reads its list of (offset, length); (wall seconds, whether O_DIRECT was used)."""
    fd, direct = _open(path, direct)
    errors: list[BaseException] = []

    def work(items: Sequence[tuple[int, int]]) -> None:
        buf = mmap.mmap(-1, buf_bytes + 2 * ALIGN)
        try:
            for off, n in items:
                _read(fd, buf, off, n, direct)
        except OSError as e:
            errors.append(e)
        finally:
            buf.close()

    try:
        threads = [threading.Thread(target=work, args=(jobs[i],)) for i in range(readers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        os.close(fd)
    if errors:
        if direct and isinstance(errors[0], OSError) and errors[0].errno == errno.EINVAL:
            raise _NoDirect()
        raise HarnessError(f"reading {path} to measure the disk: {errors[0]}")
    return wall, direct


class _NoDirect(Exception):
    pass


def disk_rate(model: Path, readers: int = 4, *, seed: int = 0, max_bytes: int = MAX_BYTES) -> DiskRate:
    """The model file's read rate with the engine's pattern (module docstring), from a dropped page cache."""
    if readers < 1:
        raise HarnessError("readers must be at least 1")
    n_expert, slices = expert_slices(model)
    rng = random.Random(seed)
    layers = sorted(slices)
    per_expert = max(sum(n for _, n in s) for s in slices.values())
    biggest = max(n for s in slices.values() for _, n in s)
    n_experts = max(readers, min(64 * readers, max_bytes // max(1, per_expert)))

    def expert_reads() -> list[tuple[int, int]]:
        """One random expert of a random MoE layer: its slice of each of the layer's expert tensors."""
        s = slices[rng.choice(layers)]
        e = rng.randrange(0, n_expert)
        return [(off + e * n, n) for off, n in s]

    experts = [expert_reads() for _ in range(n_experts)]
    jobs = [[r for ex in experts[i::readers] for r in ex] for i in range(readers)]
    try:
        drop_page_cache(model)
        try:
            t_exp, direct = _parallel(readers, jobs, model, biggest, True)
        except _NoDirect:  # the file system opened O_DIRECT but refused the reads: buffered, as the engine's auto
            drop_page_cache(model)
            t_exp, direct = _parallel(readers, jobs, model, biggest, False)
    finally:
        drop_page_cache(model)
    return DiskRate(expert_bytes=per_expert, expert_s=t_exp / n_experts, read_bytes=biggest, readers=readers,
                    direct=direct)


def host_copy_gbs(block_bytes: int = 64 << 20, repeat: int = 4) -> float:
    """GB/s of a memcpy in host memory (numpy copyto of `block_bytes`), the best of `repeat`."""
    src = np.ones(block_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return block_bytes / best / 1e9


def mem_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise HarnessError(f"{meminfo} has no MemTotal line")


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_basics() -> tuple[int, int, int, tuple[str, ...]]:
    """(CPUs this process may run on, MemTotal, MemAvailable, the GPUs nvidia-smi lists)."""
    return cpus(), mem_total(), mem_available(), detect_gpus()
