"""harness.tools.quantize without a build: the spec checks, the tool lookup and the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.tools.quantize import KQUANTS, check_kquant_spec, find_quantize, quantize_command
from harness.tools.synth import SynthSpec


def test_kquant_spec_rows_must_be_whole_blocks() -> None:
    ok = SynthSpec(n_embd=256, n_ff_exp=256, n_ff_shexp=256, arch="qwen2moe")
    for qtype in KQUANTS:
        check_kquant_spec(ok, qtype)
    with pytest.raises(HarnessError, match="n_ff_exp=32 must be a multiple of 256"):
        check_kquant_spec(SynthSpec(n_embd=256, n_ff_exp=32), "Q4_K_M")
    with pytest.raises(HarnessError, match="n_ff_shexp=64 must be a multiple of 256"):
        check_kquant_spec(SynthSpec(arch="hy_v3", n_embd=256, n_ff_exp=256), "Q6_K")
    with pytest.raises(HarnessError, match="unknown type 'Q4_0'; choose one of Q4_K_M, Q6_K"):
        check_kquant_spec(ok, "Q4_0")


def test_find_quantize(tmp_path: Path) -> None:
    stock, patched = tmp_path / "stock", tmp_path / "patched"
    stock.mkdir()
    patched.mkdir()
    builds = {"stock": Build("stock", "cpu", stock), "patched": Build("patched", "cpu", patched)}
    with pytest.raises(HarnessError, match=r"no llama-quantize .*run ./build.sh"):
        find_quantize(builds)
    (patched / "llama-quantize").write_text("")
    assert find_quantize(builds) == patched / "llama-quantize"
    (stock / "llama-quantize").write_text("")
    assert find_quantize(builds) == stock / "llama-quantize"  # the stock build's first


def test_quantize_command() -> None:
    assert quantize_command(Path("/b/llama-quantize"), Path("a.gguf"), Path("b.gguf"), "Q4_K_M") == [
        "/b/llama-quantize", "a.gguf", "b.gguf", "Q4_K_M", "2"]


def test_synth_quantize_cli_refuses_partial_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """harness synth --quantize with rows that are not whole K-quant blocks: one line, exit 2, nothing written
    (no build is looked for)."""
    from harness.cli import main

    out = tmp_path / "m.gguf"
    assert main(["synth", "-o", str(out), "--embd", "256", "--ff", "32", "--quantize", "Q4_K_M"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("harness: error: quantize: Q4_K_M packs 256 weights per block: n_ff_exp=32 must be a multiple of "
                   "256 (llama-quantize would fall back to another type for those tensors)")
    assert not list(tmp_path.iterdir())
