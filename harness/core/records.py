"""Results as JSON Lines: one record per finished run, append-only, with provenance and raw samples.

A record is a JSON object with at least `schema_version`, `key` (what run it is: the resume key),
`kind`, `finished` (UTC ISO time) and `provenance`. Records are appended and flushed one at a time, so a
run interrupted with Ctrl-C keeps every record that finished; a torn last line (killed mid-write) is
skipped on reading with a warning, and the run it belonged to is redone; a run that resumes the file drops
that line first (ResultsFile.drop_torn_tail). A line that is not UTF-8 (a flipped bit, a foreign file) is a damaged
record like a torn one; a file that cannot be read (EIO) is one line of HarnessError.
"""

from __future__ import annotations

import json
import os
import platform
import sys
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
    return out


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
