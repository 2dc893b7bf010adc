"""The parse error and the tail helper shared by all parsers."""

from __future__ import annotations

from harness.core.errors import HarnessError

TAIL_LINES = 15


def tail(text: str, n: int = TAIL_LINES) -> str:
    """The last `n` non-empty lines of `text`, each indented, for error messages."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "    (no output)"
    return "\n".join("    " + ln for ln in lines[-n:])


class ParseError(HarnessError):
    """A tool printed something the parser does not recognise. The message ends with the output's tail."""

    exit_code = 3

    def __init__(self, what: str, text: str, *, source: str = "") -> None:
        self.what = what
        self.text = text
        where = f" in the output of {source}" if source else ""
        super().__init__(f"{what}{where}; last lines:\n{tail(text)}")
