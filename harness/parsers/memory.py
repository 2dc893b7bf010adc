"""The memory breakdown llama.cpp tools print at exit (common/fit.cpp, `common_memory_breakdown_print`).

Printed with LOG_TRC, so only at verbosity >= 4 (`-lv 4`), to stderr, as a table in MiB:
    <func>: | memory breakdown [MiB] | total   free    self   model   context   compute    unaccounted |
    <func>: |   - CUDA0 (RTX 3090)   | 24135 = 1234 + (12345 = 10000 + 2000 + 345) + 678 |
    <func>: |   - Host               |                 1234 =  1000 +  200 +   34                |
where <func> is `common_memory_breakdown_print`.
Device rows use `"%s = %s + (%s = %s + %s + %s) + %s"` (total = free + (self = model + context + compute)
+ unaccounted); host and other buffer-type rows use `"%s   %s    %s = %s + %s + %s    %s"` with empty
total, free and unaccounted. Numbers are right-aligned with spaces. `self` is what llama.cpp itself
allocated on the device: the figure we compare with a budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.parsers.base import ParseError

_FUNC = "common_memory_breakdown_print: "
_HEADER_RE = re.compile(re.escape(_FUNC) + r"\| memory breakdown \[MiB\]\s*\|")
_DEVICE_RE = re.compile(
    re.escape(_FUNC) + r"\|   - (?P<name>.+?)\s*\|\s*(?P<total>\d+) = \s*(?P<free>\d+) \+ "
    r"\(\s*(?P<self>\d+) = \s*(?P<model>\d+) \+ \s*(?P<context>\d+) \+ \s*(?P<compute>\d+)\) \+ "
    r"\s*(?P<unacc>-?\d+) \|")
_OTHER_RE = re.compile(
    re.escape(_FUNC) + r"\|   - (?P<name>.+?)\s*\|\s*(?P<self>\d+) = \s*(?P<model>\d+) \+ "
    r"\s*(?P<context>\d+) \+ \s*(?P<compute>\d+)\s*\|")


@dataclass(frozen=True)
class MemoryRow:
    name: str  # "CUDA0 (RTX 3090)", "Host", or a buffer type name such as "CPU_REPACK"
    is_device: bool
    self_mib: int
    model_mib: int
    context_mib: int
    compute_mib: int
    total_mib: int | None = None
    free_mib: int | None = None
    unaccounted_mib: int | None = None


@dataclass(frozen=True)
class MemoryBreakdown:
    rows: tuple[MemoryRow, ...]

    @property
    def devices(self) -> tuple[MemoryRow, ...]:
        return tuple(r for r in self.rows if r.is_device)

    @property
    def host(self) -> MemoryRow | None:
        return next((r for r in self.rows if r.name == "Host"), None)

    @property
    def device_self_mib(self) -> int | None:
        """What llama.cpp allocated on its devices, summed over devices; None on a CPU-only run."""
        devs = self.devices
        return sum(r.self_mib for r in devs) if devs else None


def parse_memory_breakdown(text: str) -> MemoryBreakdown:
    """Parse the last memory breakdown table in `text` (stderr of a run with -lv 4)."""
    headers = list(_HEADER_RE.finditer(text))
    if not headers:
        raise ParseError("no memory breakdown table (run the tool with -lv 4)", text)
    rows: list[MemoryRow] = []
    for line in text[headers[-1].end():].splitlines()[1:]:
        if _FUNC not in line:
            # Other writers share stderr: ggml-vulkan's allocation logger writes straight to it while llama.cpp's
            # log thread prints the table, so their lines can fall between the table's rows. Skip them.
            continue
        if _FUNC + "|" not in line:
            break
        if (m := _DEVICE_RE.search(line)) is not None:
            rows.append(MemoryRow(m["name"], True, int(m["self"]), int(m["model"]), int(m["context"]),
                                  int(m["compute"]), int(m["total"]), int(m["free"]), int(m["unacc"])))
        elif (m := _OTHER_RE.search(line)) is not None:
            rows.append(MemoryRow(m["name"], False, int(m["self"]), int(m["model"]), int(m["context"]),
                                  int(m["compute"])))
        else:
            raise ParseError(f"unexpected memory breakdown row {line.strip()!r}", text)
    for r in rows:
        if r.self_mib < 0 or abs(r.model_mib + r.context_mib + r.compute_mib - r.self_mib) > 2:
            raise ParseError(f"memory breakdown row {r.name!r} does not add up "
                             "(self != model + context + compute)", text)
    if not any(r.name == "Host" for r in rows):
        raise ParseError("memory breakdown table has no Host row", text)
    return MemoryBreakdown(tuple(rows))


_VK_ALLOC_RE = re.compile(r"^ggml_vulkan memory: .*?: [+-][\d.]+ (?:B|KiB|MiB|GiB) (?:device|host) at \S+\. "
                          r"Total device: (?P<total>[\d.]+) (?P<unit>B|KiB|MiB|GiB)", re.M)
_UNIT_MIB = {"B": 2.0**-20, "KiB": 2.0**-10, "MiB": 1.0, "GiB": 1024.0}


def vulkan_device_peak_mib(text: str) -> float | None:
    """The device's own accounting on a Vulkan build: the highest "Total device" of ggml-vulkan's allocation log
    (GGML_VK_MEMORY_LOGGER=1: one line per buffer allocated or freed, sizes with 2 decimals), in MiB; None without
    such lines."""
    totals = [float(m["total"]) * _UNIT_MIB[m["unit"]] for m in _VK_ALLOC_RE.finditer(text)]
    return max(totals) if totals else None
