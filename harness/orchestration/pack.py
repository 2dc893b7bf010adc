"""`harness pack`: write a model's expert pack (harness.domain.pack's layout) next to it, or verify one.

The writer streams: for each MoE layer and expert it reads that expert's slices from the GGUF (one `pread` per
tensor) and writes the record, so it holds one record in memory, never the model. It writes a temporary file in
the pack's folder (preallocated, so that a full disk fails at once) and renames it over the pack at the end, after
an fsync: an interrupt (Ctrl-C, SIGTERM) or an error removes the temporary file, and no pack is left half-written.
The checksum is the CRC-32 (zlib, streamed) of each expert tensor's bytes, computed as they are read: the cost is one
read of the experts and one write of them (a 45 GB model: about 2 x 45 GB of disk traffic; CRC-32 runs at several
GB/s, so the disk bounds it). `verify_pack` reads the model's experts and the pack's records again and compares both
with the header's CRCs.
"""

from __future__ import annotations

import errno
import os
import signal
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from harness.core.errors import HarnessError
from harness.core.files import require_regular_file
from harness.domain.pack import PackLayout, decode_header, default_pack_path, encode_header, plan_pack, with_crcs
from harness.parsers.gguf_model import read_model_info

ProgressFn = Callable[[int, int, str], None]  # (bytes done, bytes total, label)


@dataclass(frozen=True)
class PackResult:
    path: Path
    layout: PackLayout
    seconds: float


@dataclass(frozen=True)
class VerifyResult:
    path: Path
    layout: PackLayout
    seconds: float


def _os_error(what: str, path: Path, e: OSError, need: int = 0) -> HarnessError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return HarnessError(f"cannot write the expert pack {path}: no space left on its file system (the pack "
                            f"takes {need / 2**30:.2f} GiB)")
    return HarnessError(f"cannot {what} {path}: {e.strerror or e}")


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while the pack is written (so that the temporary file is removed)."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt
    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _pread_exact(fd: int, n: int, off: int, where: Path) -> bytes:
    b = os.pread(fd, n, off)
    if len(b) != n:
        raise HarnessError(f"{where}: truncated (a read of {n} bytes at offset {off} returned {len(b)})")
    return b


