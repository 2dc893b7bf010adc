"""parse_perplexity on captured outputs of the pinned stock llama-perplexity (tests/data/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.parsers import ParseError, parse_perplexity

DATA = Path(__file__).resolve().parent.parent / "data" / "stock-cpu"


def _text(name: str) -> str:
    return (DATA / f"{name}.stdout").read_text() + "\n" + (DATA / f"{name}.stderr").read_text()


def test_three_chunks_with_trace_logging() -> None:
    r = parse_perplexity(_text("perplexity-lv4"))
    assert r.ppl == 822.0579 and r.ppl_se == 65.03451
    assert r.running_ppl == (664.3085, 754.7327, 822.0579)
    assert (r.n_chunks, r.n_ctx, r.n_batch, r.n_seq) == (3, 128, 128, 1)
    assert r.n_scored_tokens == 3 * 63


def test_two_sequences_per_batch() -> None:
    r = parse_perplexity(_text("perplexity-nseq2"))
    assert (r.n_chunks, r.n_seq, r.n_batch) == (16, 2, 256)
    assert len(r.running_ppl) == 16 and r.running_ppl[0] == 664.3085 and r.running_ppl[-1] == 898.5164
    assert r.ppl == 898.5164 and r.ppl_se == 29.7136


def test_output_type_1() -> None:
    r = parse_perplexity(_text("perplexity-type1"))
    assert r.running_ppl == (664.3085, 754.7327) and r.ppl == 754.7327


def test_too_short_text_says_so() -> None:
    with pytest.raises(ParseError, match="too short.*at least 256 tokens for a context of 128, and the text has 126"):
        parse_perplexity(_text("perplexity-short"))


def test_lost_end_of_output_is_an_error_with_the_tail() -> None:
    with pytest.raises(ParseError, match="no 'Final estimate") as e:
        parse_perplexity(_text("perplexity-truncated"))
    assert "[1]664.3085," in str(e.value)  # the tail of the output is in the message
    assert "last lines:" in str(e.value)


def test_inconsistent_or_foreign_text() -> None:
    with pytest.raises(ParseError, match="calculating perplexity"):
        parse_perplexity("error: unknown argument: --nll-dump\n")
    text = _text("perplexity-lv4").replace("[2]754.7327,", "")
    with pytest.raises(ParseError, match="chunks 1..3"):
        parse_perplexity(text)
    text = _text("perplexity-lv4").replace("PPL = 822.0579", "PPL = 900.0000")
    with pytest.raises(ParseError, match="disagrees"):
        parse_perplexity(text)
