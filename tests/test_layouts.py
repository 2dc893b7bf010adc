"""The expert cache on the layouts people download (issue 12): mixtral, gpt-oss, deepseek2, qwen3next (the
study's: hybrid linear attention, a gated shared expert), qwen3next with merged ``ffn_gate_up_exps`` experts
(``qwen3next+fused``: what ``convert_hf_to_gguf.py --fuse-gate-up-exps`` writes) and glm4moe (GLM-4.5-Air's
shape: a leading dense layer, MoE layers, a NextN/MTP layer), at f16, q8_0 and Q4_K_M.

Per layout and type, on small generated models with the built binaries:
- stock llama.cpp of the pin loads and runs the model (the stock runs below);
- the cache off is the stock build bit for bit; emulate fetch-all and engine fetch-all (one-token and default
  ubatches) are stock bit for bit;
- engine decode takes the same decisions as emulate mode and gives the same values;
- the quality preset never substitutes a first choice or an expert of gate weight >= tau;
- gpt-oss: the per-expert biases (``ffn_*_exps.bias``) have cache banks, counted in the bank bytes, and are
  copied with every expert;
- deepseek2 with a leading dense layer (DeepSeek's first_k_dense_replace): the cache has no state and no banks
  for the dense layer, fetch-all is stock, engine decides as emulate;
- glm4moe: the cache has state and banks for the MoE layers only: not the leading dense layer and not the MTP
  layer (llama.cpp without MTP decoding skips its tensors; the graph never routes it);
- qwen3next+fused: the banks copy the merged gate_up tensor (the copy and bank bytes are exact);
- a layout the cache cannot serve (grovemoe: two expert sets per layer) is a one-line error naming the arch and
  what to do, in emulate and engine mode; stock runs it;
- gating (every served layout, the original three too): the gate weights the route step recomputes on the host from
  the router logits equal the weights llama.cpp's graph computes (softmax, sigmoid, softmax after top-k, router
  and selection biases, normalisation), up to the model's expert_weights_scale, which the graph applies after
  (deepseek2 and glm4moe: 2.5; the policy's tau applies to the weights before it). LLAMA_MOE_CACHE_TEST_GATING
  adds a check op after the router that compares the two for every selection and reports the ratio in the
  statistics.

The original layouts (qwen3moe, qwen2moe, hy_v3) are covered by test_engine.py and test_expert_cache.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_engine import (
    N_CHUNKS,
    N_CTX,
    N_LAYER,
    check_consistent,
    check_ok,
    run_ppl,
    same_decisions,
    skip_if_stock_crashes,
)

from harness.core.project import Build
from harness.tools.synth import ARCHS, CACHE_REFUSED, SynthSpec, synth_text, write_synth_model

# layout -> (arch, SynthSpec fields besides the common ones)
LAYOUT_SPECS: dict[str, tuple[str, dict[str, int | bool]]] = {
    "mixtral": ("mixtral", {}),
    "gpt-oss": ("gpt-oss", {}),
    "deepseek2": ("deepseek2", {}),
    "qwen3next": ("qwen3next", {}),
    "qwen3next+fused": ("qwen3next", {"fused_gate_up": True}),
    # GLM-4.5-Air's shape: layer 0 dense, layers 1-2 MoE (N_LAYER of them, as for the others), layer 3 MTP
    "glm4moe": ("glm4moe", {"n_layer": N_LAYER + 1, "n_dense_lead": 1, "n_nextn": 1}),
}
LAYOUTS = tuple(LAYOUT_SPECS)
TYPES = ("f16", "q8_0")
# (layout, type) pairs run at f16/q8_0; qwen3next+fused differs from qwen3next only in the expert tensors, whose
# bank copies do not depend on the type: f16 here, and Q4_K_M (test_layout_q4_k_m), for CI time
LAYOUT_TYPES = [(layout, dtype) for layout in LAYOUTS for dtype in TYPES
                if layout != "qwen3next+fused" or dtype == "f16"]
N_EXPERT = 64
K = 8
SLOTS = 16  # 25%


def layout_spec(layout: str, **change: int | str) -> SynthSpec:
    arch, extra = LAYOUT_SPECS.get(layout, (layout, {}))
    fields: dict[str, int | str | bool] = {"n_expert": N_EXPERT, "n_expert_used": K, "n_layer": N_LAYER, "seed": 5,
                                           **extra, **change}
    return SynthSpec(arch=arch, **fields)  # type: ignore[arg-type]


def moe_layers(spec: SynthSpec) -> list[int]:
    """The layers the cache keeps state and banks for: not the leading dense ones, not the MTP ones."""
    return list(range(spec.n_dense_lead, spec.n_layer))


@pytest.fixture(scope="module")
def layout_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("layout-models")
    return {(layout, dtype): write_synth_model(layout_spec(layout, dtype=dtype), out / f"{layout}-{dtype}.gguf")
            for layout, dtype in LAYOUT_TYPES}


@pytest.fixture(scope="module")
def layout_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("layout-text") / "text.txt"
    path.write_text(synth_text(12000, seed=2))
    return path


_probe: dict[str, str] = {}


@pytest.fixture(scope="module")
def layout_build(patched_build: Build, layout_models: dict[tuple[str, str], Path], layout_text: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Build:
    key = str(patched_build.bin_dir)
    if key not in _probe:
        r = run_ppl(patched_build, layout_models[("mixtral", "f16")], layout_text, tmp_path_factory.mktemp("probe"),
                    "mode=bogus", nll=False, want="accepted")
        _probe[key] = r.output
    if "off, emulate, engine" not in _probe[key]:
        pytest.skip("the patched build has no expert cache engine mode (mode=engine) yet")
    return patched_build


def _expert_bytes(layout: str, dtype: str) -> tuple[int, int]:
    """(bytes of one expert's weights, bytes of its biases) in one layer, as the generated file stores them."""
    from harness.tools.synth import expected_bytes_per_expert

    spec = layout_spec(layout, dtype=dtype)
    biases = 4 * (2 * spec.n_ff_exp + spec.n_embd) if spec.arch == "gpt-oss" else 0  # F32 gate, up and down biases
    return expected_bytes_per_expert(spec), biases


@pytest.mark.build
@pytest.mark.parametrize(("layout", "dtype"), LAYOUT_TYPES)
def test_layout_off_and_fetch_all_are_stock(layout: str, dtype: str, layout_models: dict[tuple[str, str], Path],
                                            layout_text: Path, tmp_path: Path, stock_build: Build,
                                            layout_build: Build) -> None:
    model = layout_models[(layout, dtype)]
    spec = f"policy=fetch-all,slots={SLOTS}"
    for ubatch in (1, None):
        tag = f"ub{ubatch}"
        stock = run_ppl(stock_build, model, layout_text, tmp_path / f"stock-{tag}", ubatch=ubatch, nll=False)
        skip_if_stock_crashes(stock)
        check_ok(stock)
        runs = {
            "off": run_ppl(layout_build, model, layout_text, tmp_path / f"off-{tag}", ubatch=ubatch, nll=False),
            "engine": run_ppl(layout_build, model, layout_text, tmp_path / f"eng-{tag}", f"mode=engine,{spec}",
                              ubatch=ubatch, nll=False),
        }
        runs["emulate"] = run_ppl(layout_build, model, layout_text, tmp_path / f"emu-{tag}", f"mode=emulate,{spec}",
                                  ubatch=ubatch, nll=False)
        for name, r in runs.items():
            check_ok(r)
            assert r.logits == stock.logits, (name, tag)
        for name in ("engine", "emulate"):
            stats = runs[name].stats
            assert stats is not None
            t = stats["total"]
            assert t["misses"] > 0 and t["fetches"] == t["misses"] and t["substitutions"] == 0, (name, tag)
        eng = runs["engine"].stats
        assert eng is not None and eng["engine"]["copied_experts"] > 0
        assert [layer["layer"] for layer in eng["layers"]] == moe_layers(layout_spec(layout))


@pytest.mark.build
@pytest.mark.parametrize(("layout", "dtype"), LAYOUT_TYPES)
def test_layout_engine_equals_emulate_and_quality_protects(layout: str, dtype: str,
                                                           layout_models: dict[tuple[str, str], Path],
                                                           layout_text: Path, tmp_path: Path,
                                                           stock_build: Build, layout_build: Build) -> None:
    model = layout_models[(layout, dtype)]
    skip_if_stock_crashes(run_ppl(stock_build, model, layout_text, tmp_path / "stock", ubatch=1, nll=False))
    spec = f"policy=quality,slots={SLOTS}"
    emu = run_ppl(layout_build, model, layout_text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=1)
    eng = run_ppl(layout_build, model, layout_text, tmp_path / "eng", f"mode=engine,{spec}", ubatch=1)
    check_ok(emu)
    check_ok(eng)
    assert emu.stats is not None and eng.stats is not None
    check_consistent(eng.stats)
    same_decisions(emu.stats, eng.stats)
    assert emu.nll is not None and eng.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)
    t, e = eng.stats["total"], eng.stats["engine"]
    assert t["tokens"] == N_CHUNKS * N_CTX
    # the quality preset substitutes, but never a first choice nor an expert of gate weight >= tau
    assert t["substitutions"] > 0
    assert t["subst_first_choice"] == 0
    assert t["max_subst_weight"] < eng.stats["config"]["tau"]
    # decode: every fetch and admission is one whole expert copied, biases (gpt-oss) included
    assert e["copied_experts"] == t["fetches"] + t["admissions"]
    weights, biases = _expert_bytes(layout, dtype)
    assert e["copy_bytes"] == e["copied_experts"] * (weights + biases)
    # the banks: slots + 1 spare per MoE layer, of every routed-expert tensor (gpt-oss: its _b biases too;
    # qwen3next+fused: the merged gate_up), none for a dense or an MTP layer (glm4moe)
    layers = moe_layers(layout_spec(layout))
    assert [layer["layer"] for layer in eng.stats["layers"]] == layers
    assert e["bank_bytes"] == len(layers) * (SLOTS + 1) * (weights + biases)


