"""scripts/train_moe.py: a run stopped and resumed ends exactly where an uninterrupted run ends (model, optimiser,
sampler and torch random states are checkpointed), and a resume with another shape is refused in one line.

Needs torch (the `train` extra: .venv/bin/pip install -e '.[train]'); skipped without it."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import train_moe as tm  # noqa: E402


def _cfg(**kw: object) -> tm.Config:
    base = {"name": "t", "vocab_size": 8192, "d_model": 32, "n_layer": 1, "n_head": 2, "n_kv_head": 1, "head_dim": 16,
            "n_expert": 8, "top_k": 2, "d_expert": 8, "n_ctx": 32, "batch_seqs": 2, "warmup": 2, "eval_every": 3,
            "threads": 1, "decay_start": 4, "steps": 6}
    return tm.Config(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "models/tinymoe-tokenizer.json", tmp_path / "tokenizer.json")
    np.save(tmp_path / "train_tokens.npy", np.random.default_rng(0).integers(0, 8192, 4000).astype(np.uint16))
    return tmp_path


def test_stop_and_resume_equals_one_run(work: Path, tmp_path: Path) -> None:
    one = tmp_path / "one"
    shutil.copytree(work, one, ignore=shutil.ignore_patterns("one"))
    assert tm.train(_cfg(), one, one / "m.gguf", None)
    ref = torch.load(one / "m.pt", weights_only=False)

    two = tmp_path / "two"
    shutil.copytree(work, two, ignore=shutil.ignore_patterns("one", "two"))
    assert not tm.train(_cfg(), two, two / "m.gguf", None, stop_after_steps=3)  # stopped: a checkpoint
    assert (two / "ckpt.pt").exists() and not (two / "m.pt").exists()
    assert tm.train(_cfg(), two, two / "m.gguf", None, resume=True)
    got = torch.load(two / "m.pt", weights_only=False)
    assert got["tokens_seen"] == ref["tokens_seen"] == 6 * 2 * 32
    for k, v in ref["state_dict"].items():
        assert torch.equal(v, got["state_dict"][k]), k
    # the log holds each step once, in order; the end of the constant phase was kept
    steps = [json.loads(ln)["step"] for ln in (two / "m.trainlog.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (two / "ckpt-stable-4.pt").exists()


def test_resume_refuses_another_shape(work: Path) -> None:
    assert not tm.train(_cfg(), work, work / "m.gguf", None, stop_after_steps=1)
    with pytest.raises(SystemExit, match="the checkpoint has n_expert=8, this run 16"):
        tm.train(_cfg(n_expert=16), work, work / "m.gguf", None, resume=True)


def test_resume_without_a_checkpoint_is_one_line(work: Path) -> None:
    with pytest.raises(SystemExit, match="no checkpoint at"):
        tm.train(_cfg(), work, work / "m.gguf", None, resume=True)


def _trained_and_exported(work: Path, tmp_path: Path) -> tuple[tm.Config, object, Path]:
    """A 6-step run of the tiny shape, exported as an all-F32 GGUF: (config, model, GGUF)."""
    pytest.importorskip("gguf")
    cfg = _cfg()
    assert tm.train(cfg, work, work / "m.gguf", None)
    _, model, ck = tm.load_trained(work / "m.gguf")
    gg = tmp_path / "m-f32.gguf"
    tm.export(cfg, model, work, gg, ck["tokens_seen"], f32=True)
    return cfg, model, gg


def test_init_gguf_goes_on_from_an_exported_model(work: Path, tmp_path: Path) -> None:
    """A run from an exported GGUF (--init-gguf: a later session going on from the committed model) starts from its
    weights, step and tokens, keeps its log, and counts its warmup from that step."""
    cfg, model, gg = _trained_and_exported(work, tmp_path)

    fresh = tm.build_model(_cfg(seed=99))
    step, tokens = tm.load_gguf_weights(_cfg(), fresh, gg)
    assert (step, tokens) == (6, 6 * 2 * 32)
    for k, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k

    on = tmp_path / "on"
    on.mkdir()
    shutil.copy(work / "tokenizer.json", on)
    shutil.copy(work / "train_tokens.npy", on)
    cont = _cfg(steps=9, decay_start=8)
    assert tm.train(cont, on, on / "m.gguf", None, resume=True, init_gguf=gg, init_log=work / "m.trainlog.jsonl")
    assert (cont.init_step, cont.init_from) == (6, str(gg))
    log = [json.loads(ln) for ln in (on / "m.trainlog.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 10))
    assert log[6]["lr"] == pytest.approx(cont.lr / cont.warmup)  # the first step after the GGUF's: warmup again
    assert torch.load(on / "m.pt", weights_only=False)["tokens_seen"] == 9 * 2 * 32


def test_init_gguf_refuses_another_shape_in_one_line(work: Path, tmp_path: Path) -> None:
    cfg, model, gg = _trained_and_exported(work, tmp_path)
    with pytest.raises(SystemExit, match="qwen3moe.expert_count is 8, this shape has 16"):
        tm.load_gguf_weights(_cfg(n_expert=16), tm.build_model(_cfg(n_expert=16)), gg)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(SystemExit, match="not a readable GGUF"):
        tm.load_gguf_weights(cfg, tm.build_model(cfg), bad)


def test_ditto_loss_pushes_a_repetition_toward_lambda_times_the_last() -> None:
    """DITTO's penalty is 0 where p(token in repetition n) = lambda x p(same token in repetition n-1), grows as the
    model reinforces the repetition, and its gradient reaches only repetition n (the earlier one is a target)."""
    V, S, period, lam = 5, 9, 2, 0.5
    y = torch.tensor([[1, 2] * 4 + [1]])

    def logits_for(p_of_target: list[float]) -> torch.Tensor:  # the target token gets p, the rest share 1 - p
        lg = torch.full((1, S, V), 0.0)
        for j, p in enumerate(p_of_target):
            rest = (1 - p) / (V - 1)
            lg[0, j] = torch.log(torch.full((V,), rest))
            lg[0, j, y[0, j]] = math.log(p)
        return lg

    halving = [0.8, 0.8, 0.8, 0.4, 0.4, 0.2, 0.2, 0.1, 0.1]  # every repetition half the one before
    assert tm.ditto_loss(logits_for(halving), y, [period], lam).item() == pytest.approx(0.0, abs=1e-5)
    growing = [0.5, 0.5, 0.6, 0.6, 0.7, 0.7, 0.8, 0.8, 0.9]  # self-reinforcing
    lg = logits_for(growing).requires_grad_(True)
    loss = tm.ditto_loss(lg, y, [period], lam)
    assert loss.item() > 0.3
    loss.backward()
    assert lg.grad is not None
    assert torch.all(lg.grad[0, : period + 1] == 0)  # the first repetition's targets are never pushed
    assert torch.any(lg.grad[0, period + 1:] != 0)


def test_ditto_rows_train_and_log(work: Path) -> None:
    cfg = _cfg(batch_seqs=4, ditto_frac=0.5, ditto_max=4)
    assert tm.train(cfg, work, work / "m.gguf", None)
    log = [json.loads(ln) for ln in (work / "m.trainlog.jsonl").read_text().splitlines()]
    assert len(log) == 6 and all(r["ditto"] >= 0 for r in log)


def test_train_without_a_token_stream_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="run the tokenizer stage first"):
        tm.train(_cfg(), tmp_path, tmp_path / "m.gguf", None)
