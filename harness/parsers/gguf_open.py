"""Opening a GGUF file, once for every parser that reads one (the model's facts, its vocabulary): a missing or
special file, a file that is not GGUF, an I/O error and a damaged file are each one line of HarnessError, never a
traceback from the `gguf` package."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.core.files import require_regular_file


@contextmanager
def gguf_damage(p: Path) -> Iterator[None]:
    """Around reads of a GGUF reader: an I/O error (EIO) named as such, anything else the reader raises on damage
    (ValueError, IndexError, struct errors...) as a damaged or truncated file."""
    try:
        yield
    except HarnessError:
        raise
    except OSError as e:
        raise HarnessError(f"cannot read the model {p}: {e.strerror or e}") from None
    except Exception as e:
        raise HarnessError(f"{p}: damaged or truncated GGUF file ({type(e).__name__}: {e})") from None


def open_gguf(path: str | Path) -> Any:
    """A gguf.GGUFReader of the model at `path`, after checking that it is a regular file that starts as GGUF."""
    p = Path(path)
    require_regular_file(p, "the model")
    try:
        with p.open("rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise HarnessError(f"cannot read the model {p}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise HarnessError(f"{p}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    with gguf_damage(p):
        import gguf

        return gguf.GGUFReader(str(p))
