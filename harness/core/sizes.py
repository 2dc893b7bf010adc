"""Sizes as users type them: 24G, 24GiB, 24GB, 512M, 1.5T, 123456 (bytes), 25%.

Binary units throughout for K/M/G/T and KiB/MiB/GiB/TiB (a "24G" card has 24 GiB); the decimal
forms KB/MB/GB/TB mean powers of 1000. A percentage is returned as a fraction, for the caller to apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.core.errors import HarnessError

_BINARY = {"": 1, "B": 1, "K": 2**10, "KIB": 2**10, "M": 2**20, "MIB": 2**20, "G": 2**30, "GIB": 2**30,
           "T": 2**40, "TIB": 2**40}
_DECIMAL = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_PCT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class Size:
    """Either an absolute number of bytes or a fraction (from a percentage) of something else."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, whole: int) -> int:
        """Bytes, taking a fraction of `whole` where the size was a percentage."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(whole * self.fraction)

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        assert self.bytes is not None
        return format_bytes(self.bytes)


def parse_size(text: str, *, allow_percent: bool = True) -> Size:
    """Parse '24G', '24GiB', '512M', '1.5GB', '4096' or '25%'. Raises HarnessError on anything else."""
    m = _PCT_RE.match(text)
    if m:
        if not allow_percent:
            raise HarnessError(f"a size here must be absolute (like 24G or 512M), not {text!r}")
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise HarnessError(f"a percentage must be in (0, 100], got {text!r}")
        return Size(fraction=pct / 100)
    m = _SIZE_RE.match(text)
    if not m:
        raise HarnessError(f"not a size: {text!r} (examples: 24G, 24GiB, 512M, 1.5GB, 25%)")
    unit = m.group(2).upper()
    mult = _DECIMAL.get(unit) or _BINARY.get(unit)
    if mult is None:
        raise HarnessError(f"unknown size unit {m.group(2)!r} in {text!r} (use K, M, G, T, KiB..TiB or KB..TB)")
    value = float(m.group(1)) * mult
    if value <= 0:
        raise HarnessError(f"a size must be positive, got {text!r}")
    return Size(bytes=int(value))


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; binary units, three significant figures."""
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= mult:
            return f"{n / mult:.3g} {unit}" if n / mult < 100 else f"{n / mult:.0f} {unit}"
    return f"{int(n)} B"
