"""Paths checked before anything opens them: a FIFO, a device, a socket or a folder where the harness or a tool
expects a regular file is refused in one line, up front, because opening a FIFO blocks until someone opens its
other end (a `harness compare` that hangs forever, or a tool that does) and a device reads or swallows endlessly.

`special_kind(path)` names what a path is when it is not a regular file; `require_regular_file` is for inputs that
must exist (the model, the text, a trace); `refuse_special` for paths that may not exist yet (an output such as the
cache's `stats=`). `CACHE_PATH_KEYS` are the cache spec's keys that take a file path (src/llama/
llama-expert-policy.cpp parses the same four, and refuses the same files: src/llama/llama-expert-paths.h);
`check_cache_paths` checks them in a spec's items, a standard stream (/dev/stdout, ...) allowed as the engine allows
it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from harness.core.errors import HarnessError

CACHE_PATH_KEYS = ("stats", "trace", "profile", "profile_out")
# keys that take a file path or one of some words (pack=auto|off|PATH: the expert pack, docs/expert-cache-engine.md)
CACHE_PATH_OR_WORD_KEYS = {"pack": ("auto", "off")}
# a process's own standard streams: open already, so opening them again never blocks (the engine allows them too,
# src/llama/llama-expert-paths.h)
# with /dev/null and /dev/full: devices that never block (the engine allows the same, llama-expert-paths.h)
STANDARD_STREAMS = ("/dev/stdout", "/dev/stderr", "/dev/stdin", "/dev/fd/", "/proc/self/fd/", "/dev/null", "/dev/full")

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What `path` is when it exists and is not a regular file ("a FIFO (named pipe)", "a folder", ...); None for a
    regular file (symbolic links followed) and for a path that does not exist. Never opens the path."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def refuse_special(path: str | os.PathLike[str], what: str) -> None:
    """A HarnessError (one line) when `path` exists and is not a regular file; a missing path passes. `what` names
    the path for the user ("the model", "--trace"); "key=" (ending in '=') is written next to the path."""
    kind = special_kind(path)
    if kind is None:
        return
    label = f"{what}{path}" if what.endswith("=") else f"{what} {path}"
    if kind == "a folder":
        raise HarnessError(f"{label} is a folder, not a file")
    raise HarnessError(f"{label} is {kind}, not a regular file: pass a file (opening it would block, or read and "
                       "write without end)")


def require_regular_file(path: str | os.PathLike[str], what: str) -> None:
    """A HarnessError (one line) unless `path` is an existing regular file."""
    refuse_special(path, what)
    if not Path(path).is_file():
        raise HarnessError(f"{what} {path}: no such file")


def check_cache_paths(items: Iterable[tuple[str, str]]) -> None:
    """Refuse a special file given to one of CACHE_PATH_KEYS, or as the path of CACHE_PATH_OR_WORD_KEYS (the tool
    would block opening it)."""
    for key, value in items:
        if key in CACHE_PATH_KEYS and not value.startswith(STANDARD_STREAMS):
            refuse_special(value, f"{key}=")
        elif key in CACHE_PATH_OR_WORD_KEYS and value not in CACHE_PATH_OR_WORD_KEYS[key]:
            refuse_special(value, f"{key}=")


def read_file_bytes(path: str | os.PathLike[str], what: str) -> bytes:
    """The bytes of a regular file, or one line of HarnessError: a special file (refuse_special), a missing or
    unreadable one (an I/O error such as EIO is named, never a traceback)."""
    refuse_special(path, what)
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise HarnessError(f"cannot read {what} {path}: {e.strerror or e}") from None


def require_utf8_text(path: str | os.PathLike[str], what: str = "the text", *, block: int = 1 << 20) -> None:
    """One line of HarnessError when the file is not UTF-8: llama.cpp's tokenizer aborts on an invalid sequence
    ("terminate called after throwing an instance of 'std::invalid_argument' ... invalid codepoint"), stock too,
    so the harness says it before a tool starts. Read in blocks: a text may be large."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read before this block
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(block)
                pending = len(dec.getstate()[0])  # a sequence the previous block ended inside
                try:
                    dec.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    at = offset - pending + e.start
                    raise HarnessError(
                        f"{what} {path} is not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {at:,}): llama.cpp's "
                        "tokenizer aborts on it; convert it first, e.g. `iconv -f LATIN1 -t UTF-8`") from None
                if not chunk:
                    return
                offset += len(chunk)
    except OSError as e:
        raise HarnessError(f"cannot read {what} {path}: {e.strerror or e}") from None
