"""The shadow estimate (`shadow=N`, issue 37; docs/expert-cache.md "The shadow estimate"), end to end with the built
llama-perplexity on generated models:
- the run is unchanged: with shadow=1 the NLL of every scored token and every cache counter equal the run's without
  it (the exact pass counts nothing and the served pass runs last);
- fetch-all's estimate is exactly zero (its served pass is the exact one), and every ubatch is a sample;
- a policy that substitutes has a positive KL and a positive NLL difference, and at one-token ubatches (decode's
  shape) the estimate's sign and size follow the measured delta-PPL;
- on a hybrid model (qwen3next) the recurrent state the exact pass advances is restored: the served run unchanged;
- refusals in one line: engine mode.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_expert_cache import N_CHUNKS, check_ok, run_ppl

from harness.core.project import Build
from harness.parsers.cache_stats import parse_cache_stats
from harness.tools.synth import SynthSpec, synth_text, write_synth_model

N_EXPERT, K = 64, 8
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shadow-model")
    return write_synth_model(SynthSpec(arch="qwen3moe", n_expert=N_EXPERT, n_expert_used=K, n_layer=2, seed=3),
                             out / "qwen3moe.gguf")


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shadow-text") / "text.txt"
    path.write_text(synth_text(20000, seed=1))
    return path


def shadow_of(stats: dict) -> dict:  # type: ignore[type-arg]
    s = parse_cache_stats(json.dumps(stats)).shadow
    assert s is not None, "no shadow object in the stats"
    return s.__dict__


def test_shadow_leaves_the_run_unchanged(patched_build: Build, moe: Path, text: Path, tmp_path: Path) -> None:
    spec = "mode=emulate,policy=speed,slots=16"
    plain = run_ppl(patched_build, moe, text, tmp_path / "plain", spec, nll=True)
    shadowed = run_ppl(patched_build, moe, text, tmp_path / "shadow", spec + ",shadow=1", nll=True,
                       want="expert cache shadow estimate", extra=("-lv", "4"))
    check_ok(plain)
    check_ok(shadowed)
    assert plain.nll is not None and shadowed.nll is not None
    assert np.array_equal(plain.nll, shadowed.nll), "the shadow estimate changed the served run"
    assert plain.stats is not None and shadowed.stats is not None
    assert shadowed.stats["total"]["substitutions"] > 0, "the policy substituted nothing: the test tests nothing"
    for key in ("calls", "hits", "misses", "fetches", "substitutions", "admissions", "evictions", "token_layers"):
        assert plain.stats["total"][key] == shadowed.stats["total"][key], key
    assert "shadow" not in plain.stats
    sh = shadow_of(shadowed.stats)
    assert sh["every"] == 1 and sh["ubatches"] == N_CHUNKS
    assert sh["kl"] > 0 and sh["kl_low"] <= sh["kl"] <= sh["kl_high"]
    assert sh["dppl_pct_low"] <= sh["dppl_pct"] <= sh["dppl_pct_high"]
    assert math.isclose(sh["dppl_pct"], 100 * math.expm1(sh["dnll"]), rel_tol=1e-6, abs_tol=1e-9)
    assert "expert cache shadow estimate: delta-PPL" in shadowed.output


def test_shadow_of_fetch_all_is_zero(patched_build: Build, moe: Path, text: Path, tmp_path: Path) -> None:
    r = run_ppl(patched_build, moe, text, tmp_path, "mode=emulate,policy=fetch-all,slots=16,shadow=2")
    check_ok(r)
    assert r.stats is not None
    sh = shadow_of(r.stats)
    assert sh["ubatches"] == N_CHUNKS // 2  # every second ubatch
    assert sh["rows"] > 0 and sh["pairs"] > 0
    assert sh["kl"] == 0.0 and sh["dnll"] == 0.0 and sh["dppl_pct"] == 0.0


def test_shadow_follows_the_loss_at_one_token_ubatches(patched_build: Build, tmp_path: Path) -> None:
    """At one-token ubatches the exact pass attends to the served history (decode's situation). On the trained
    tinymoe (64 experts, top-8; a random-weight model's loss has no sign), substitute-all at 8 slots loses far more
    than quality at 32: the estimate orders them as the measurement does, and is positive where it is."""
    model = ROOT / "models" / "tinymoe-f16.gguf"
    text = ROOT / "eval" / "data" / "heldout.txt"
    if not model.exists() or not text.exists():
        pytest.skip("the committed tinymoe model or the held-out text is missing")
    full = run_ppl(patched_build, model, text, tmp_path / "full", None, nll=True, extra=("-ub", "1"))
    check_ok(full)
    got = {}
    for name, spec in (("heavy", "mode=emulate,rule=substitute-all,slots=8"),
                       ("light", "mode=emulate,policy=quality,slots=32")):
        r = run_ppl(patched_build, model, text, tmp_path / name, spec + ",shadow=4", nll=True, extra=("-ub", "1"))
        check_ok(r)
        assert r.nll is not None and full.nll is not None and r.stats is not None
        measured = 100 * math.expm1(float(np.mean(r.nll - full.nll)))
        sh = shadow_of(r.stats)
        # one-token ubatches: each shadowed one has its output row (perplexity asks none in a chunk's first half,
        # which do not count), and the next token comes with the next ubatch (but at a chunk's end)
        assert sh["rows"] == sh["ubatches"] > 60 and sh["pairs"] >= sh["rows"] - N_CHUNKS, sh
        got[name] = (measured, sh["dppl_pct"])
    (m_heavy, e_heavy), (m_light, e_light) = got["heavy"], got["light"]
    assert m_heavy > m_light > -0.5 and e_heavy > e_light, got
    assert e_heavy > 0 and m_heavy > 5, got


def test_shadow_refusals(patched_build: Build, moe: Path, text: Path, tmp_path: Path) -> None:
    r = run_ppl(patched_build, moe, text, tmp_path / "engine", "mode=engine,policy=quality,slots=16,shadow=4",
                stats=False, want="shadow=")
    assert r.returncode != 0
    assert "shadow= computes a ubatch exactly with the full expert tensors, which mode=engine's banks replace" \
        in r.output
    assert "Traceback" not in r.output


def test_shadow_on_a_hybrid_model_restores_the_recurrent_state(patched_build: Build, text: Path,
                                                                tmp_path: Path) -> None:
    """qwen3next (the study's architecture: linear-attention layers with a recurrent state beside attention): the
    exact pass advances the recurrent state in place, and the cache restores it before the served pass. Without the
    restore the served pass would start from a state advanced twice: the NLLs would differ from the run's without
    the estimate, and fetch-all's estimate would not be 0."""
    hybrid = write_synth_model(SynthSpec(arch="qwen3next", seed=3), tmp_path / "qwen3next.gguf")
    for name, extra in (("ubatch", ()), ("decode", ("-ub", "1"))):
        spec = "mode=emulate,policy=speed,slots=25%"
        plain = run_ppl(patched_build, hybrid, text, tmp_path / f"{name}-plain", spec, nll=True, extra=extra)
        shadowed = run_ppl(patched_build, hybrid, text, tmp_path / f"{name}-shadow", spec + ",shadow=1", nll=True,
                           extra=extra)
        check_ok(plain)
        check_ok(shadowed)
        assert plain.nll is not None and shadowed.nll is not None
        assert np.array_equal(plain.nll, shadowed.nll), f"{name}: the exact pass changed the served run"
        assert shadowed.stats is not None and shadow_of(shadowed.stats)["ubatches"] > 0
        full = run_ppl(patched_build, hybrid, text, tmp_path / f"{name}-full",
                       "mode=emulate,policy=fetch-all,slots=25%,shadow=1", extra=extra)
        check_ok(full)
        assert full.stats is not None
        sh = shadow_of(full.stats)
        assert sh["rows"] > 0 and sh["kl"] == 0.0 and sh["dnll"] == 0.0, (name, sh)


def test_the_shadow_object_is_parsed_and_checked() -> None:
    """A committed stats file of eval/shadow-estimate reads back with its shadow object; a damaged field is one
    ParseError naming it, not a wrong number."""
    import json

    from harness.parsers.base import ParseError

    path = next(iter(sorted((ROOT / "eval" / "shadow-estimate" / "work").glob("localmoe*.stats.json"))))
    doc = json.loads(path.read_text())
    st = parse_cache_stats(json.dumps(doc))
    assert st.shadow is not None and st.shadow.every == 4 and st.shadow.ubatches > 0
    assert st.shadow.dppl_pct_low <= st.shadow.dppl_pct <= st.shadow.dppl_pct_high
    assert type(st).from_dict(st.as_dict()).shadow == st.shadow
    doc["shadow"]["kl"] = "NaN"
    with pytest.raises(ParseError, match="shadow.kl"):
        parse_cache_stats(json.dumps(doc))
    del doc["shadow"]
    assert parse_cache_stats(json.dumps(doc)).shadow is None


def test_the_shadow_estimate_on_metrics(patched_build: Build, moe: Path, tmp_path: Path) -> None:
    """llama-server's /metrics carries the estimate beside the counters (decode: one-token ubatches, every second
    one computed twice), and the harness's parser reads its number gauges."""
    from harness.tools.server import llama_server

    with llama_server(patched_build.tool("llama-server"), moe, tmp_path / "server.log",
                      spec="mode=emulate,policy=speed,slots=16,shadow=2", ctx=512, threads=2) as s:
        s.complete("one two three four", n_predict=24)
        m = s.metrics().cache
    assert m is not None and m.shadow is not None, "no shadow gauges on /metrics"
    assert m.counters["shadow_ubatches"] >= 10  # 24 decoded tokens, every second one (and the prompt's ubatch)
    assert set(m.shadow) == {"dppl_pct", "dppl_pct_low", "dppl_pct_high", "kl_nats"}
    assert m.shadow["dppl_pct_low"] <= m.shadow["dppl_pct"] <= m.shadow["dppl_pct_high"] and m.shadow["kl_nats"] >= 0
