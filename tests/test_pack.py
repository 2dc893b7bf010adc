"""The expert pack (issue 23 item 4): `harness pack` writes an expert-major copy of a model's routed experts next to
it, and host=file reads each missed expert from it in one read.

- the writer: the layout (4 KiB-aligned records holding the GGUF's slices byte for byte), the header's tensor
  table and CRCs, `--verify`; one-line errors for a non-MoE model, a damaged GGUF, a full disk; an interrupt or an
  error leaves no pack and no temporary file (and an older pack untouched);
- the engine: with the pack, the same decisions and bit-identical output as without it (fetch-all: stock's), one
  read per missed expert (pack_reads = file_reads = copied experts), the same bytes; without it one read per expert
  tensor; a pack of another model, a truncated pack and a stale pack (the model's modification time changed) are
  warned about and not used (pack=auto), or refused in one line (pack=PATH).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import struct
import zlib
from pathlib import Path

import pytest
from test_engine import check_ok, run_ppl, same_decisions

from harness.cli.app import main
from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.domain.pack import PACK_ALIGN, decode_header, default_pack_path, encode_header, plan_pack, with_crcs
from harness.orchestration import pack as pack_mod
from harness.orchestration.pack import read_pack_header, verify_pack, write_pack
from harness.parsers.gguf_model import read_model_info
from harness.tools.synth import SynthSpec, synth_text, write_synth_model

ARCHS = ("qwen3moe", "hy_v3", "gpt-oss")  # gate/up/down; merged gate_up; per-expert biases


def _spec(arch: str, **kw: object) -> SynthSpec:
    return SynthSpec(**{"arch": arch, "n_expert": 64, "n_expert_used": 8, "n_layer": 2, "seed": 5, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Models with their packs next to them (MODEL.moe-pack), one folder per arch."""
    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(f"packed-{arch}")
        m = write_synth_model(_spec(arch), d / f"{arch}.gguf")
        write_pack(m)
        out[arch] = m
    return out


@pytest.fixture(scope="module")
def pack_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pack-text") / "text.txt"
    path.write_text(synth_text(12000, seed=2))
    return path


