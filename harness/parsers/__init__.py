"""Parsers: pure functions from the text that the pinned llama.cpp tools print to frozen dataclasses.

Each is matched to upstream's exact printf formats (file:line in the module docstrings) and raises
`ParseError`, which shows the tail of the text, when the output is not what it expects.
"""

from harness.parsers.base import ParseError, tail
from harness.parsers.bench import BenchResult, parse_bench_json
from harness.parsers.memory import MemoryBreakdown, MemoryRow, parse_memory_breakdown
from harness.parsers.perplexity import PerplexityResult, parse_perplexity

__all__ = [
    "BenchResult",
    "MemoryBreakdown",
    "MemoryRow",
    "ParseError",
    "PerplexityResult",
    "parse_bench_json",
    "parse_memory_breakdown",
    "parse_perplexity",
    "tail",
]
