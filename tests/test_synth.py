"""harness.tools.synth: generated random-weight models are deterministic, read back as specified, and run."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from harness.cli import main
from harness.core.errors import HarnessError, NotMoEError
from harness.core.project import Build
from harness.parsers.gguf_model import read_model_info
from harness.tools.synth import (
    ARCHS,
    DTYPES,
    MIN_VOCAB,
    SynthSpec,
    build_tokenizer,
    check_spec,
    expected_bytes_per_expert,
    synth_text,
    write_synth_model,
)

WRITABLE = ("f32", "f16", "q8_0", "q4_0")


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    for arch in ARCHS:
        a = write_synth_model(SynthSpec(arch=arch, seed=7), tmp_path / f"{arch}-a.gguf").read_bytes()
        b = write_synth_model(SynthSpec(arch=arch, seed=7), tmp_path / f"{arch}-b.gguf").read_bytes()
        c = write_synth_model(SynthSpec(arch=arch, seed=8), tmp_path / f"{arch}-c.gguf").read_bytes()
        assert a == b
        assert len(a) == len(c) and a != c


@pytest.mark.parametrize("workers", [2, 5])
def test_parallel_encoding_writes_the_same_bytes(tmp_path: Path, workers: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Large models encode several tensors at once (scripts/gpu_check.sh's model): the bytes do not depend on it."""
    import harness.tools.synth as synth

    spec = SynthSpec(arch="qwen2moe", seed=3, dtype="q4_0")
    serial = write_synth_model(spec, tmp_path / "serial.gguf").read_bytes()
    monkeypatch.setattr(synth, "_workers", lambda plan: workers)
    assert write_synth_model(spec, tmp_path / "parallel.gguf").read_bytes() == serial


@pytest.mark.parametrize("dtype", ["f16", "q4_0"])
def test_streamed_chunks_write_the_same_bytes(tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer streams each tensor in chunks of rows (CHUNK_BYTES), so that the study's full geometry (2 GiB of
    float32 per expert tensor) is written in bounded memory: the file does not depend on the chunk size, from whole
    tensors (the writer before streaming) down to one row per chunk, and no chunk exceeds the bound."""
    import harness.tools.synth as synth

    spec = SynthSpec(arch="qwen3moe", n_layer=2, n_expert=8, n_expert_used=2, n_embd=64, n_ff_exp=64, dtype=dtype,
                     seed=5)
    monkeypatch.setattr(synth, "CHUNK_BYTES", 1 << 62)  # every tensor in one chunk: whole tensors
    whole = write_synth_model(spec, tmp_path / "whole.gguf").read_bytes()
    for chunk in (4 * 64 * 7, 1):  # 7 rows per chunk (uneven splits), one row per chunk
        monkeypatch.setattr(synth, "CHUNK_BYTES", chunk)
        assert write_synth_model(spec, tmp_path / f"c{chunk}.gguf").read_bytes() == whole
    t = next(t for t in synth.plan_moe(spec) if "exps" in t.name)
    sizes = [c.nbytes for c in synth._value_chunks(t, 5, 4 * 64 * 7)]
    assert max(sizes) == 4 * 64 * 7 and sum(sizes) == 4 * int(np.prod(t.shape))


def test_the_writer_holds_a_few_chunks_not_a_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory while writing (numpy's allocations, tracemalloc) is a few chunks: a model of 4 MiB float32 expert
    tensors written in 64 KiB chunks peaks under 1 MiB, against more than a tensor (4 MiB) a tensor at a time."""
    import tracemalloc

    import harness.tools.synth as synth

    spec = SynthSpec(arch="qwen3moe", n_layer=1, n_expert=64, n_expert_used=4, n_embd=128, n_ff_exp=128,
                     dtype="q4_0", seed=1)
    write_synth_model(spec, tmp_path / "warm.gguf")  # the tokenizer is built (and cached) outside the measurement
    peaks = {}
    for chunk in (1 << 62, 64 << 10):
        monkeypatch.setattr(synth, "CHUNK_BYTES", chunk)
        tracemalloc.start()
        try:
            write_synth_model(spec, tmp_path / f"{chunk}.gguf")
            peaks[chunk] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks[64 << 10] < (1 << 20) and peaks[1 << 62] > 4 * (1 << 20), peaks


