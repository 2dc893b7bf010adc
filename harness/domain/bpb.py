"""`harness bpb`: the options, the rule for its default context, and its result. Pure.

Bits per byte compares models whose tokenizers differ (tinymoe and studymoe: two 8192-token BPEs), which perplexity
per token cannot. What is scored is llama-perplexity's: the second half of each `n_ctx` chunk of the text in the
model's own tokens, so two models score slightly different spans of the same text (each its chunks' second halves);
over a whole text the spans cover about half of it, the same half in expectation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.domain.settings import PerplexitySettings
from harness.stats.bpb import BitsPerByte, ChunkTotals

DEFAULT_CTX = 512  # for a model whose metadata has no training context
MIN_CTX = 8


@dataclass(frozen=True)
class BpbOptions(PerplexitySettings):
    """`n_ctx` 0: the model's training context ({arch}.context_length), DEFAULT_CTX when it has none; `text` None:
    eval/data/heldout.txt; `chunks` None: all."""

    out: Path
    model: Path
    n_ctx: int = field(default=0, kw_only=True)
    n_boot: int = 2000
    seed: int = 0
    argv: tuple[str, ...] = ()


def resolve_ctx(requested: int, n_ctx_train: int | None) -> tuple[int, str]:
    """The context a bpb run uses and how it was chosen (said in the report)."""
    if requested:
        return requested, "--ctx"
    if n_ctx_train:
        return n_ctx_train, "the model's training context"
    return DEFAULT_CTX, f"the default {DEFAULT_CTX} (the model states no training context)"


@dataclass(frozen=True)
class BpbResult:
    options: BpbOptions
    model: Path
    text: Path
    text_bytes: int  # the text file's size
    n_ctx: int
    ctx_source: str
    vocab_model: str  # tokenizer.ggml.model
    vocab_pre: str
    n_vocab: int
    n_zero_vocab: int  # vocabulary entries counted as 0 bytes (control, unknown, unused)
    n_zero_scored: int  # scored tokens of 0 bytes
    bpb: BitsPerByte
    totals: ChunkTotals
    ppl_tool: float  # llama-perplexity's own final estimate (its +/- is one SE)
    ppl_tool_se: float
    results_path: Path
    warnings: tuple[str, ...] = ()