def _copy_model(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    m = dst_dir / src.name
    shutil.copy2(src, m)  # keeps the modification time: the pack copied with it stays valid
    shutil.copy2(default_pack_path(src), default_pack_path(m))
    return m


# ---- the writer -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_pack_records_hold_the_gguf_slices(arch: str, packed: dict[str, Path]) -> None:
    model = packed[arch]
    info = read_model_info(model)
    layout = read_pack_header(default_pack_path(model))
    assert layout.n_expert == info.n_expert == 64
    assert [la.il for la in layout.layers] == list(info.moe_layers)
    assert {t.name for t in layout.tensors} == {t.name for t in info.expert_tensors}
    assert layout.gguf_size == model.stat().st_size and layout.gguf_mtime_ns == model.stat().st_mtime_ns
    gguf, pack = model.read_bytes(), default_pack_path(model).read_bytes()
    assert len(pack) == layout.pack_size
    crcs = []
    for la in layout.layers:
        assert la.first_record % PACK_ALIGN == 0 and la.record_bytes % PACK_ALIGN == 0
        assert la.data_bytes == sum(t.expert_bytes for t in la.tensors) <= la.record_bytes < la.data_bytes + PACK_ALIGN
        for t in la.tensors:
            et = next(x for x in info.expert_tensors if x.name == t.name)
            assert t.expert_bytes * 64 == et.n_bytes and t.gguf_offset == et.offset
            crcs.append(zlib.crc32(gguf[et.offset:et.offset + et.n_bytes]))
            assert t.crc32 == crcs[-1]
        for e in (0, 1, 37, 63):
            rec = pack[la.first_record + e * la.record_bytes:][:la.record_bytes]
            want = b"".join(gguf[t.gguf_offset + e * t.expert_bytes:][:t.expert_bytes] for t in la.tensors)
            assert rec[:la.data_bytes] == want
            assert rec[la.data_bytes:] == bytes(la.record_bytes - la.data_bytes)
    assert layout.checksum == zlib.crc32(b"".join(struct.pack("<I", c) for c in crcs))
    assert decode_header(encode_header(layout), "x") == layout
    assert verify_pack(model).layout == layout


def test_pack_cli_one_line_errors(tmp_path: Path, dense_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(20))
    short = tmp_path / "short.gguf"
    m = write_synth_model(_spec("qwen3moe", n_expert=8, n_expert_used=2), tmp_path / "m.gguf")
    short.write_bytes(m.read_bytes()[:m.stat().st_size // 2])
    for model, words in ((dense_model, "not a Mixture-of-Experts model"), (bad, "damaged or truncated GGUF"),
                         (short, "truncated"), (tmp_path / "none.gguf", "none.gguf")):
        assert main(["pack", str(model)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("harness: error:") and words in err and "\n" not in err, err
        assert not default_pack_path(model).exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert main(["pack", str(m), "--verify"]) == 2
    assert "no expert pack at" in capsys.readouterr().err
    assert main(["pack", str(m)]) == 0 and main(["pack", str(m), "--verify"]) == 0
    assert "matches" in capsys.readouterr().out


def test_pack_full_disk_and_interrupt_leave_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = write_synth_model(_spec("qwen3moe", n_expert=8, n_expert_used=2), tmp_path / "m.gguf")
    dest = default_pack_path(m)

    def leftovers() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p.name != "m.gguf")

    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as mp:
        mp.setattr(pack_mod.os, "posix_fallocate", full)
        with pytest.raises(HarnessError, match="no space left on its file system") as ei:
            write_pack(m)
        assert "\n" not in str(ei.value)
    assert leftovers() == []

    def interrupt(done: int, total: int, label: str) -> None:
        assert [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # the temporary file exists while writing
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_pack(m, progress=interrupt)
    assert leftovers() == []

    # SIGTERM while writing: the same (the writer turns it into an interrupt, and restores the handler after)
    def term(done: int, total: int, label: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
    before_handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        write_pack(m, progress=term)
    assert leftovers() == [] and signal.getsignal(signal.SIGTERM) == before_handler

    # an older pack stays as it was when writing a new one fails half-way (a write error after some records)
    write_pack(m)
    before = dest.read_bytes()
    real = os.pwrite
    calls = {"n": 0}

    def failing(fd: int, data: bytes | memoryview, off: int) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, off)
    with monkeypatch.context() as mp:
        mp.setattr(pack_mod.os, "pwrite", failing)
        with pytest.raises(HarnessError, match="Input/output error"):
            write_pack(m)
    assert calls["n"] == 3 and leftovers() == [dest.name] and dest.read_bytes() == before


def test_verify_finds_damage(tmp_path: Path) -> None:
    m = write_synth_model(_spec("qwen3moe", n_expert=8, n_expert_used=2), tmp_path / "m.gguf")
    dest = write_pack(m).path
    layout = read_pack_header(dest)
    la = layout.layers[1]
    good = dest.read_bytes()
    bad = bytearray(good)
    bad[la.first_record + 3 * la.record_bytes + 5] ^= 0x40
    dest.write_bytes(bytes(bad))
    with pytest.raises(HarnessError, match="the pack is damaged"):
        verify_pack(m)
    dest.write_bytes(good[:-PACK_ALIGN])
    with pytest.raises(HarnessError, match="truncated expert pack"):
        verify_pack(m)
    dest.write_bytes(good)
    os.utime(m, ns=(m.stat().st_atime_ns, m.stat().st_mtime_ns + 10**9))
    with pytest.raises(HarnessError, match="modification time changed"):
        verify_pack(m)
    other = write_synth_model(_spec("qwen3moe", n_expert=8, n_expert_used=2, n_ff_exp=64), tmp_path / "o.gguf")
    with pytest.raises(HarnessError, match="another model"):
        verify_pack(other, dest)
    with pytest.raises(HarnessError, match="not an expert pack"):
        decode_header(b"GGUF" + bytes(100), "x")


def test_layout_is_pure_and_round_trips(tmp_path: Path) -> None:
    info = read_model_info(write_synth_model(_spec("hy_v3"), tmp_path / "h.gguf"))
    a = plan_pack(info, 123, 456)
    assert a == plan_pack(info, 123, 456) and a.header_bytes % PACK_ALIGN == 0
    b = with_crcs(a, list(range(len(a.tensors))))
    assert decode_header(encode_header(b), "x") == b
    assert a.pack_size == a.header_bytes + sum(la.record_bytes * 64 for la in a.layers)


# ---- the engine -------------------------------------------------------------------------------------------------

@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ubatch", [1, None])
def test_pack_fetch_all_is_stock_in_one_read_per_expert(arch: str, ubatch: int | None, packed: dict[str, Path],
                                                        pack_text: Path, tmp_path: Path, stock_build: Build,
                                                        patched_build: Build) -> None:
    model = packed[arch]
    spec = "mode=engine,policy=fetch-all,slots=25%,host=file"
    with_pack = run_ppl(patched_build, model, pack_text, tmp_path / "pack", spec, ubatch=ubatch, extra=("-lv", "4"))
    without = run_ppl(patched_build, model, pack_text, tmp_path / "off", spec + ",pack=off", ubatch=ubatch,
                      extra=("-lv", "4"))
    stock = run_ppl(stock_build, model, pack_text, tmp_path / "stock", ubatch=ubatch, nll=False)
    for r in (with_pack, without, stock):
        check_ok(r)
    assert with_pack.logits == without.logits == stock.logits
    assert with_pack.stats is not None and without.stats is not None
    same_decisions(with_pack.stats, without.stats)
    p, o = with_pack.stats["engine"], without.stats["engine"]
    n_tensors = len([t for t in read_model_info(model).expert_tensors if t.name.startswith("blk.0.")])
    assert p["pack"] == str(default_pack_path(model)) and o["pack"] == ""
    assert "one read per missed expert" in with_pack.output and "one per expert tensor" in without.output
    # with the pack: one read per expert copied into the banks; without: one per expert tensor (and per run of
    # consecutive experts), the same bytes
    assert p["copied_experts"] == o["copied_experts"] > 0
    assert p["file_reads"] == p["pack_reads"] == p["copied_experts"] == p["copies"], p
    assert o["pack_reads"] == 0 and o["file_reads"] == o["copies"] > p["file_reads"], o
    assert o["copies"] % n_tensors == 0 and o["copies"] // n_tensors <= o["copied_experts"]
    if ubatch == 1:
        assert o["copies"] >= n_tensors * o["copied_experts"] * 0.8  # most reads are of one expert at a time
    assert p["file_read_bytes"] == p["pack_read_bytes"] == o["file_read_bytes"] == p["copy_bytes"] == o["copy_bytes"]


@pytest.mark.build
def test_pack_of_a_kquant_model_is_stock(pack_text: Path, tmp_path: Path, stock_build: Build,
                                         patched_build: Build) -> None:
    """Q4_K_M mixes types per tensor (Q4_K gate/up, Q6_K down in some layers): the records keep each slice in its own
    type, fetch-all through the pack is stock bit for bit, one read per expert."""
    from harness.tools.quantize import find_quantize, write_kquant_model

    try:
        tool = find_quantize({"stock": stock_build, "patched": patched_build})
    except HarnessError as e:
        pytest.skip(str(e))
    model = write_kquant_model(_spec("qwen3moe", n_embd=256, n_ff_exp=256, n_ff_shexp=256), "Q4_K_M",
                               tmp_path / "q4km.gguf", tool)
    write_pack(model)
    types = {t.ggml_type for t in read_pack_header(default_pack_path(model)).tensors}
    assert len(types) >= 2, types  # Q4_K and Q6_K slices side by side in the records
    nr = ("--no-repack",)
    stock = run_ppl(stock_build, model, pack_text, tmp_path / "stock", ubatch=1, nll=False, extra=nr)
    eng = run_ppl(patched_build, model, pack_text, tmp_path / "eng", "mode=engine,policy=fetch-all,slots=25%,host=file",
                  ubatch=1, extra=nr)
    check_ok(stock)
    check_ok(eng)
    assert eng.logits == stock.logits
    assert eng.stats is not None
    e = eng.stats["engine"]
    assert e["pack_reads"] == e["file_reads"] == e["copied_experts"] > 0, e


@pytest.mark.build
@pytest.mark.parametrize("io", ["", ",direct=off,readers=1", ",async=off", ",ram_slots=50%", ",policy=speed"])
def test_pack_same_decisions_and_output(io: str, packed: dict[str, Path], pack_text: Path, tmp_path: Path,
                                        patched_build: Build) -> None:
    """quality (and speed), O_DIRECT or buffered (one preadv into the banks), reader threads or synchronous reads,
    three tiers: with the pack, the decisions and output of the three-read path, bit for bit."""
    model = packed["qwen3moe"]
    spec = "mode=engine,slots=25%,host=file" + ("" if "policy=" in io else ",policy=quality") + io
    with_pack = run_ppl(patched_build, model, pack_text, tmp_path / "pack", spec, ubatch=1)
    without = run_ppl(patched_build, model, pack_text, tmp_path / "off", spec + ",pack=off", ubatch=1)
    check_ok(with_pack)
    check_ok(without)
    assert with_pack.logits == without.logits
    assert with_pack.stats is not None and without.stats is not None
    same_decisions(with_pack.stats, without.stats)
    p, t = with_pack.stats["engine"], with_pack.stats["total"]
    assert p["pack_reads"] == p["file_reads"] > 0
    assert p["file_read_bytes"] == without.stats["engine"]["file_read_bytes"]
    if "ram_slots" in io:
        assert p["pack_reads"] == t["file_loads"], (p, t)  # one read per expert read through the RAM tier
    else:
        assert p["pack_reads"] == p["copied_experts"]


@pytest.mark.build
def test_pack_mismatch_is_warned_or_refused(packed: dict[str, Path], pack_text: Path, tmp_path: Path,
                                            patched_build: Build) -> None:
    """A pack that does not match the model: pack=auto (the default) says why in one warning and reads from the model
    file (same output); pack=PATH is a one-line error naming the pack and what differs."""
    spec = "mode=engine,policy=quality,slots=25%,host=file"
    ref_model = packed["qwen3moe"]
    ref = run_ppl(patched_build, ref_model, pack_text, tmp_path / "ref", spec + ",pack=off", ubatch=1, nll=False)
    check_ok(ref)

    def case(name: str, damage: object, words: str) -> None:
        m = _copy_model(ref_model, tmp_path / name)
        damage(m)  # type: ignore[operator]
        auto = run_ppl(patched_build, m, pack_text, tmp_path / f"{name}-auto", spec, ubatch=1, nll=False)
        check_ok(auto)
        assert auto.stats is not None and auto.stats["engine"]["pack_reads"] == 0 and auto.stats["engine"]["pack"] == ""
        warn = [ln for ln in auto.output.splitlines() if "expert pack" in ln and "not used" in ln]
        assert len(warn) == 1 and words in warn[0] and str(default_pack_path(m)) in warn[0], (name, warn)
        assert auto.logits == ref.logits
        given = run_ppl(patched_build, m, pack_text, tmp_path / f"{name}-given",
                        f"{spec},pack={default_pack_path(m)}", ubatch=1, nll=False, want=words)
        assert given.returncode != 0, (name, given.output[-2000:])
        lines = [ln for ln in given.output.splitlines() if f"pack={default_pack_path(m)}:" in ln and words in ln]
        assert lines, (name, given.output[-2000:])

    def truncate(m: Path) -> None:
        p = default_pack_path(m)
        p.write_bytes(p.read_bytes()[:-PACK_ALIGN])

    def touch(m: Path) -> None:
        os.utime(m, ns=(m.stat().st_atime_ns, m.stat().st_mtime_ns + 10**9))

    def other(m: Path) -> None:
        o = write_synth_model(_spec("qwen3moe", n_ff_exp=64), m.parent / "other.gguf")
        write_pack(o, default_pack_path(m))

    def not_a_pack(m: Path) -> None:
        default_pack_path(m).write_bytes(b"GGUF" + bytes(8192))

    case("truncated", truncate, "truncated")
    case("stale", touch, "stale")
    case("other", other, "another model")
    case("garbage", not_a_pack, "not an expert pack")


def test_harness_refuses_a_special_file_as_pack(tmp_path: Path) -> None:
    from harness.core.files import check_cache_paths

    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    with pytest.raises(HarnessError, match=f"pack={fifo} is a FIFO"):
        check_cache_paths([("pack", str(fifo))])
    with pytest.raises(HarnessError, match="is a folder"):
        check_cache_paths([("pack", str(tmp_path))])
    check_cache_paths([("pack", "off"), ("pack", "auto"), ("pack", str(tmp_path / "none.moe-pack"))])


@pytest.mark.build
def test_pack_spec_refusals(packed: dict[str, Path], pack_text: Path, tmp_path: Path, patched_build: Build) -> None:
    model = packed["qwen3moe"]
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    for spec, words in (("mode=engine,slots=25%,pack=off", "pack= sets how host=file reads"),
                        ("mode=emulate,slots=25%,host=file,pack=off", "emulate reads nothing"),
                        ("mode=engine,slots=25%,host=file,pack=", "'pack'"),
                        (f"mode=engine,slots=25%,host=file,pack={tmp_path / 'none.moe-pack'}", "cannot open"),
                        (f"mode=engine,slots=25%,host=file,pack={fifo}", "is a FIFO (named pipe)")):
        r = run_ppl(patched_build, model, pack_text, tmp_path / "r", spec, ubatch=1, nll=False, want=words)
        assert r.returncode != 0 and words in r.output, (spec, r.output[-2000:])
