"""scripts/train_moe.py: a run stopped and resumed ends exactly where an uninterrupted run ends (model, optimiser,
sampler and torch random states are checkpointed), and a resume with another shape is refused in one line.

Needs torch (the `train` extra: .venv/bin/pip install -e '.[train]'); skipped without it."""

from __future__ import annotations

import json
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
