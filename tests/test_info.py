"""`harness info`: numbers from GGUF metadata, and one-line errors for bad input."""

import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from harness.cli import main
from harness.core.errors import HarnessError, NotMoEError
from harness.parsers.gguf_model import read_model_info


def _write(path: Path, n_expert: int, n_layer: int = 2, n_embd: int = 32, n_ff: int = 16, k: int = 2,
           nextn: int = 0, expert_count: int | None = None, k_per_layer: list[int] | None = None) -> Path:
    """A qwen3moe GGUF with `n_expert` experts per layer (0: dense), `k` used per token (`k_per_layer`: an array
    instead); `expert_count`: the metadata's expert count when it is not n_expert (a damaged file)."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(n_layer)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_embedding_length(n_embd)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((100, n_embd), dtype=np.float32))
    for il in range(n_layer):
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if n_expert:
            w.add_expert_count(n_expert if expert_count is None else expert_count) if il == 0 else None
            if il == 0:
                w.add_array("qwen3moe.expert_used_count", k_per_layer) if k_per_layer else w.add_expert_used_count(k)
            w.add_tensor(f"blk.{il}.ffn_gate_inp.weight", rng.standard_normal((n_expert, n_embd), dtype=np.float32))
            for kind, shape in (("gate", (n_expert, n_ff, n_embd)), ("up", (n_expert, n_ff, n_embd)),
                                ("down", (n_expert, n_embd, n_ff))):
                w.add_tensor(f"blk.{il}.ffn_{kind}_exps.weight", rng.standard_normal(shape, dtype=np.float32))
        else:
            w.add_tensor(f"blk.{il}.ffn_up.weight", rng.standard_normal((n_ff, n_embd), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_expert_numbers(tmp_path: Path) -> None:
    info = read_model_info(_write(tmp_path / "m.gguf", n_expert=8, n_layer=3, n_embd=32, n_ff=16, k=2))
    assert info.arch == "qwen3moe"
    assert info.n_layers == 3 and info.moe_layers == (0, 1, 2)
    assert info.n_expert == 8 and info.n_expert_used == 2 and info.n_expert_shared == 0
    assert not info.merged_gate_up
    assert info.bytes_per_expert == 3 * 32 * 16 * 4
    assert info.bytes_per_expert_tensor == {"gate.weight": 2048, "up.weight": 2048, "down.weight": 2048}
    assert info.expert_bytes == 3 * 8 * 3 * 32 * 16 * 4
    assert info.non_expert_bytes == 100 * 32 * 4 + 3 * (32 * 4 + 8 * 32 * 4)


def test_nextn_layers(tmp_path: Path) -> None:
    """The last nextn_predict_layers layers are MTP layers: not MoE layers, in no byte count but nextn_bytes."""
    base = read_model_info(_write(tmp_path / "base.gguf", n_expert=8, n_layer=2))
    info = read_model_info(_write(tmp_path / "mtp.gguf", n_expert=8, n_layer=3, nextn=1))
    assert info.n_layers == 3 and info.n_nextn_layers == 1 and info.moe_layers == (0, 1)
    assert (info.expert_bytes, info.non_expert_bytes) == (base.expert_bytes, base.non_expert_bytes)
    assert info.nextn_bytes == 32 * 4 + 8 * 32 * 4 + 3 * 8 * 16 * 32 * 4  # attn_norm, router, 3 expert tensors
    with pytest.raises(HarnessError, match=r"nextn_predict_layers=2 is not below block_count=2") as e:
        read_model_info(_write(tmp_path / "bad.gguf", n_expert=8, n_layer=2, nextn=2))
    assert "\n" not in str(e.value)


def test_not_moe(tmp_path: Path) -> None:
    with pytest.raises(NotMoEError, match="not a Mixture-of-Experts model"):
        read_model_info(_write(tmp_path / "d.gguf", n_expert=0))


def test_truncated(tmp_path: Path) -> None:
    good = _write(tmp_path / "m.gguf", n_expert=8)
    data = good.read_bytes()
    for cut in (len(data) // 2, 40, len(data) - 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(HarnessError, match="truncated|damaged"):
            read_model_info(bad)


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_text("hello world")
    with pytest.raises(HarnessError, match="not a GGUF file"):
        read_model_info(p)
    with pytest.raises(HarnessError, match="no such file"):
        read_model_info(tmp_path / "missing.gguf")


def test_expert_counts_that_llama_cpp_aborts_on(tmp_path: Path) -> None:
    """Before, a GGUF using more experts per token than a layer has was read as a model (harness info printed it),
    and one with an expert count of 0 but routed experts was "not a Mixture-of-Experts model: run it with stock
    llama.cpp", which aborts on both: now each is one line saying what is wrong."""
    over = _write(tmp_path / "over.gguf", n_expert=8, k=9)
    with pytest.raises(HarnessError) as e:
        read_model_info(over)
    assert str(e.value).startswith(f"{over}: qwen3moe.expert_used_count=9 is more than qwen3moe.expert_count=8 ")
    zero = _write(tmp_path / "zero.gguf", n_expert=8, expert_count=0)
    with pytest.raises(HarnessError) as e:
        read_model_info(zero)
    assert not isinstance(e.value, NotMoEError)
    assert str(e.value).startswith(f"{zero}: qwen3moe.expert_count is 0 or missing, yet the file has routed"
                                   " expert tensors")
    # no expert tensors, but the count of experts used: a MoE file whose experts are gone
    w = gguf.GGUFWriter(str(tmp_path / "used.gguf"), "qwen3moe")
    w.add_block_count(1)
    w.add_expert_count(0)
    w.add_expert_used_count(4)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(HarnessError, match=r"expert_count is 0 or missing, yet the file has qwen3moe\.expert_used_co"):
        read_model_info(tmp_path / "used.gguf")
    assert read_model_info(_write(tmp_path / "k8.gguf", n_expert=8, k=8)).n_expert_used == 8  # all of them: fine


