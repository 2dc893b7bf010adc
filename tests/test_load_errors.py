"""A damaged model's expert counts are a load error of the patched tools, not an abort (patch 0013, issue 35): a GGUF
that uses more experts per token than it has aborted llama.cpp in load_hparams (GGML_ASSERT, SIGABRT); the patched
llama-perplexity fails to load it with one line naming the counts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.core.project import Build
from harness.tools.synth import SynthSpec, write_synth_model

pytestmark = pytest.mark.build


def _with_expert_used(src: Path, dst: Path, value: int) -> None:
    """`src` with its qwen3moe.expert_used_count (a uint32 key) set to `value`, byte for byte otherwise."""
    data = bytearray(src.read_bytes())
    key = b"qwen3moe.expert_used_count"
    at = data.index(key) + len(key)
    assert int.from_bytes(data[at:at + 4], "little") == 4  # GGUF_TYPE_UINT32
    data[at + 4:at + 8] = value.to_bytes(4, "little")
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("used", [9, 0])
def test_expert_counts_that_aborted_are_a_load_error(used: int, patched_build: Build, synth_text_file: Path,
                                                     tmp_path: Path) -> None:
    good = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=8, n_expert_used=2, n_layer=1), tmp_path / "m.gguf")
    bad = tmp_path / "bad.gguf"
    _with_expert_used(good, bad, used)
    res = subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(bad), "-f", str(synth_text_file),
                          "-c", "64", "--chunks", "1", "-t", "2"], capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1, (res.returncode, out[-2000:])  # an error exit, not SIGABRT (-6)
    lines = [ln for ln in out.splitlines() if "expert counts are inconsistent" in ln]
    assert lines and f"8 experts, {used} used per token" in lines[0], out[-2000:]
    assert "GGML_ASSERT" not in out
