"""Results as JSON Lines: one record per finished run, append-only, with provenance and raw samples.

A record is a JSON object with at least `schema_version`, `key` (what run it is: the resume key),
`kind`, `finished` (UTC ISO time) and `provenance`. Records are appended and flushed one at a time, so a
run interrupted with Ctrl-C keeps every record that finished; a torn last line (killed mid-write) is
skipped on reading with a warning, and the run it belonged to is redone; a run that resumes the file drops
that line first (ResultsFile.drop_torn_tail). A line that is not UTF-8 (a flipped bit, a foreign file) is a
damaged record like a torn one; a file that cannot be read (EIO) is one line of HarnessError.

One writer per results folder: `prepare_out_dir` takes an exclusive lock (flock on DIR/.harness.lock, which names its
holder), held until the process exits, so that two runs into one --out cannot both append every record (the report
counted each run twice, its speeds measured while both competed); the second is one line naming the first. The
kernel releases the lock when its holder dies, even by SIGKILL: a lock is never stale.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError

SCHEMA_VERSION = 1


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Provenance:
    """Where a result came from: enough to tell whether two results are comparable."""

    pin: str  # llama-cpp-python-<version> (UPSTREAM)
    pin_sha256: str
    patch_series: str  # patch-series hash (harness.core.project.patch_series_hash)
    binaries: Mapping[str, str]  # "stock/llama-bench" -> sha256
    backend: str  # cpu, cuda, ...
    gpu: str  # GPU name, or "none"
    argv: tuple[str, ...]
    started: str
    host: str = field(default_factory=platform.node)
    python: str = field(default_factory=lambda: sys.version.split()[0])

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["binaries"] = dict(self.binaries)
        d["argv"] = list(self.argv)
        return d


def make_record(key: str, kind: str, provenance: Provenance, data: Mapping[str, Any], *,
                started: str | None = None) -> dict[str, Any]:
    """A record ready to append. `data` holds the configuration and raw samples (JSON-serialisable)."""
    for reserved in ("schema_version", "key", "kind", "provenance", "finished"):
        if reserved in data:
            raise ValueError(f"record data may not set {reserved!r}")
    rec: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "key": key, "kind": kind}
    if started is not None:
        rec["started"] = started
    rec["finished"] = utc_now()
    rec.update(data)
    rec["provenance"] = provenance.to_json()
    return rec


def prepare_out_dir(out: Path) -> Path:
    """The results folder `out` (--out), created if missing, checked before anything runs: a HarnessError with one
    line if it is a file, lies under a file, or cannot be created or written to."""
    if out.exists() and not out.is_dir():
        raise HarnessError(f"--out {out} is a file, not a folder: pass a folder (a new one is created)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HarnessError(f"--out {out}: cannot create the results folder: {e.strerror or e}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise HarnessError(f"--out {out}: the results folder is not writable")
    lock_out_dir(out)
    return out


LOCK_NAME = ".harness.lock"
_held: dict[tuple[str, int, int], int] = {}  # a locked folder (path, st_dev, st_ino) -> its lock file's descriptor


def lock_out_dir(out: Path) -> None:
    """Make this process the only writer of the results folder `out` until it exits (or release_out_dir): an
    exclusive flock on out/.harness.lock, which then names this process. Another process's lock is one line of
    HarnessError naming it. Taking a folder this process already holds is a no-op (check runs compare into its own
    folder). A file system without flock (some network ones) goes unlocked."""
    key = _key(out)
    if key in _held:
        return
    try:
        fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the tools (O_CLOEXEC)
    except OSError as e:
        raise HarnessError(f"--out {out}: cannot make the lock file {LOCK_NAME}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise HarnessError(f"--out {out} is in use by another harness run ({holder}): wait for it to finish, or "
                           "pass another --out folder") from None
    except OSError:  # ENOLCK, EOPNOTSUPP: no locks on this file system
        os.close(fd)
        return
    argv = " ".join(sys.argv).replace("\n", " ")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {argv} (since {utc_now()})\n".encode(), 0)
    _held[key] = fd


def release_out_dir(out: Path) -> None:
    """Give up this process's lock of `out` (a no-op when it holds none)."""
    fd = _held.pop(_key(out), None)
    if fd is not None:
        os.close(fd)


def _key(out: Path) -> tuple[str, int, int]:
    st = out.stat()
    return str(out.resolve()), st.st_dev, st.st_ino


def _lock_holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it (it writes right after taking the lock: wait a moment for it)."""
    for _ in range(20):
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        if text:
            return text.splitlines()[0]
        time.sleep(0.05)
    return "a process that has not said which yet"


class ResultsFile:
    """An append-only JSON Lines file of records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.warnings: list[str] = []

    def append(self, record: Mapping[str, Any]) -> None:
        if "key" not in record or record.get("schema_version") != SCHEMA_VERSION:
            raise ValueError("a record needs a key and the current schema_version (use make_record)")
        line = json.dumps(record, sort_keys=False, allow_nan=False)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def drop_torn_tail(self) -> bool:
        """Before appending to a resumed file: remove a torn (unparseable) last line, the trace of a write that was
        killed, by truncating the file to the end of the line before it (else the next record would be appended
        to the torn one, and both be lost). True if a line was dropped. A damaged line before the last is left
        as it is (read skips it with a warning). A complete last record without its newline gets one."""
        if not self.path.is_file():
            return False
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise HarnessError(f"cannot read the results {self.path}: {e.strerror or e}") from None
        body = data.rstrip(b"\n")
        start = body.rfind(b"\n") + 1
        last = body[start:]
        if not last.strip():
            return False
        try:
            json.loads(last)
        except ValueError:
            with self.path.open("r+b") as f:
                f.truncate(start)
                f.flush()
                os.fsync(f.fileno())
            return True
        if not data.endswith(b"\n"):
            with self.path.open("ab") as f:
                f.write(b"\n")
        return False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.read())

    def read(self) -> list[dict[str, Any]]:
        """All complete records. A damaged line is skipped with a warning in `self.warnings`; a record
        of another schema version is an error (re-run into a new --out directory)."""
        if not self.path.is_file():
            return []
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise HarnessError(f"cannot read the results {self.path}: {e.strerror or e}") from None
        out: list[dict[str, Any]] = []
        self.warnings = []
        for n, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except ValueError:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
                self.warnings.append(f"{self.path}:{n}: damaged record skipped (interrupted write?); "
                                     "its run will be redone")
                continue
            if not isinstance(rec, dict) or "key" not in rec:
                self.warnings.append(f"{self.path}:{n}: not a result record, skipped")
                continue
            if rec.get("schema_version") != SCHEMA_VERSION:
                raise HarnessError(f"{self.path}:{n}: schema_version {rec.get('schema_version')!r}, this "
                                   f"harness writes {SCHEMA_VERSION}: use a new --out directory")
            out.append(rec)
        return out

    def finished_keys(self) -> set[str]:
        return {str(r["key"]) for r in self.read() if r.get("status", "ok") == "ok"}