def test_experts_used_per_layer(tmp_path: Path) -> None:
    """An experts-used count per layer (an array: llama.cpp validates its largest) is read as its largest; before,
    int() of the list was a traceback."""
    assert read_model_info(_write(tmp_path / "m.gguf", n_expert=8, k_per_layer=[2, 3])).n_expert_used == 3
    with pytest.raises(HarnessError, match=r"expert_used_count=9 is more than qwen3moe\.expert_count=8"):
        read_model_info(_write(tmp_path / "o.gguf", n_expert=8, k_per_layer=[2, 9]))


@pytest.mark.parametrize("case", ["dense", "truncated", "small-budget", "text", "used-above-experts", "zero-experts"])
def test_cli_errors_are_one_line(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    model = _write(tmp_path / "m.gguf", n_expert=8)
    argv = [str(model)]
    if case == "dense":
        argv = [str(_write(tmp_path / "d.gguf", n_expert=0))]
    elif case == "truncated":
        (tmp_path / "t.gguf").write_bytes(model.read_bytes()[:300])
        argv = [str(tmp_path / "t.gguf")]
    elif case == "small-budget":
        argv += ["--vram", "1K"]
    elif case == "used-above-experts":
        argv = [str(_write(tmp_path / "o.gguf", n_expert=8, k=9))]
    elif case == "zero-experts":
        argv = [str(_write(tmp_path / "z.gguf", n_expert=8, expert_count=0))]
    else:
        (tmp_path / "a.txt").write_text("text")
        argv = [str(tmp_path / "a.txt")]
    rc = main(["info", *argv])
    out = capsys.readouterr()
    assert rc == 2
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("harness: error:"), out.err
    assert "Traceback" not in out.err + out.out


def test_cli_info_with_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _write(tmp_path / "m.gguf", n_expert=8)
    assert main(["info", str(model), "--vram", "50%"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"4 expert slots per\s+layer", out)
    assert main(["info", str(model), "--vram", "1G"]) == 0
    assert re.search(r"nothing is\s+offloaded", capsys.readouterr().out)


def test_cli_info_names_the_mtp_layer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GLM-4.5's NextN/MTP layer: in block_count, not an MoE layer for the cache, said so."""
    from harness.tools.synth import SynthSpec, write_synth_model

    model = write_synth_model(SynthSpec(arch="glm4moe", n_layer=3, n_dense_lead=1, n_nextn=1, n_expert=8,
                                        n_expert_used=2), tmp_path / "glm.gguf")
    assert main(["info", str(model)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "4, of which MoE: 2; the last 1 NextN/MTP" in out


class _EioFile:
    """A file object whose reads fail as a failing disk's do (EIO)."""

    def __enter__(self) -> "_EioFile":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def read(self, n: int = -1) -> bytes:
        import errno

        raise OSError(errno.EIO, "Input/output error")


def test_an_io_error_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `harness info` on a file whose read fails (EIO) died with OSError. Now: one line naming the model and
    the error, both where the magic is read and inside the GGUF reader (numpy's memmap)."""
    import errno

    model = _write(tmp_path / "m.gguf", n_expert=8)
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: _EioFile() if self == model else real_open(self, *a, **k))
    with pytest.raises(HarnessError) as e:
        read_model_info(model)
    assert str(e.value) == f"cannot read the model {model}: Input/output error"
    assert main(["info", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"harness: error: cannot read the model {model}: Input/output error"
    monkeypatch.setattr(Path, "open", real_open)

    def eio_reader(path: str, *a: object, **k: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(gguf, "GGUFReader", eio_reader)
    with pytest.raises(HarnessError) as e:
        read_model_info(model)
    assert str(e.value) == f"cannot read the model {model}: Input/output error"  # not "damaged or truncated"
