"""scripts/fuzz_inputs.py, the bounded version (issue 15): damaged GGUF models, router traces and NLL dumps through
`harness info`, `harness compare --model`, the patched llama-perplexity with the cache on, llama-moe-sim and the
harness readers give a clear error each time, never a crash, a traceback or a hang; the undamaged inputs pass (the
control case)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.core.project import Build

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *extra: str) -> tuple[int, str, dict[str, Any]]:
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fuzz_inputs.py"), "--quick", "--json", str(out),
                        "--keep", str(tmp_path / "findings"), *extra], capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.build
def test_fuzz_inputs_quick(tmp_path: Path, stock_build: Build, patched_build: Build) -> None:
    rc, out, tallies = _run(tmp_path, "--bin", str(patched_build.bin_dir))
    assert rc == 0 and "0 findings" in out, out[-4000:]
    targets = {t for kind in tallies.values() for t in kind}
    assert {"harness info", "llama-perplexity (cache on)", "harness compare --model", "read_expert_trace",
            "llama-moe-sim", "read_nll_dump_file + paired delta"} <= targets, targets
    for kind in tallies.values():
        for name, t in kind.items():
            least = 4 if name.startswith("harness compare") else 10  # an accepted model's compare runs six tools
            assert t["cases"] >= least and t["outcomes"].get("accepted", 0) >= 1, (name, t)  # the control passed
            assert t["outcomes"].get("clear", 0) >= 1, (name, t)


def test_fuzz_finds_a_planted_crash(tmp_path: Path) -> None:
    """The loop can fail: a reader that raises something other than a HarnessError is reported as a crash."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fuzz_inputs as fz
    finally:
        sys.path.pop(0)

    def bad(path: Path) -> None:
        if path.stat().st_size < 40:
            raise IndexError("planted")

    cases = [fz.Case("nll", "short", b"x" * 10), fz.Case("nll", "long", b"x" * 100)]
    t = fz.fuzz(cases, {"planted": lambda p, lim: fz._in_child(bad, p, lim)}, tmp_path, None, 10, 10.0, 5.0,
                lambda s: None)["planted"]
    assert t.cases == 2 and t.outcomes == {"crash": 1, "accepted": 1} and "IndexError: planted" in t.findings[0]


@pytest.mark.build
def test_duplicate_vocabulary_token_is_an_error_not_an_abort(tmp_path: Path, patched_build: Build) -> None:
    """Found by the fuzz loop (one flipped bit in the token list): two equal token strings aborted every tool with
    a GGML_ASSERT while loading the vocabulary; patch 0009 makes it a load error naming the vocabulary."""
    import os

    import gguf
    import numpy as np

    from harness.tools.synth import SynthSpec, synth_text, write_synth_model

    model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=8, n_expert_used=2, n_layer=2, seed=3),
                              tmp_path / "m.gguf")
    f = gguf.GGUFReader(str(model)).fields["tokenizer.ggml.tokens"]
    offsets = f.offset + np.concatenate([[0], np.cumsum([int(p.nbytes) for p in f.parts])])
    strings = [(int(offsets[i]), bytes(f.parts[i])) for i in f.data]
    by_len: dict[int, tuple[int, bytes]] = {}
    data = bytearray(model.read_bytes())
    for off, s in strings:
        if len(s) in by_len and by_len[len(s)][1] != s:
            data[off:off + len(s)] = by_len[len(s)][1]  # this token now spells the earlier one
            break
        by_len[len(s)] = (off, s)
    else:
        pytest.fail("no two tokens of the same length")
    bad = tmp_path / "dup.gguf"
    bad.write_bytes(bytes(data))
    text = tmp_path / "t.txt"
    text.write_text(synth_text(2000, seed=1))
    env = {**os.environ, "LLAMA_MOE_CACHE": "mode=engine,slots=50%"}
    r = subprocess.run([str(patched_build.tool("llama-perplexity")), "-m", str(bad), "-f", str(text), "-c", "32",
                        "--chunks", "1", "-t", "1"], env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "GGML_ASSERT" not in out, out[-3000:]
    assert "error loading model vocabulary: the vocabulary has 512 tokens but only 511 distinct token strings" in out
