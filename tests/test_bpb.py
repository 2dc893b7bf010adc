"""`harness bpb`: the vocabulary's bytes (GPT-2's byte-level table, token types; a round trip on tinymoe's own
tokenizer), bits per byte by hand, the run with a fake runner (resumption, one-line errors) and on the real build."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_compare import FakeEnv

from harness.cli import main
from harness.core.errors import HarnessError
from harness.core.project import Build, project_root
from harness.domain.bpb import BpbOptions, resolve_ctx
from harness.orchestration.bpb import run_bpb
from harness.parsers import PerplexityResult
from harness.parsers.base import ParseError
from harness.parsers.nll_dump import NllDump, read_nll_dump_file
from harness.parsers.vocab import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    gpt2_byte_decoder,
    read_vocab_bytes,
    vocab_bytes_from_metadata,
)
from harness.report.bpb import bpb_json
from harness.stats.bpb import LN2, bits_per_byte, chunk_totals
from harness.tools.requests import PerplexityRequest, PerplexityRun, RunOutput

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


def test_resolve_ctx() -> None:
    assert resolve_ctx(0, 512) == (512, "the model's training context")
    assert resolve_ctx(256, 512) == (256, "--ctx")
    assert resolve_ctx(0, None)[0] == 512


# ---- the run, with a fake runner -------------------------------------------------------------------------------

VOCAB = vocab_bytes_from_metadata("m.gguf", "gpt2", "qwen2", ["<|endoftext|>", "a", "\u0120bc", "def\u010a"],
                                  [TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_NORMAL, TOKEN_NORMAL], 8)


class DumpRunner:
    """One llama-perplexity run: n_ctx 8 (first 4, 3 scored tokens per chunk), two chunks; records calls."""

    TOKENS = np.array([1, 2, 3, 3, 0, 2], dtype=np.int32)
    NLL = np.array([2.0, 1.0, 0.5, 1.5, 4.0, 1.0])

    def __init__(self, too_short: bool = False) -> None:
        self.calls: list[PerplexityRequest] = []
        self.too_short = too_short

    def bench(self, build: Build, req: object) -> object:
        raise AssertionError("bpb runs no benchmark")

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        assert build.name == "patched" and req.cache is None and req.nll_dump is not None
        self.calls.append(req)
        if self.too_short:
            raise ParseError("the text is too short: llama-perplexity needs at least 16 tokens for a context of 8, "
                             "and the text has 5; pass a longer text or a smaller context", "out",
                             source="llama-perplexity")
        ppl = math.exp(float(self.NLL.mean()))
        result = PerplexityResult(ppl, 0.1, 2, req.n_ctx, req.n_batch, 1, (2.0, ppl))
        return PerplexityRun(result, None, RunOutput(("llama-perplexity",), {}, 0, "", "", 0.1))

    def load_nll(self, path: Path) -> NllDump:
        return NllDump(8, 4, 2, self.TOKENS, self.NLL)


def test_run_bpb_with_a_fake_runner(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("a bcdef\n" * 4)
    opts = BpbOptions(out=tmp_path / "out", model=tmp_path / "m.gguf", text=text, n_boot=300)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    runner = DumpRunner()
    r = run_bpb(opts, runner, VOCAB, env=FakeEnv(tmp_path), root=tmp_path)
    assert [c.n_ctx for c in runner.calls] == [8]  # the model's training context
    assert r.ctx_source == "the model's training context" and r.n_ctx == 8
    # bytes: a=1, " bc"=3, "def\n"=4, "def\n"=4, control=0, " bc"=3 -> 15
    assert r.bpb.n_bytes == 15 and r.bpb.n_tokens == 6 and r.n_zero_scored == 1
    assert r.bpb.bpb == pytest.approx(10.0 / LN2 / 15)
    assert r.totals.nll == (3.5, 6.5) and r.totals.bytes == (8, 7)
    assert any("control tokens" in w for w in r.warnings)
    j = bpb_json(r)
    assert j["bits_per_byte"] == r.bpb.bpb and j["chunks"]["bytes"] == [8, 7] and j["n_ctx"] == 8
    json.dumps(j, allow_nan=False)
    # resumed: the recorded run is not redone
    again = run_bpb(opts, runner, VOCAB, env=FakeEnv(tmp_path), root=tmp_path)
    assert len(runner.calls) == 1 and again.bpb == r.bpb
    # another context is another configuration: refused in the same folder
    with pytest.raises(HarnessError, match="different configuration"):
        run_bpb(BpbOptions(out=opts.out, model=opts.model, text=text, n_ctx=16), runner, VOCAB,
                env=FakeEnv(tmp_path), root=tmp_path)


def test_run_bpb_errors_are_one_line(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("a bc")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    cases = [(BpbOptions(out=tmp_path / "o1", model=tmp_path / "m.gguf", text=text), DumpRunner(True), "too short"),
             (BpbOptions(out=tmp_path / "o2", model=tmp_path / "m.gguf", text=tmp_path / "no.txt"), DumpRunner(),
              "missing"),
             (BpbOptions(out=tmp_path / "o3", model=tmp_path / "m.gguf", text=text, n_ctx=4), DumpRunner(),
              "too small")]
    (tmp_path / "empty.txt").write_text("")
    cases.append((BpbOptions(out=tmp_path / "o4", model=tmp_path / "m.gguf", text=tmp_path / "empty.txt"),
                  DumpRunner(), "empty"))
    for opts, runner, match in cases:
        with pytest.raises(HarnessError, match=match) as e:
            run_bpb(opts, runner, VOCAB, env=FakeEnv(tmp_path), root=tmp_path)
        assert "\n" not in str(e.value), str(e.value)


def test_cli_bad_inputs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x.gguf").write_text("not a model")
    for argv, match in ((["bpb", str(tmp_path / "none.gguf")], "no such file"),
                        (["bpb", str(tmp_path / "x.gguf")], "not a GGUF file")):
        assert main([*argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("harness: error:") and match in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()
    if TINYMOE.is_file():
        assert main(["bpb", str(TINYMOE), "--text", str(tmp_path / "no.txt"), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert "is missing" in err and "\n" not in err, err


# ---- the real build --------------------------------------------------------------------------------------------


@pytest.mark.build
def test_bpb_end_to_end_on_tinymoe(tmp_path: Path, patched_build: Build) -> None:
    """Three chunks of the held-out text: bpb is the dump's sum of NLLs / ln 2 / the scored tokens' bytes, the
    dump's perplexity is llama-perplexity's own, and each chunk's scored tokens spell a piece of the text."""
    from harness.orchestration.bpb import bpb

    if not TINYMOE.is_file():
        pytest.skip("models/tinymoe-f16.gguf is missing")
    text = ROOT / "eval" / "data" / "heldout.txt"
    opts = BpbOptions(out=tmp_path / "out", model=TINYMOE, text=text, chunks=3, threads=1, n_boot=200)
    r = bpb(opts)
    dump = read_nll_dump_file(tmp_path / "out" / "nll" / "tinymoe-f16.bin")
    vocab = read_vocab_bytes(TINYMOE)
    assert (dump.n_ctx, dump.n_chunk, r.n_ctx) == (512, 3, 512)
    assert r.bpb.n_tokens == 3 * 255 == dump.tokens.size
    n_bytes = sum(len(vocab.pieces[t]) for t in dump.tokens)
    assert r.bpb.n_bytes == n_bytes
    assert r.bpb.bpb == pytest.approx(float(dump.nll.sum()) / math.log(2) / n_bytes, rel=1e-12)
    assert r.bpb.ppl == pytest.approx(r.ppl_tool, rel=1e-4)
    raw = text.read_bytes()
    for c in range(3):
        piece = vocab.decode(dump.tokens[c * 255:(c + 1) * 255])
        assert len(piece) > 255 and piece in raw, f"chunk {c}'s scored tokens do not spell a piece of the text"
    saved = json.loads((tmp_path / "out" / "bpb.json").read_text())
    assert saved["bits_per_byte"] == r.bpb.bpb and sum(saved["chunks"]["bytes"]) == n_bytes
    assert "Bits per byte" in (tmp_path / "out" / "report.md").read_text()