@pytest.mark.build
@pytest.mark.parametrize("ubatch", [1, None])
@pytest.mark.parametrize("layout", [a for a in ARCHS if a not in CACHE_REFUSED])  # the router: as qwen3next+fused
def test_gating_equals_the_graph(layout: str, ubatch: int | None, layout_text: Path, tmp_path: Path,
                                 stock_build: Build, layout_build: Build, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = layout_spec(layout, dtype="f16")
    model = write_synth_model(spec, tmp_path / f"{layout}.gguf")
    skip_if_stock_crashes(run_ppl(stock_build, model, layout_text, tmp_path / "stock", ubatch=ubatch, nll=False))
    monkeypatch.setenv("LLAMA_MOE_CACHE_TEST_GATING", "1")
    r = run_ppl(layout_build, model, layout_text, tmp_path / "run", f"mode=engine,policy=quality,slots={SLOTS}",
                ubatch=ubatch, nll=False)
    check_ok(r)
    assert r.stats is not None
    g = r.stats["gating_check"]
    assert g["checked"] == r.stats["total"]["calls"] > 0  # every selection of every token-layer
    scale = spec.weights_scale  # expert_weights_scale: deepseek2 and glm4moe 2.5, 1 elsewhere
    assert g["ratio_min"] == pytest.approx(scale, rel=1e-5)
    assert g["ratio_max"] == pytest.approx(scale, rel=1e-5)


@pytest.mark.build
@pytest.mark.parametrize("mode", ["emulate", "engine"])
def test_unserved_layout_is_a_one_line_error(mode: str, layout_text: Path, tmp_path: Path, stock_build: Build,
                                             layout_build: Build) -> None:
    model = write_synth_model(SynthSpec(arch="grovemoe", n_expert=N_EXPERT, n_expert_used=K, n_layer=N_LAYER,
                                        dtype="f16", seed=5), tmp_path / "grovemoe.gguf")
    stock = run_ppl(stock_build, model, layout_text, tmp_path / "stock", nll=False)
    check_ok(stock)
    r = run_ppl(layout_build, model, layout_text, tmp_path / "cache", f"mode={mode},slots={SLOTS}", nll=False,
                want="grovemoe routes")
    assert r.returncode != 0
    lines = [line for line in r.output.splitlines() if "grovemoe routes" in line]
    assert lines, r.output[-3000:]
    assert "cannot serve" in lines[0] and "unset LLAMA_MOE_CACHE" in lines[0]
    assert "Traceback" not in r.output and "GGML_ASSERT" not in r.output and r.returncode > 0  # no crash


@pytest.mark.build
def test_leading_dense_layer(layout_text: Path, tmp_path: Path, stock_build: Build, layout_build: Build) -> None:
    model = write_synth_model(SynthSpec(arch="deepseek2", n_expert=N_EXPERT, n_expert_used=K, n_layer=3,
                                        n_dense_lead=1, dtype="q8_0", seed=5), tmp_path / "deepseek2-dense1.gguf")
    stock = run_ppl(stock_build, model, layout_text, tmp_path / "stock", ubatch=1, nll=False)
    skip_if_stock_crashes(stock)
    fetch = run_ppl(layout_build, model, layout_text, tmp_path / "fetch", f"mode=engine,policy=fetch-all,slots={SLOTS}",
                    ubatch=1, nll=False)
    spec = f"policy=quality,slots={SLOTS}"
    emu = run_ppl(layout_build, model, layout_text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=1)
    eng = run_ppl(layout_build, model, layout_text, tmp_path / "eng", f"mode=engine,{spec}", ubatch=1)
    for r in (stock, fetch, emu, eng):
        check_ok(r)
    assert fetch.logits == stock.logits
    assert emu.stats is not None and eng.stats is not None and fetch.stats is not None
    same_decisions(emu.stats, eng.stats)
    assert [layer["layer"] for layer in eng.stats["layers"]] == [1, 2]  # no state for the dense layer 0
    weights, _ = _expert_bytes("deepseek2", "q8_0")
    assert eng.stats["engine"]["bank_bytes"] == 2 * (SLOTS + 1) * weights  # banks for the two MoE layers only
    assert eng.stats["total"]["substitutions"] > 0 and eng.stats["total"]["subst_first_choice"] == 0
    assert emu.nll is not None and eng.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.build
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_q4_k_m(layout: str, layout_text: Path, tmp_path: Path, stock_build: Build,
                       layout_build: Build) -> None:
    """Each new layout at Q4_K_M (llama-quantize of the pin; rows 256 wide, types mixed per tensor): cache off,
    emulate fetch-all and engine fetch-all are stock bit for bit (ubatch 1 and the default, -nr on both sides:
    repacked kernels sum in another order), and the engine takes emulate's decisions under the quality preset,
    which never substitutes a first choice or a weight >= tau (with k = 4 most weights are >= 0.15: some layouts
    substitute nothing)."""
    from harness.core.errors import HarnessError
    from harness.tools.quantize import find_quantize, write_kquant_model

    try:
        tool = find_quantize({"stock": stock_build, "patched": layout_build})
    except HarnessError as e:
        pytest.skip(str(e))
    spec = layout_spec(layout, n_expert=32, n_expert_used=4, n_embd=256, n_ff_exp=256, n_ff_shexp=256)
    model = write_kquant_model(spec, "Q4_K_M", tmp_path / f"{layout}-q4_k_m.gguf", tool)
    nr = ("-nr",)
    # the default ubatch: off, emulate and engine fetch-all are stock
    stock_d = run_ppl(stock_build, model, layout_text, tmp_path / "stock-d", nll=False, extra=nr)
    check_ok(stock_d)
    for mode in ("off", "emulate", "engine"):
        cache = None if mode == "off" else f"mode={mode},policy=fetch-all,slots=8"
        r = run_ppl(layout_build, model, layout_text, tmp_path / f"{mode}-d", cache, nll=False, extra=nr)
        check_ok(r)
        assert r.logits == stock_d.logits, mode
    stock = run_ppl(stock_build, model, layout_text, tmp_path / "stock", ubatch=1, nll=False, extra=nr)
    fa = run_ppl(layout_build, model, layout_text, tmp_path / "fa", "mode=engine,policy=fetch-all,slots=8", ubatch=1,
                 nll=False, extra=nr)
    off = run_ppl(layout_build, model, layout_text, tmp_path / "off", ubatch=1, nll=False, extra=nr)
    emu_fa = run_ppl(layout_build, model, layout_text, tmp_path / "emu-fa", "mode=emulate,policy=fetch-all,slots=8",
                     ubatch=1, nll=False, extra=nr)
    emu = run_ppl(layout_build, model, layout_text, tmp_path / "emu", "mode=emulate,policy=quality,slots=8", ubatch=1,
                  extra=nr)
    eng = run_ppl(layout_build, model, layout_text, tmp_path / "eng", "mode=engine,policy=quality,slots=8", ubatch=1,
                  extra=nr)
    for r in (stock, fa, off, emu_fa, emu, eng):
        check_ok(r)
    assert fa.logits == stock.logits and off.logits == stock.logits and emu_fa.logits == stock.logits
    assert emu.stats is not None and eng.stats is not None and fa.stats is not None
    assert fa.stats["engine"]["copied_experts"] > 0
    assert [layer["layer"] for layer in eng.stats["layers"]] == moe_layers(spec)
    same_decisions(emu.stats, eng.stats)
    t = eng.stats["total"]
    assert t["misses"] > 0 and t["subst_first_choice"] == 0 and t["max_subst_weight"] < 0.15, t