@pytest.mark.parametrize("dtype", WRITABLE)
@pytest.mark.parametrize("arch", ARCHS)
def test_info_matches_spec(tmp_path: Path, arch: str, dtype: str) -> None:
    spec = SynthSpec(arch=arch, n_layer=3, n_expert=8, n_expert_used=3, n_embd=64, n_ff_exp=64, n_ff_shexp=96,
                     n_head=4, n_head_kv=1, n_vocab=300, dtype=dtype, seed=1)
    path = write_synth_model(spec, tmp_path / "m.gguf")
    info = read_model_info(path)
    shared = 1 if arch in ("qwen2moe", "hy_v3", "deepseek2", "qwen3next", "glm4moe") else 0
    assert info.arch == {"mixtral": "llama"}.get(arch, arch)
    assert info.n_layers == 3 and info.moe_layers == (0, 1, 2)
    assert info.n_expert == 8 and info.n_expert_used == 3
    assert info.n_expert_shared == shared
    assert info.merged_gate_up == (arch == "hy_v3")
    assert info.gating == {"hy_v3": "sigmoid", "deepseek2": "sigmoid", "glm4moe": "sigmoid",
                           "gpt-oss": "softmax_weight"}.get(arch, "softmax")
    # None: not in the file (the graph fixes it)
    assert info.weights_norm is {"qwen2moe": False, "gpt-oss": None, "qwen3next": None, "grovemoe": None}.get(arch,
                                                                                                              True)
    assert info.file_type == dtype.upper()
    # one expert: gate + up (n_ff x n_embd each) and down (n_embd x n_ff), in the spec's dtype; gpt-oss adds
    # F32 biases (n_ff, n_ff, n_embd)
    qtype = gguf.GGMLQuantizationType[dtype.upper()]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    one_matrix = 64 * (64 // block) * type_size
    biases = {"gate.bias": 4 * 64, "up.bias": 4 * 64, "down.bias": 4 * 64} if arch == "gpt-oss" else {}
    assert info.bytes_per_expert == 3 * one_matrix + sum(biases.values())
    assert expected_bytes_per_expert(spec) == 3 * one_matrix
    kinds = {"gate_up.weight": 2 * one_matrix} if arch == "hy_v3" else {"gate.weight": one_matrix,
                                                                        "up.weight": one_matrix}
    assert info.bytes_per_expert_tensor == {**kinds, "down.weight": one_matrix, **biases}
    assert info.expert_bytes == 3 * 8 * (3 * one_matrix + sum(biases.values()))


def test_dense_model_is_not_moe(dense_model: Path) -> None:
    with pytest.raises(NotMoEError, match="not a Mixture-of-Experts model"):
        read_model_info(dense_model)


def test_tensor_shapes_and_types(synth_models: dict[str, Path]) -> None:
    for arch, path in synth_models.items():
        reader = gguf.GGUFReader(str(path))
        t = {x.name: x for x in reader.tensors}
        assert list(t["token_embd.weight"].shape) == [64, 512]
        # the router stays F32; expert tensors are [ne0, ne1, n_expert]
        assert t["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        if arch == "hy_v3":
            assert list(t["blk.1.ffn_gate_up_exps.weight"].shape) == [64, 64, 16]
            assert "blk.1.ffn_gate_exps.weight" not in t
        else:
            assert list(t["blk.1.ffn_gate_exps.weight"].shape) == [64, 32, 16]
        assert list(t["blk.1.ffn_down_exps.weight"].shape) == [32, 64, 16]
        assert ("blk.0.ffn_gate_inp_shexp.weight" in t) == (arch in ("qwen2moe", "qwen3next"))
        assert ("blk.0.ffn_up_shexp.weight" in t) == (arch in ("qwen2moe", "hy_v3", "deepseek2", "qwen3next",
                                                               "glm4moe"))
        assert ("blk.0.ssm_conv1d.weight" in t) == (arch == "qwen3next")  # layer 0 linear attention, 1 full
        assert ("blk.1.attn_q_norm.weight" in t) == (arch in ("qwen3moe", "hy_v3", "qwen3next", "grovemoe", "glm4moe"))
        assert ("blk.0.attn_q.bias" in t) == (arch in ("qwen2moe", "gpt-oss", "glm4moe"))
        assert ("blk.0.exp_probs_b.bias" in t) == (arch in ("deepseek2", "glm4moe"))
        assert ("blk.1.ffn_up_chexps.weight" in t) == (arch == "grovemoe")
        assert ("blk.0.ffn_up_exps.bias" in t) == (arch == "gpt-oss")
        assert ("blk.0.attn_sinks.weight" in t) == (arch == "gpt-oss")
        assert ("blk.0.attn_kv_a_mqa.weight" in t) == (arch == "deepseek2")


def test_router_is_not_degenerate(synth_models: dict[str, Path]) -> None:
    """Layer-0 routing of the raw token embeddings: many distinct top-k sets, every expert in use."""
    for arch, path in synth_models.items():
        reader = gguf.GGUFReader(str(path))
        t = {x.name: np.asarray(x.data, dtype=np.float32) for x in reader.tensors}
        x = t["token_embd.weight"]
        x = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6)
        logits = x @ t["blk.0.ffn_gate_inp.weight"].T
        top = np.argsort(-logits, axis=1)[:, :4]
        chosen = {tuple(sorted(row)) for row in top.tolist()}
        assert len(chosen) > 100, arch
        counts = np.bincount(top.ravel(), minlength=16)
        assert counts.min() > 0 and counts.max() < 0.25 * top.size, (arch, counts)


def test_tokenizer_layout() -> None:
    for n_vocab in (MIN_VOCAB, 512, 3000):
        tok = build_tokenizer(n_vocab)
        assert len(tok.tokens) == len(set(tok.tokens)) == n_vocab
        assert len(tok.merges) == n_vocab - MIN_VOCAB
        assert tok.tokens[tok.bos_id] == "<|endoftext|>" and tok.tokens[tok.eos_id] == "<|im_end|>"
        assert tok.token_types[-3:] == (3, 3, 3) and set(tok.token_types[:-3]) == {1}
        known = set(tok.tokens)
        for m in tok.merges:  # every merge joins two known tokens into a known token
            a, b = m.split(" ")
            assert a in known and b in known and a + b in known


def test_synth_text_is_deterministic() -> None:
    assert synth_text(500, seed=3) == synth_text(500, seed=3)
    assert synth_text(500, seed=3) != synth_text(500, seed=4)
    assert len(synth_text(1234)) == 1234


@pytest.mark.parametrize(("change", "message"), [
    ({"arch": "mixtral8x7b"}, "unknown arch"),
    ({"dtype": "bf16"}, "unknown dtype"),
    ({"dtype": "q4_k"}, "cannot be written: the gguf package .* has no quantizer for Q4_K"),
    ({"n_expert_used": 17}, "n_expert_used must be between 1 and n_expert=16"),
    ({"n_expert": 1, "n_expert_used": 1}, "n_expert must be >= 2"),
    ({"n_embd": 60}, "n_embd=60 must be n_head=4 times an even head size"),
    ({"n_head_kv": 3}, "multiple of n_head_kv"),
    ({"n_vocab": 100}, f"n_vocab must be >= {MIN_VOCAB}"),
    ({"dtype": "q8_0", "n_ff_exp": 48}, "n_ff_exp=48 is not a multiple of 32"),
    ({"seed": -1}, "seed must be >= 0"),
    ({"n_dense_lead": 1}, "n_dense_lead is a setting of deepseek2, glm4moe, not qwen3moe's"),
    ({"n_nextn": 1}, r"n_nextn \(MTP layers\) is a setting of glm4moe, not qwen3moe's"),
    ({"arch": "glm4moe", "n_nextn": 2}, "n_nextn must be 0 or 1"),
    ({"arch": "glm4moe", "n_dense_lead": 2}, "n_dense_lead must be between 0 and n_layer-1=1"),
    ({"fused_gate_up": True}, "fused_gate_up: qwen3moe's loader .* takes no merged ffn_gate_up_exps; one of qwen3next"),
    ({"arch": "deepseek2", "fused_gate_up": True}, "fused_gate_up: deepseek2's loader"),
    ({"arch": "qwen3next", "fused_gate_up": 1}, "fused_gate_up must be True or False"),
    ({"arch": "deepseek2", "n_dense_lead": 2}, "n_dense_lead must be between 0 and n_layer-1=1"),
])
def test_bad_specs(tmp_path: Path, change: dict[str, object], message: str) -> None:
    spec = SynthSpec(**change)  # type: ignore[arg-type]
    with pytest.raises(HarnessError, match=message) as e:
        write_synth_model(spec, tmp_path / "bad.gguf")
    assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())