def write_pack(model: Path, out: Path | None = None, progress: ProgressFn | None = None) -> PackResult:
    """Write MODEL's expert pack to `out` (default: MODEL + .moe-pack) through a temporary file and a rename."""
    t0 = time.monotonic()
    info = read_model_info(model)  # one line for a non-MoE model or a damaged GGUF
    st = os.stat(model)
    layout = plan_pack(info, st.st_size, st.st_mtime_ns)
    dest = out if out is not None else default_pack_path(model)
    if dest.exists() and not dest.is_file():
        raise HarnessError(f"{dest}: exists and is not a regular file; give another --out")
    if not dest.parent.is_dir():
        raise HarnessError(f"cannot write the expert pack {dest}: no folder {dest.parent}")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    total = sum(la.data_bytes * layout.n_expert for la in layout.layers)
    try:
        mfd = os.open(model, os.O_RDONLY)
    except OSError as e:
        raise _os_error("read the model", model, e) from None
    try:
        with _sigterm_interrupts():
            try:
                ofd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as e:
                raise _os_error("create", tmp, e) from None
            try:
                crcs = _write_records(mfd, ofd, model, tmp, layout, total, progress)
                layout = with_crcs(layout, crcs)
                os.pwrite(ofd, encode_header(layout), 0)
                os.fsync(ofd)
            except OSError as e:
                raise _os_error("write the expert pack", dest, e, layout.pack_size) from None
            finally:
                os.close(ofd)
            st2 = os.stat(model)
            if (st2.st_size, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                raise HarnessError(f"{model} changed while its expert pack was written; nothing was written")
            os.replace(tmp, dest)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    finally:
        os.close(mfd)
    try:
        dfd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # the rename is done; a folder that cannot be synced is no error here
    return PackResult(dest, layout, time.monotonic() - t0)


def _write_records(mfd: int, ofd: int, model: Path, tmp: Path, layout: PackLayout, total: int,
                   progress: ProgressFn | None) -> list[int]:
    try:
        os.posix_fallocate(ofd, 0, layout.pack_size)  # a full disk fails here, before any work
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(ofd, layout.pack_size)
    crcs: list[int] = []
    done = 0
    last = 0.0
    for li, la in enumerate(layout.layers):
        crc = [0] * len(la.tensors)
        for ex in range(layout.n_expert):
            rec = bytearray(la.record_bytes)
            for ti, t in enumerate(la.tensors):
                b = _pread_exact(mfd, t.expert_bytes, t.gguf_offset + ex * t.expert_bytes, model)
                crc[ti] = zlib.crc32(b, crc[ti])
                rec[t.rec_offset:t.rec_offset + t.expert_bytes] = b
            off = la.first_record + ex * la.record_bytes
            view = memoryview(rec)
            while view:
                n = os.pwrite(ofd, view, off)
                view, off = view[n:], off + n
            done += la.data_bytes
            now = time.monotonic()
            if progress is not None and (now - last > 0.5 or ex == layout.n_expert - 1):
                progress(done, total, f"pack layer {la.il} ({li + 1}/{len(layout.layers)})")
                last = now
        # the layer's pages: written out, and dropped from the page cache (the model's too), so that packing a model
        # bigger than RAM does not fill it with what will not be read again soon
        os.fdatasync(ofd)
        os.posix_fadvise(ofd, la.first_record, la.record_bytes * layout.n_expert, os.POSIX_FADV_DONTNEED)
        for t in la.tensors:
            os.posix_fadvise(mfd, t.gguf_offset, t.expert_bytes * layout.n_expert, os.POSIX_FADV_DONTNEED)
        crcs.extend(crc)
    return crcs


def read_pack_header(path: Path) -> PackLayout:
    require_regular_file(path, "the expert pack")
    try:
        with path.open("rb") as fh:
            head = fh.read(64)
            hb = int.from_bytes(head[12:16], "little") if len(head) >= 16 else 0
            data = head + fh.read(max(0, min(hb, 64 << 20) - len(head)))
    except OSError as e:
        raise HarnessError(f"cannot read the expert pack {path}: {e.strerror or e}") from None
    layout = decode_header(data, str(path))
    size = path.stat().st_size
    if size != layout.pack_size:
        what = "truncated expert pack" if size < layout.pack_size else "expert pack longer than written"
        raise HarnessError(f"{path}: {what} ({size} bytes, its header says {layout.pack_size})")
    return layout


def verify_pack(model: Path, pack: Path | None = None, progress: ProgressFn | None = None) -> VerifyResult:
    """Check a pack against its model in full: the header's facts (size, modification time, tensor table) and every
    byte (the CRC-32 of each expert tensor in the model and of its slices in the pack, against the header's).
    HarnessError (one line naming the pack and what differs) on any mismatch."""
    t0 = time.monotonic()
    dest = pack if pack is not None else default_pack_path(model)
    if not dest.exists():
        raise HarnessError(f"no expert pack at {dest}: write one with harness pack {model}")
    have = read_pack_header(dest)
    info = read_model_info(model)
    st = os.stat(model)
    want = plan_pack(info, st.st_size, st.st_mtime_ns)
    if have.gguf_size != want.gguf_size:
        raise HarnessError(f"{dest}: written for a model file of {have.gguf_size} bytes; {model} is {want.gguf_size} "
                           "bytes (a pack of another model, or the model changed): write it again with harness pack")
    strip = [(t.name, t.ggml_type, t.shape, t.expert_bytes, t.rec_offset, t.gguf_offset) for t in have.tensors]
    if strip != [(t.name, t.ggml_type, t.shape, t.expert_bytes, t.rec_offset, t.gguf_offset) for t in want.tensors] \
            or [(la.il, la.first_record, la.record_bytes) for la in have.layers] != \
            [(la.il, la.first_record, la.record_bytes) for la in want.layers]:
        raise HarnessError(f"{dest}: its tensor table differs from {model}'s expert tensors (a pack of another "
                           "model): write it again with harness pack")
    total = 2 * sum(la.data_bytes * have.n_expert for la in have.layers)
    done = 0
    with model.open("rb") as mf, dest.open("rb") as pf:
        mfd, pfd = mf.fileno(), pf.fileno()
        for la in have.layers:
            for t in la.tensors:
                crc_model = crc_pack = 0
                for e in range(have.n_expert):
                    crc_model = zlib.crc32(_pread_exact(mfd, t.expert_bytes, t.gguf_offset + e * t.expert_bytes,
                                                        model), crc_model)
                    crc_pack = zlib.crc32(_pread_exact(pfd, t.expert_bytes, la.first_record + e * la.record_bytes
                                                       + t.rec_offset, dest), crc_pack)
                done += 2 * t.expert_bytes * have.n_expert
                if progress is not None:
                    progress(done, total, f"verify {t.name}")
                if crc_model != t.crc32:
                    raise HarnessError(f"{dest}: the model's {t.name} has CRC-32 {crc_model:08x}, the pack was written "
                                       f"from {t.crc32:08x} (the model's experts changed): write it again with "
                                       "harness pack")
                if crc_pack != t.crc32:
                    raise HarnessError(f"{dest}: the pack's slices of {t.name} have CRC-32 {crc_pack:08x}, not "
                                       f"{t.crc32:08x} (the pack is damaged): write it again with harness pack")
    if have.gguf_mtime_ns != want.gguf_mtime_ns:
        raise HarnessError(f"{dest}: its bytes match {model}, but the model's modification time changed since it was "
                           f"written ({have.gguf_mtime_ns} -> {want.gguf_mtime_ns} ns), so the engine will not use "
                           "it (its check at load is size and modification time): write it again with harness pack")
    return VerifyResult(dest, have, time.monotonic() - t0)
