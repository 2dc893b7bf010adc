"""llama-bench's JSON output (`-o json`; tools/llama-bench/llama-bench.cpp, `json_printer`).

An array of objects, one per test, with the fields of `test::get_fields()` followed by
`"samples_ns": [ ... ]` (one wall time per repetition, nanoseconds) and `"samples_ts": [ ... ]`.
A test is prompt processing (n_gen == 0, "pp<n_prompt>") or generation (n_prompt == 0, "tg<n_gen>");
both at once ("pp+tg") is possible with -pg. The JSON goes to stdout; logs go to stderr.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from harness.parsers.base import ParseError

_REQUIRED = ("build_commit", "backends", "gpu_info", "model_filename", "n_batch", "n_ubatch", "n_threads",
             "n_gpu_layers", "n_cpu_moe", "n_prompt", "n_gen", "n_depth", "avg_ts", "samples_ns")


@dataclass(frozen=True)
class BenchResult:
    build_commit: str
    backends: str
    gpu_info: str
    model_filename: str
    n_batch: int
    n_ubatch: int
    n_threads: int
    n_gpu_layers: int
    n_cpu_moe: int
    n_prompt: int
    n_gen: int
    n_depth: int
    samples_ns: tuple[int, ...]
    avg_ts: float

    @property
    def test(self) -> str:
        """The name llama-bench's table uses: pp512, tg128, pp512+tg128; '@ d<n>' with a depth."""
        if self.n_gen == 0:
            name = f"pp{self.n_prompt}"
        elif self.n_prompt == 0:
            name = f"tg{self.n_gen}"
        else:
            name = f"pp{self.n_prompt}+tg{self.n_gen}"
        return name + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen

    @property
    def samples_ts(self) -> tuple[float, ...]:
        """Tokens per second of each repetition, computed as llama-bench does (n_tokens * 1e9 / ns)."""
        return tuple(self.n_tokens * 1e9 / ns for ns in self.samples_ns)


def _int(obj: dict[str, Any], key: str, text: str) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ParseError(f"llama-bench field {key!r} is {v!r}, expected an integer", text,
                         source="llama-bench")
    return v


def _str(obj: dict[str, Any], key: str, text: str) -> str:
    v = obj[key]
    if not isinstance(v, str):
        raise ParseError(f"llama-bench field {key!r} is {v!r}, expected a string", text, source="llama-bench")
    return v


def parse_bench_json(text: str) -> list[BenchResult]:
    """Parse the stdout of `llama-bench -o json`. Raises ParseError on anything else."""
    start = text.find("[")
    if start < 0:
        raise ParseError("no JSON array (was llama-bench run with -o json?)", text, source="llama-bench")
    try:
        data = json.loads(text[start:])
    except ValueError as e:
        raise ParseError(f"llama-bench JSON does not parse ({e})", text, source="llama-bench") from None
    if not isinstance(data, list) or not data:
        raise ParseError("llama-bench JSON is not a non-empty array of tests", text, source="llama-bench")
    out: list[BenchResult] = []
    for obj in data:
        if not isinstance(obj, dict):
            raise ParseError("llama-bench JSON array holds a non-object", text, source="llama-bench")
        missing = [k for k in _REQUIRED if k not in obj]
        if missing:
            raise ParseError(f"llama-bench JSON lacks {', '.join(missing)}", text, source="llama-bench")
        samples = obj["samples_ns"]
        if not isinstance(samples, list) or not samples or not all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in samples):
            raise ParseError(f"llama-bench samples_ns is {samples!r}, expected positive integers", text,
                             source="llama-bench")
        avg_ts = obj["avg_ts"]
        if not isinstance(avg_ts, (int, float)):
            raise ParseError(f"llama-bench avg_ts is {avg_ts!r}", text, source="llama-bench")
        out.append(BenchResult(
            build_commit=_str(obj, "build_commit", text),
            backends=_str(obj, "backends", text),
            gpu_info=_str(obj, "gpu_info", text),
            model_filename=_str(obj, "model_filename", text),
            n_batch=_int(obj, "n_batch", text),
            n_ubatch=_int(obj, "n_ubatch", text),
            n_threads=_int(obj, "n_threads", text),
            n_gpu_layers=_int(obj, "n_gpu_layers", text),
            n_cpu_moe=_int(obj, "n_cpu_moe", text),
            n_prompt=_int(obj, "n_prompt", text),
            n_gen=_int(obj, "n_gen", text),
            n_depth=_int(obj, "n_depth", text),
            samples_ns=tuple(samples),
            avg_ts=float(avg_ts),
        ))
    return out
