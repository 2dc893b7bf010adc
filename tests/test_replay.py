"""LLAMA_MOE_CACHE_TEST_REPLAY (issue 23, item 6): the route step takes each token-layer's experts and gate weights
from a router trace recorded on another model of the same routing shape, so that a generated model is timed under a
trained model's routing. Checked here: a trace recorded during a replayed run shows exactly the source trace's
selections, layer j replaying the source's layer j mod L from evenly spaced starting points (wrapping at the end);
and the one-line refusals (another routing shape, the cache off, prefetch=on, not a trace)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness.core.project import Build
from harness.parsers.trace import read_expert_trace
from harness.tools.synth import SynthSpec, synth_text, write_synth_model

REPLAY_ENV = "LLAMA_MOE_CACHE_TEST_REPLAY"


def ppl(build: Build, model: Path, text: Path, spec: str | None,
        replay: Path | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_MOE_CACHE", REPLAY_ENV)}
    if spec is not None:
        env["LLAMA_MOE_CACHE"] = spec
    if replay is not None:
        env[REPLAY_ENV] = str(replay)
    args = [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "64", "-b", "64",
            "--chunks", "3", "-t", "2", "--seed", "1"]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("replay")
    text = out / "text.txt"
    text.write_text(synth_text(4000, seed=3))
    return {
        "text": text,
        # the "trained" model whose routing is recorded: 2 MoE layers; the timed model: 5 (layers 0..4 replay the
        # source's 0, 1, 0, 1, 0), same 16 experts and k = 4
        "source": write_synth_model(SynthSpec(n_layer=2, n_expert=16, n_expert_used=4, seed=1), out / "source.gguf"),
        "target": write_synth_model(SynthSpec(n_layer=5, n_expert=16, n_expert_used=4, seed=2), out / "target.gguf"),
        "other": write_synth_model(SynthSpec(n_layer=2, n_expert=32, n_expert_used=4, seed=3), out / "other.gguf"),
    }


def test_replayed_selections_are_the_trace(patched_build: Build, shapes: dict[str, Path], tmp_path: Path) -> None:
    src_trace = tmp_path / "source.bin"
    r = ppl(patched_build, shapes["source"], shapes["text"], f"policy=fetch-all,slots=50%,trace={src_trace}", None)
    assert r.returncode == 0, r.stderr[-2000:]
    src = read_expert_trace(src_trace)
    per_src = {int(li): src.records[src.records["layer"] == li] for li in np.unique(src.records["layer"])}
    assert sorted(per_src) == [0, 1]

    out_trace = tmp_path / "replayed.bin"
    r = ppl(patched_build, shapes["target"], shapes["text"], f"policy=quality,slots=50%,trace={out_trace}", src_trace)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "routing replayed from the router trace" in r.stderr and "TEST ONLY" in r.stderr
    got = read_expert_trace(out_trace)
    # (the last layer of a llama-perplexity graph computes only the scored rows: fewer records than the others)
    groups = 3  # ceil(5 model MoE layers / 2 trace layers)
    for layer in range(5):
        mine = got.records[got.records["layer"] == layer]
        assert len(mine) > 0
        src_layer = per_src[layer % 2]
        n_src = len(src_layer)
        start = (layer // 2) * n_src // groups
        # llama-perplexity routes a few tokens before it resets the cache (which restarts the trace, not the replay's
        # cursors): the traced rows begin a few records after the layer's starting point, and then follow the source
        # record by record, wrapping at its end
        matches = [o for o in range(8) if all(
            np.array_equal(mine["ids"][i], src_layer["ids"][(start + o + i) % n_src]) for i in range(4))]
        assert matches, f"layer {layer}: the first replayed rows are not the source's from record {start} on"
        idx = (start + matches[0] + np.arange(len(mine))) % n_src
        if layer >= 2:
            # a later starting point, and the cursor wrapped
            assert start > 0 and start + matches[0] + len(mine) > n_src
        np.testing.assert_array_equal(mine["ids"], src_layer["ids"][idx], err_msg=f"layer {layer}")
        np.testing.assert_array_equal(mine["weights"], src_layer["weights"][idx], err_msg=f"layer {layer}")
    # the replay changed the routing (the target's own router chooses other experts)
    own_trace = tmp_path / "own.bin"
    r = ppl(patched_build, shapes["target"], shapes["text"], f"policy=quality,slots=50%,trace={own_trace}", None)
    assert r.returncode == 0, r.stderr[-2000:]
    own = read_expert_trace(own_trace)
    assert not np.array_equal(own.records["ids"], got.records["ids"])


def test_replay_refusals(patched_build: Build, shapes: dict[str, Path], tmp_path: Path) -> None:
    src_trace = tmp_path / "source.bin"
    r = ppl(patched_build, shapes["source"], shapes["text"], f"policy=fetch-all,trace={src_trace}", None)
    assert r.returncode == 0, r.stderr[-2000:]
    cases = [
        (shapes["other"], "policy=quality", src_trace, "replay needs a trace of the same routing shape"),
        (shapes["target"], None, src_trace, "the expert cache is off"),
        (shapes["target"], "mode=off", src_trace, "the expert cache is off"),
        (shapes["target"], "policy=quality,prefetch=on", src_trace, "give prefetch=off"),
        (shapes["target"], "policy=quality", shapes["text"], "not a router trace"),
        (shapes["target"], "policy=quality", tmp_path / "missing.bin", "cannot open the router trace"),
    ]
    for model, spec, replay, want in cases:
        r = ppl(patched_build, model, shapes["text"], spec, replay)
        assert r.returncode != 0 and want in r.stderr, (spec, replay, r.stderr[-1500:])
        assert "Traceback" not in r.stderr and "terminate called" not in r.stderr
