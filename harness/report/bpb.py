"""`harness bpb`'s renderings: the JSON record (bpb.json, and --json), the Markdown report and the terminal lines.
Functions of the result only."""

from __future__ import annotations

import json
import math
from typing import Any

from harness.core.records import SCHEMA_VERSION
from harness.domain.bpb import BpbResult
from harness.report.tables import md_table, shown


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def bpb_json(r: BpbResult) -> dict[str, Any]:
    """The result as JSON: the figures and the per-chunk totals they are computed from."""
    s = r.bpb
    return {
        "schema_version": SCHEMA_VERSION, "command": "bpb",
        "model": shown(r.model), "text": shown(r.text), "text_bytes": r.text_bytes,
        "n_ctx": r.n_ctx, "ctx_source": r.ctx_source, "chunks_asked": r.options.chunks,
        "vocab": {"model": r.vocab_model, "pre": r.vocab_pre, "n_vocab": r.n_vocab,
                  "zero_byte_entries": r.n_zero_vocab},
        "bits_per_byte": s.bpb, "ci_low": _num(s.low), "ci_high": _num(s.high), "ci": s.kind,
        "n_boot": s.n_boot, "seed": s.seed,
        "tokens": s.n_tokens, "bytes": s.n_bytes, "n_chunks": s.n_chunks, "zero_byte_scored_tokens": r.n_zero_scored,
        "bytes_per_token": s.bytes_per_token, "nats_per_token": s.nats_per_token, "bits_per_token": s.bits_per_token,
        "ppl": s.ppl, "ppl_llama_perplexity": r.ppl_tool, "ppl_llama_perplexity_se": r.ppl_tool_se,
        "nll_nats": s.nll_nats,
        "results": shown(r.results_path), "warnings": list(r.warnings),
        "chunks": {"nll_nats": list(r.totals.nll), "bytes": list(r.totals.bytes), "tokens": list(r.totals.tokens)},
    }


def render_bpb_json(r: BpbResult) -> str:
    return json.dumps(bpb_json(r), indent=1, allow_nan=False) + "\n"


def _ci(r: BpbResult) -> str:
    s = r.bpb
    return "undefined (one chunk)" if not math.isfinite(s.low) else f"[{s.low:.4f}, {s.high:.4f}]"


def bpb_rows(r: BpbResult) -> list[list[str]]:
    s = r.bpb
    return [["bits per byte", f"{s.bpb:.4f}"], [f"{s.kind}", _ci(r)],
            ["scored tokens", f"{s.n_tokens:,}"], ["their bytes", f"{s.n_bytes:,}"],
            ["bytes per token", f"{s.bytes_per_token:.4f}"], ["nats per token", f"{s.nats_per_token:.4f}"],
            ["perplexity per token", f"{s.ppl:.4f} (llama-perplexity: {r.ppl_tool:.4f} +/- {r.ppl_tool_se:.4f}, "
                                     "one SE)"],
            ["chunks", f"{s.n_chunks} of {r.n_ctx} tokens ({r.ctx_source})"]]


def render_bpb_markdown(r: BpbResult) -> str:
    lines = ["# Bits per byte", "",
             f"Model `{shown(r.model)}` (vocabulary: {r.vocab_model}, pre-tokenizer {r.vocab_pre or '-'}, "
             f"{r.n_vocab} tokens) on `{shown(r.text)}` ({r.text_bytes:,} bytes). llama-perplexity (the patched "
             "build without a cache spec: the stock graph) scores the second half of each chunk; bits per byte = "
             "sum of the scored tokens' NLL / ln 2 / their bytes, each token's bytes from the model's own "
             f"vocabulary ({r.n_zero_vocab} control/unknown/unused entries count 0 bytes).", "",
             md_table(["", ""], bpb_rows(r)), ""]
    if r.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in r.warnings] + [""]
    lines += [f"Raw records: `{r.results_path}` and `bpb.json` beside it (per-chunk NLL sums, bytes and tokens).", ""]
    return "\n".join(lines)


def render_bpb_terminal(r: BpbResult) -> str:
    s = r.bpb
    lines = [f"{shown(r.model)} on {shown(r.text)}: {s.bpb:.4f} bits per byte, {s.kind} {_ci(r)}",
             f"  {s.n_tokens:,} tokens, {s.n_bytes:,} bytes ({s.bytes_per_token:.3f} bytes/token), "
             f"{s.nats_per_token:.4f} nats/token, perplexity {s.ppl:.4f}",
             f"  n_ctx {r.n_ctx} ({r.ctx_source}), {s.n_chunks} chunks; records: {r.results_path.parent}"]
    lines += [f"  warning: {w}" for w in r.warnings]
    return "\n".join(lines)
