"""harness.orchestration.topics: boundary placement and window deltas by hand, and the run with a fake runner and a
small trained tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_compare import FakeEnv, FakeRunner, _info

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.domain.options import TopicOptions
from harness.orchestration.topics import (
    align,
    boundary_tokens,
    run_topic_shift,
    scored_positions,
    segment_starts,
    topic_rows,
    window_mask,
)
from harness.parsers import PerplexityResult
from harness.parsers.nll_dump import NllDump
from harness.tools.requests import PerplexityRequest, PerplexityRun, RunOutput


def _dump(n_ctx: int, n_chunk: int, tokens: np.ndarray, nll: np.ndarray) -> NllDump:
    return NllDump(n_ctx, n_ctx // 2, n_chunk, tokens.astype(np.int32), nll.astype(np.float64))


def test_boundaries_and_positions_by_hand() -> None:
    assert segment_starts({"segments": [{"char_start": 0}, {"char_start": 600}, {"char_start": 300}]}) == [300, 600]
    with pytest.raises(HarnessError, match="damaged"):
        segment_starts({"segs": []})
    assert boundary_tokens([0, 3, 5, 9, 12], [5, 10, 99]) == [2, 4, 5]
    d = _dump(8, 2, np.zeros(6), np.zeros(6))  # first = 4: scored predicted tokens 5, 6, 7 of each chunk
    assert scored_positions(d).tolist() == [5, 6, 7, 13, 14, 15]
    assert window_mask(scored_positions(d), [6, 14], 2).tolist() == [False, True, True, False, True, True]


def test_align_finds_the_bos_shift() -> None:
    ids = [(7 * i) % 101 for i in range(40)]
    pos = [5, 6, 7, 13, 14, 15]
    assert align(_dump(8, 2, np.array([ids[p] for p in pos]), np.zeros(6)), ids) == 0
    assert align(_dump(8, 2, np.array([ids[p - 1] for p in pos]), np.zeros(6)), ids) == 1
    with pytest.raises(HarnessError, match="does not reproduce"):
        align(_dump(8, 2, np.array([1, 2, 3, 4, 5, 6]), np.zeros(6)), ids)


def test_admission_effect_only_after_changes() -> None:
    n_ctx, n_chunk = 8, 4
    d = _dump(n_ctx, n_chunk, np.zeros(12), np.zeros(12))
    mask = window_mask(scored_positions(d), [13, 29], 3)  # 3 + 3 tokens after the changes
    base = np.random.default_rng(0).uniform(1, 3, 12)
    full = _dump(n_ctx, n_chunk, np.zeros(12), base)
    off = _dump(n_ctx, n_chunk, np.zeros(12), base + np.where(mask, 0.1, 0.01))
    on = _dump(n_ctx, n_chunk, np.zeros(12), base + np.where(mask, 0.02, 0.01))
    rows = topic_rows(full, on, off, mask, "quality", n_boot=200)
    effect = rows[2]
    assert effect.after_change is not None and effect.elsewhere is not None
    assert effect.after_change.delta_pct == pytest.approx(100 * math.expm1(-0.08))
    assert effect.elsewhere.delta_pct == pytest.approx(0.0, abs=1e-12)
    assert rows[1].overall.delta_pct == pytest.approx(100 * math.expm1((6 * 0.1 + 6 * 0.01) / 12))


def test_run_topic_shift_with_a_fake_runner(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "tau", "rho"]
    rng = np.random.default_rng(1)
    parts = [" ".join(rng.choice(words[:4] if i % 2 == 0 else words[4:], 300)) + "\n" for i in range(4)]
    text = "".join(parts)
    (tmp_path / "topic.txt").write_text(text)
    starts, pos = [], 0
    for part in parts:
        starts.append(pos)
        pos += len(part)
    (tmp_path / "topic.json").write_text(json.dumps({"segments": [{"char_start": s} for s in starts]}))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words + ["\n"])},
                                                           unk_token="\n"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    ids = tok.encode(text).ids

    class TopicFake(FakeRunner):
        def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
            self.calls.append(req.label)
            n_chunk = len(ids) // req.n_ctx
            per = req.n_ctx - req.n_ctx // 2 - 1
            pos = (np.repeat(np.arange(n_chunk), per) * req.n_ctx + req.n_ctx // 2 + 1
                   + np.tile(np.arange(per), n_chunk))
            toks = np.array(ids)[pos]
            nll = np.full(pos.size, 2.0) + (0.05 if req.label == "admit-off" else 0.0)
            assert req.nll_dump is not None
            self.dumps[req.nll_dump] = _dump(req.n_ctx, n_chunk, toks, nll)
            result = PerplexityResult(math.e ** 2, 0.1, n_chunk, req.n_ctx, req.n_ctx, 1, (1.0,) * n_chunk)
            return PerplexityRun(result, None, RunOutput(("t",), {}, 0, "", "", 0.1))

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    opts = TopicOptions(out=tmp_path / "out", model=model, text=tmp_path / "topic.txt",
                        tokenizer=tmp_path / "tokenizer.json", n_ctx=64, window=16)
    runner = TopicFake()
    res = run_topic_shift(opts, runner, _info(), env=FakeEnv(tmp_path), root=tmp_path)
    assert runner.calls == ["full", "admit-on", "admit-off"]
    assert res.n_boundaries == 3 and 0 < res.n_after_change < res.n_scored
    effect = res.rows[2].overall
    assert effect.delta_pct == pytest.approx(100 * math.expm1(-0.05))
    with pytest.raises(HarnessError, match="no admission to switch off"):
        run_topic_shift(TopicOptions(**{**opts.__dict__, "policy": "rule-0.15"}), TopicFake(), _info(),
                        env=FakeEnv(tmp_path), root=tmp_path)


def test_topics_markdown() -> None:
    from harness.domain.results import TopicResult
    from harness.report.markdown import render_topics_markdown

    d = _dump(8, 4, np.zeros(12), np.zeros(12))
    mask = window_mask(scored_positions(d), [13], 3)
    base = np.linspace(1, 2, 12)
    rows = topic_rows(_dump(8, 4, np.zeros(12), base), _dump(8, 4, np.zeros(12), base),
                      _dump(8, 4, np.zeros(12), base + 0.1), mask, "speed", n_boot=50)
    md = render_topics_markdown(TopicResult(TopicOptions(out=Path("o"), policy="speed", window=3), 1, 12,
                                            int(mask.sum()), rows, Path("o/results.jsonl"), ()))
    assert "| admission effect (admit on vs off) | -9.52% [-9.52, -9.52] |" in md
    assert "the first 3 tokens of each new segment (3 scored tokens)" in md
