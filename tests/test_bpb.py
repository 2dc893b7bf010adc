"""`harness bpb`'s parts: the vocabulary's bytes (GPT-2's byte-level table, token types; a round trip on tinymoe's
own tokenizer) and bits per byte by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.project import project_root
from harness.parsers.vocab import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    gpt2_byte_decoder,
    read_vocab_bytes,
    vocab_bytes_from_metadata,
)
from harness.stats.bpb import LN2, bits_per_byte, chunk_totals

ROOT = project_root()
TINYMOE = ROOT / "models" / "tinymoe-f16.gguf"
TINYMOE_TOKENIZER = ROOT / "models" / "tinymoe-tokenizer.json"
SAMPLE = ("Debian's apt-get installs packages.\n\tIndented line; tabs, \"quotes\" and  double  spaces.\n"
          "Unicode: café, naïve, Ελληνικά, 日本語, emoji 🙂, a zero-width joiner \u200d and CRLF\r\n")


# ---- the vocabulary's bytes ------------------------------------------------------------------------------------


def test_gpt2_table_is_a_bijection_with_the_known_remaps() -> None:
    dec = gpt2_byte_decoder()
    assert sorted(dec.values()) == list(range(256))
    assert len(dec) == 256
    # printable bytes stand for themselves; space, newline, tab and byte 0 are remapped from U+0100 up
    assert dec["A"] == 65 and dec["~"] == 126 and dec["\u00a1"] == 0xA1
    assert dec["\u0120"] == 32 and dec["\u010a"] == 10 and dec["\u0109"] == 9 and dec["\u0100"] == 0
    assert dec["\u0143"] == 0xAD and "\u00ad" not in dec  # the soft hyphen is not printable: the last remap


def test_token_types_and_refusals() -> None:
    tokens = ["<|endoftext|>", "\u0120the", "<0x0A>", "<tool>", "\u00c3\u00a9"]
    types = [TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_BYTE, TOKEN_USER_DEFINED, TOKEN_NORMAL]
    v = vocab_bytes_from_metadata("m.gguf", "gpt2", "qwen2", tokens, types, 512)
    assert v.pieces == (b"", b" the", b"\n", b"<tool>", "é".encode())
    assert v.n_zero == 1 and v.lengths.tolist() == [0, 4, 1, 6, 2]
    assert v.decode([1, 4, 2, 0]) == " the\xc3\xa9\n".encode("latin-1")
    with pytest.raises(HarnessError, match="outside the vocabulary"):
        v.decode([5])
    with pytest.raises(HarnessError, match="byte-level BPE"):
        vocab_bytes_from_metadata("m.gguf", "llama", "", tokens, types)
    with pytest.raises(HarnessError, match="not in GPT-2's byte-level table"):
        vocab_bytes_from_metadata("m.gguf", "gpt2", "", ["\u0120caf\u00e9\u4e16"], None)  # U+4E16: no byte
    with pytest.raises(HarnessError, match="not <0xNN>"):
        vocab_bytes_from_metadata("m.gguf", "gpt2", "", ["<0xZZ>"], [TOKEN_BYTE])


def test_read_vocab_refuses_bad_files_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"NOTGGUF" + bytes(100))
    for path, match in ((tmp_path / "missing.gguf", "no such file"), (tmp_path / "x.gguf", "not a GGUF file")):
        with pytest.raises(HarnessError, match=match) as e:
            read_vocab_bytes(path)
        assert "\n" not in str(e.value)


def test_round_trip_on_tinymoe() -> None:
    """Decoding the ids of a text (tinymoe's own Hugging Face tokenizer) through the GGUF vocabulary gives the
    text's bytes exactly: a sample with multi-byte characters split across tokens, and the held-out text."""
    tokenizers = pytest.importorskip("tokenizers")
    if not TINYMOE.is_file() or not TINYMOE_TOKENIZER.is_file():
        pytest.skip("models/tinymoe-f16.gguf or its tokenizer is missing")
    vocab = read_vocab_bytes(TINYMOE)
    assert (vocab.model, vocab.n_vocab, vocab.n_ctx_train) == ("gpt2", 8192, 512)
    tok = tokenizers.Tokenizer.from_file(str(TINYMOE_TOKENIZER))
    heldout = (ROOT / "eval" / "data" / "heldout.txt").read_text(encoding="utf-8")[:50_000]
    for text in (SAMPLE, heldout):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert vocab.decode(ids) == text.encode("utf-8")
    ids = tok.encode(SAMPLE, add_special_tokens=False).ids
    assert any(len(vocab.pieces[i]) and not _utf8(vocab.pieces[i]) for i in ids), "no token splits a character"
    assert tok.id_to_token(0) == "<|endoftext|>" and vocab.pieces[0] == b""  # the control token: no bytes


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# ---- the arithmetic --------------------------------------------------------------------------------------------


def test_bits_per_byte_by_hand() -> None:
    nll = [1.0, 2.0, 0.5, 3.0, 1.5, 0.25]
    nbytes = [3, 4, 0, 2, 5, 1]  # the 0: a control token
    chunks = [0, 0, 0, 1, 1, 1]
    totals = chunk_totals(nll, nbytes, chunks)
    assert totals.nll == (3.5, 4.75) and totals.bytes == (7, 8) and totals.tokens == (3, 3)
    s = bits_per_byte(totals, n_boot=500, seed=1)
    assert s.bpb == pytest.approx(8.25 / math.log(2) / 15)
    assert (s.n_tokens, s.n_bytes, s.n_chunks) == (6, 15, 2)
    assert s.nats_per_token == pytest.approx(8.25 / 6)
    assert s.bytes_per_token == pytest.approx(2.5)
    assert s.ppl == pytest.approx(math.exp(8.25 / 6))
    assert s.bits_per_token == pytest.approx(8.25 / 6 / LN2)
    # the CI's ends are the bpb of the chunks alone (a bootstrap of two chunks draws them both, or one twice)
    assert s.low == pytest.approx(3.5 / LN2 / 7) and s.high == pytest.approx(4.75 / LN2 / 8)
    assert bits_per_byte(totals, n_boot=500, seed=1) == s  # seeded
    one = bits_per_byte(chunk_totals([1.0, 2.0], [2, 2], [0, 0]))
    assert one.bpb == pytest.approx(3 / LN2 / 4) and math.isnan(one.low) and "1 chunks" in one.kind
    with pytest.raises(HarnessError, match="no bytes"):
        bits_per_byte(chunk_totals([1.0], [0], [0]))
    with pytest.raises(HarnessError, match="not finite"):
        chunk_totals([math.inf], [1], [0])