def test_unwritable_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(HarnessError, match="cannot write"):
        write_synth_model(SynthSpec(), tmp_path / "file" / "m.gguf")


def test_dtypes_listed() -> None:
    assert DTYPES[:3] == ("f32", "f16", "q8_0") and "q4_k" in DTYPES
    for dtype in WRITABLE:
        check_spec(SynthSpec(dtype=dtype))


def test_cli_synth(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    assert main(["synth", "-o", str(out), "--arch", "hy_v3", "--experts", "8", "--top-k", "2",
                 "--dtype", "q8_0", "--seed", "5"]) == 0
    spec = SynthSpec(arch="hy_v3", n_expert=8, n_expert_used=2, dtype="q8_0", seed=5)
    assert out.read_bytes() == write_synth_model(spec, tmp_path / "lib.gguf").read_bytes()


def test_cli_synth_refuses_an_existing_model_without_force(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Before, `harness synth -o M` replaced an existing M silently (a model lost); now one line names --force, the
    file is untouched, and --force replaces it."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"a model the user keeps")
    assert main(["synth", "-o", str(out), "--experts", "8", "--top-k", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"harness: error: synth: {out} exists: pass --force to replace it, or another -o", err
    assert out.read_bytes() == b"a model the user keeps"
    assert main(["synth", "-o", str(out), "--experts", "8", "--top-k", "2", "--force"]) == 0
    lib = write_synth_model(SynthSpec(n_expert=8, n_expert_used=2), tmp_path / "l.gguf")
    assert out.read_bytes() == lib.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.gguf", "m.gguf"]  # no .part left


def test_cli_synth_into_a_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, `harness synth -o FOLDER` wrote FOLDER.part next to it and died in os.replace with a traceback."""
    folder = tmp_path / "models"
    folder.mkdir()
    for extra in ([], ["--force"]):
        assert main(["synth", "-o", str(folder), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"harness: error: synth: -o {folder} is a folder: name the .gguf file") and \
            "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"] and not any(folder.iterdir())


def _glm4moe(n_nextn: int, dtype: str = "f32") -> SynthSpec:
    return SynthSpec(arch="glm4moe", n_layer=3, n_dense_lead=1, n_nextn=n_nextn, n_expert=8, n_expert_used=2,
                     dtype=dtype, seed=3)


def test_glm4moe_dense_lead_and_mtp_layer(tmp_path: Path) -> None:
    """GLM-4.5(-Air) as converted: a leading dense layer, MoE layers, then one NextN/MTP layer that block_count
    counts; the MTP layer is not an MoE layer for the cache (llama.cpp loads it only for MTP decoding)."""
    mtp = write_synth_model(_glm4moe(1), tmp_path / "mtp.gguf")
    trunk = write_synth_model(_glm4moe(0), tmp_path / "trunk.gguf")
    reader = gguf.GGUFReader(str(mtp))
    t = {x.name: x for x in reader.tensors}
    assert reader.fields["glm4moe.block_count"].contents() == 4
    assert reader.fields["glm4moe.nextn_predict_layers"].contents() == 1
    assert reader.fields["glm4moe.leading_dense_block_count"].contents() == 1
    assert reader.fields["glm4moe.expert_weights_scale"].contents() == pytest.approx(2.5)
    assert reader.fields["glm4moe.rope.dimension_count"].contents() == 8  # half of the 16-wide heads
    assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_exps.weight" not in t
    assert list(t["blk.3.nextn.eh_proj.weight"].shape) == [128, 64]
    assert "blk.3.ffn_down_exps.weight" in t and "blk.3.ffn_norm.weight" not in t
    info, base = read_model_info(mtp), read_model_info(trunk)
    assert info.n_layers == 4 and info.n_nextn_layers == 1 and info.moe_layers == (1, 2)
    mtp_bytes = sum(int(x.n_bytes) for x in reader.tensors if x.name.startswith("blk.3."))
    assert info.nextn_bytes == mtp_bytes > 0
    assert (info.expert_bytes, info.non_expert_bytes) == (base.expert_bytes, base.non_expert_bytes)
    assert info.kv_bytes_per_cell == base.kv_bytes_per_cell
    assert info.file_bytes > base.file_bytes + mtp_bytes - 4096  # the MTP tensors are in the file


def test_qwen3next_fused_gate_up(tmp_path: Path) -> None:
    """qwen3next with one merged ffn_gate_up_exps per layer (gate rows, then up rows), the same bytes per expert."""
    spec = SynthSpec(arch="qwen3next", n_expert=8, n_expert_used=2, dtype="q8_0", seed=1)
    fused = write_synth_model(dataclasses.replace(spec, fused_gate_up=True), tmp_path / "fused.gguf")
    split = write_synth_model(spec, tmp_path / "split.gguf")
    t = {x.name: x for x in gguf.GGUFReader(str(fused)).tensors}
    assert list(t["blk.1.ffn_gate_up_exps.weight"].shape) == [64, 64, 8]
    assert "blk.1.ffn_gate_exps.weight" not in t and "blk.1.ffn_up_exps.weight" not in t
    a, b = read_model_info(fused), read_model_info(split)
    assert a.merged_gate_up and not b.merged_gate_up
    assert a.bytes_per_expert == b.bytes_per_expert == expected_bytes_per_expert(spec)
    assert a.bytes_per_expert_tensor["gate_up.weight"] == 2 * b.bytes_per_expert_tensor["gate.weight"]
    out = tmp_path / "cli.gguf"
    assert main(["synth", "-o", str(out), "--arch", "qwen3next", "--experts", "8", "--top-k", "2", "--dtype", "q8_0",
                 "--seed", "1", "--fused-gate-up"]) == 0
    assert out.read_bytes() == fused.read_bytes()


def test_cli_synth_glm4moe(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    assert main(["synth", "-o", str(out), "--arch", "glm4moe", "--layers", "3", "--dense-lead", "1", "--nextn", "1",
                 "--experts", "8", "--top-k", "2", "--seed", "3"]) == 0
    assert out.read_bytes() == write_synth_model(_glm4moe(1), tmp_path / "lib.gguf").read_bytes()


@pytest.mark.build
def test_stock_skips_the_mtp_layer(stock_build: Build, synth_text_file: Path, tmp_path: Path) -> None:
    """Stock llama-perplexity loads the file with its MTP layer and gives the trunk-only file's perplexity."""
    mtp = write_synth_model(_glm4moe(1, "q8_0"), tmp_path / "mtp.gguf")
    trunk = write_synth_model(_glm4moe(0, "q8_0"), tmp_path / "trunk.gguf")
    a = _perplexity(stock_build, mtp, synth_text_file, "--no-repack")
    b = _perplexity(stock_build, trunk, synth_text_file, "--no-repack")
    assert math.isfinite(a) and a > 1.0 and a == b


# ---------------------------------------------------------------------------------------------------
# build smoke: the stock binaries load and run every generated architecture

_TRIES = 12
_PPL = re.compile(r"Final estimate: PPL = (\S+) \+/- (\S+)")


def _perplexity(build: Build, model: Path, text: Path, *extra: str) -> float:
    cmd = [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "128", "-b", "128",
           "-t", "2", "--chunks", "4", *extra]
    out = ""
    # llama.cpp's asynchronous logger can drop the last lines at exit (ggml-org/llama.cpp#22142): about one
    # run in four or five of the pinned llama-perplexity exits 0 without "Final estimate". Run it again then.
    for _ in range(_TRIES):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        m = _PPL.search(out)
        if m:
            return float(m.group(1))
    raise AssertionError(f"no 'Final estimate' in {_TRIES} runs of {' '.join(cmd)}:\n{out[-3000:]}")


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
def test_stock_perplexity_runs(stock_build: Build, synth_models: dict[str, Path], synth_text_file: Path,
                               arch: str) -> None:
    ppl = _perplexity(stock_build, synth_models[arch], synth_text_file)
    assert math.isfinite(ppl) and ppl > 1.0


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
def test_patched_perplexity_runs(patched_build: Build, synth_models: dict[str, Path], synth_text_file: Path,
                                 arch: str) -> None:
    ppl = _perplexity(patched_build, synth_models[arch], synth_text_file)
    assert math.isfinite(ppl) and ppl > 1.0


@pytest.mark.build
@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_stock_perplexity_quantized(stock_build: Build, synth_text_file: Path, tmp_path: Path, arch: str,
                                    dtype: str) -> None:
    model = write_synth_model(SynthSpec(arch=arch, dtype=dtype), tmp_path / f"{arch}-{dtype}.gguf")
    # --no-repack: keep the quantized weights out of the CPU's extra buffer types; on this machine the
    # AMX one (built by -march=native) dies with SIGILL in tinygemm_kernel_amx<block_q8_0>.
    ppl = _perplexity(stock_build, model, synth_text_file, "--no-repack")
    assert math.isfinite(ppl) and ppl > 1.0


@pytest.mark.build
def test_stock_perplexity_runs_dense(stock_build: Build, dense_model: Path, synth_text_file: Path) -> None:
    ppl = _perplexity(stock_build, dense_model, synth_text_file)
    assert math.isfinite(ppl) and ppl > 1.0


@pytest.mark.build
def test_stock_cli_prompts(stock_build: Build, synth_models: dict[str, Path]) -> None:
    """llama-cli applies the ChatML template, tokenizes the prompt and generates, single turn."""
    cmd = [str(stock_build.tool("llama-cli")), "-m", str(synth_models["qwen3moe"]), "-p", "Tell me about experts.",
           "-n", "8", "-st", "-t", "2", "--temp", "0"]
    out = ""
    for _ in range(_TRIES):  # the same dropped-last-lines race as llama-perplexity
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        if "Generation:" in out:
            return
    raise AssertionError(f"llama-cli printed no generation stats:\n{out[-3000:]}")


@pytest.mark.parametrize("dtype", ["q4_0", "q8_0"])
def test_direct_blocks(tmp_path: Path, dtype: str) -> None:
    """direct=True (bench_tiers --full-scale's models of tens of GB) draws Q4_0/Q8_0 blocks instead of quantizing
    normals: the same file layout and sizes, the unquantized tensors (router, norms) byte-identical to the normal
    path's, the expert tensors other bytes whose dequantized values have the tensor's standard deviation, the same
    bytes for the same seed."""
    spec = SynthSpec(arch="qwen3moe", n_layer=2, n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=64, dtype=dtype,
                     seed=4)
    normal = gguf.GGUFReader(write_synth_model(spec, tmp_path / "normal.gguf"))
    path = write_synth_model(spec, tmp_path / "direct.gguf", direct=True)
    assert write_synth_model(spec, tmp_path / "again.gguf", direct=True).read_bytes() == path.read_bytes()
    direct = gguf.GGUFReader(path)
    by_name = {t.name: t for t in normal.tensors}
    assert [t.name for t in direct.tensors] == list(by_name)
    experts = 0
    for t in direct.tensors:
        n = by_name[t.name]
        assert (t.tensor_type, t.data.nbytes, int(t.data_offset)) == (n.tensor_type, n.data.nbytes, int(n.data_offset))
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            assert np.array_equal(t.data, n.data), t.name
            continue
        assert not np.array_equal(t.data, n.data), t.name
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        want = 1.0 / math.sqrt(values.shape[-1])
        assert np.isfinite(values).all() and abs(float(values.std()) / want - 1) < 0.02, (t.name, values.std(), want)
        experts += "exps" in t.name
    assert experts == 3 * spec.n_layer


def test_direct_blocks_refused_for_other_types(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="direct blocks are drawn for q4_0 and q8_0, not f16"):
        write_synth_model(SynthSpec(dtype="f16"), tmp_path / "m.gguf", direct=True)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.build
def test_direct_blocks_run_as_stock_runs_them(tmp_path: Path, stock_build: Build, patched_build: Build) -> None:
    """The drawn blocks are a model llama.cpp runs: a finite perplexity, the engine's fetch-all the same as stock."""
    spec = SynthSpec(arch="qwen3moe", n_layer=2, n_expert=16, n_expert_used=4, n_embd=256, n_ff_exp=64,
                     dtype="q4_0", seed=4)
    model = write_synth_model(spec, tmp_path / "direct.gguf", direct=True)
    text = tmp_path / "t.txt"
    text.write_text(synth_text(4000))
    finals = []
    for build, env in ((stock_build, {}), (patched_build, {"LLAMA_MOE_CACHE": "mode=engine,policy=fetch-all,slots=4"})):
        r = subprocess.run([str(build.bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "64",
                            "--chunks", "4", "-t", "2", "--no-repack"], capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=120)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stderr)
        assert r.returncode == 0 and m, r.stderr[-2000:]
        finals.append(float(m.group(1)))
    assert math.isfinite(finals[0]) and finals[0] == finals[1]
