"""The expert cache engine (issue 4, mode=engine), end to end on generated models with the built binaries.

- engine with one-token ubatches (decode) and emulate take identical decisions (identical statistics) and give
  the same logits; with larger ubatches (full expert tensors, same policy) too;
- engine fetch-all at any residency gives the stock build's output;
- adversarial runs (slots = k, every preset and rule, high-churn text): no assertion fires (an expert in use by
  the token is never evicted, a slot is never used before its copy completed nor overwritten while a
  background copy runs: GGML_ASSERTs in the engine), statistics consistent, every fetch and admission is one
  expert copied, admissions through the background state;
- prefill bypass (bypass=N) gives the stock output and warms the banks; vram=SIZE fits the slots to a budget;
- layouts that cannot be copied slot by slot (repacked CPU weights) are refused with a clear message;
- K-quants (Q4_K_M, which mixes Q4_K and Q6_K per tensor, and Q6_K, made by llama-quantize): cache off and
  fetch-all are stock, the engine decides as emulate, repacked ones are refused without --no-repack, host=file.

Skipped, with the reason, when the patched build has no engine mode yet. While developing, point the
`patched_build` fixture at another build with MOE_SUBST_PATCHED_BIN=/path/to/bin (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.parsers.nll_dump import read_nll_dump_file
from harness.tools.quantize import KQUANTS, find_quantize, write_kquant_model
from harness.tools.synth import SynthSpec, synth_text, write_synth_model

# the original layouts; mixtral, gpt-oss and deepseek2: test_layouts.py
ARCHS = ("qwen3moe", "qwen2moe", "hy_v3")
N_EXPERT = 64
K = 8
N_LAYER = 2
N_CTX = 64
N_CHUNKS = 3
THREADS = "2"


@pytest.fixture(scope="module")
def engine_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("engine-models")
    return {arch: write_synth_model(SynthSpec(arch=arch, n_expert=N_EXPERT, n_expert_used=K, n_layer=N_LAYER, seed=5),
                                    out / f"{arch}-e{N_EXPERT}k{K}.gguf") for arch in ARCHS}


@pytest.fixture(scope="module")
def engine_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engine-text") / "text.txt"
    path.write_text(synth_text(12000, seed=2))
    return path


@pytest.fixture(scope="module")
def churn_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """High-entropy text: random printable characters, so that the routing changes at every token."""
    rng = random.Random(7)
    path = tmp_path_factory.mktemp("engine-churn") / "churn.txt"
    path.write_text("".join(chr(rng.randrange(33, 127)) for _ in range(12000)))
    return path


@dataclass
class Run:
    returncode: int
    output: str
    logits: bytes
    stats: dict | None  # type: ignore[type-arg]
    nll: np.ndarray | None


def run_ppl(build: Build, model: Path, text: Path, tmp: Path, spec: str | None = None, *, ubatch: int | None = None,
            nll: bool = True, want: str = "", extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Run:
    """llama-perplexity; results come from the files it writes (its asynchronous log may lose the last lines)."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}, **(env or {})}
    stats_path, logits_path, nll_path = tmp / "stats.json", tmp / "logits.bin", tmp / "nll.bin"
    args = [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(N_CTX), "-b", str(N_CTX),
            "--chunks", str(N_CHUNKS), "-t", THREADS, "--seed", "1", "--kl-divergence-base", str(logits_path), *extra]
    if ubatch is not None:
        args += ["-ub", str(ubatch)]
    if nll:
        args += ["--nll-dump", str(nll_path)]
    if spec is not None:
        env["LLAMA_MOE_CACHE"] = spec + f",stats={stats_path}"
    for _ in range(12):  # upstream issue 22142: the stock build often loses its last log lines
        for f in (stats_path, logits_path, nll_path):
            f.unlink(missing_ok=True)
        res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        out = res.stdout + res.stderr
        if want in out:
            break
    return Run(
        returncode=res.returncode, output=out,
        logits=logits_path.read_bytes() if logits_path.exists() else b"",
        stats=json.loads(stats_path.read_text()) if spec is not None and stats_path.exists() else None,
        nll=read_nll_dump_file(nll_path).nll if nll and nll_path.exists() else None,
    )


def check_ok(r: Run) -> None:
    assert r.returncode == 0, r.output[-3000:]
    assert len(r.logits) > 1000


def upstream_failure(r: Run) -> str:
    """Why a stock run died in upstream ggml itself ('' if it did not): SIGILL or SIGSEGV in its kernels, or a
    GGML_ASSERT in its backend scheduler. All seen on VMs advertising AVX-512 and AMX, in the stock build: SIGILL in
    the repack kernels on K-quants on one, SIGSEGV there on another (2026-12-02: every run with the K-quant repacked,
    none with --no-repack), and ggml-backend.cpp's `*cur_backend_id != -1` for q8_0 and deepseek2 models placed in
    the AMX buffer type. Only for stock runs (skip_if_stock_crashes): a patched run that crashes is a failure."""
    if r.returncode in (-4, 132):
        return "SIGILL in ggml's kernels"
    if r.returncode in (-11, 139):
        return "SIGSEGV in ggml's kernels"
    if r.returncode != 0 and "GGML_ASSERT" in r.output and "ggml-backend.cpp" in r.output:
        return "a GGML_ASSERT in ggml-backend.cpp's scheduler"
    return ""


def skip_if_stock_crashes(stock: Run) -> None:
    """The stock build itself fails on the model on this CPU (upstream_failure): there is nothing for the cache to
    match. Skip with the reason (only ever for a *stock* run: a patched run failing this way is a failure)."""
    if why := upstream_failure(stock):
        pytest.skip(f"the stock build fails on this model on this CPU ({why}): nothing to compare with")


def check_consistent(stats: dict) -> None:  # type: ignore[type-arg]
    for s in [stats["total"], *stats["layers"]]:
        assert s["hits"] + s["misses"] + s["skips"] == s["calls"]
        assert s["fetches"] + s["substitutions"] + s["drops"] + s["host_computes"] == s["misses"]
        assert s["calls"] == s["token_layers"] * stats["config"]["n_expert_used"]
        assert sum(s["mass_hist"]) == s["token_layers"]
    assert len(stats["layers"]) == N_LAYER
    assert stats["total"]["tokens"] == N_CHUNKS * N_CTX


_probe: dict[str, str] = {}


@pytest.fixture(scope="module")
def engine_build(patched_build: Build, engine_models: dict[str, Path], engine_text: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The patched build, or a skip when it has no engine mode (the spec parser names the accepted modes)."""
    key = str(patched_build.bin_dir)
    if key not in _probe:
        r = run_ppl(patched_build, engine_models["qwen3moe"], engine_text, tmp_path_factory.mktemp("probe"),
                    "mode=bogus", nll=False, want="accepted")
        _probe[key] = r.output
    if "off, emulate, engine" not in _probe[key]:
        pytest.skip("the patched build has no expert cache engine mode (mode=engine) yet")
    return patched_build


def same_decisions(a: dict, b: dict) -> None:  # type: ignore[type-arg]
    assert a["total"] == b["total"]
    assert a["layers"] == b["layers"]


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy", ["quality", "speed", "fetch-all"])
def test_engine_decode_equals_emulate(arch: str, policy: str, engine_models: dict[str, Path], engine_text: Path,
                                      tmp_path: Path, engine_build: Build) -> None:
    model = engine_models[arch]
    spec = f"policy={policy},slots=25%"
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=1)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,{spec}", ubatch=1)
    check_ok(emu)
    check_ok(eng)
    assert emu.stats is not None and eng.stats is not None
    check_consistent(eng.stats)
    assert eng.stats["config"]["mode"] == "engine"
    same_decisions(emu.stats, eng.stats)
    t = eng.stats["total"]
    assert t["misses"] > 0  # the cache was exercised
    e = eng.stats["engine"]
    # decode: every fetch and every admission is one expert copied into a slot, nothing else
    assert e["copied_experts"] == t["fetches"] + t["admissions"]
    # admissions go through the background state (LOADING until the layer's next step), fetches do not
    assert e["background_experts"] == t["admissions"]
    assert e["copy_bytes"] > 0 and e["copies"] >= 1 and e["bank_bytes"] > 0
    assert emu.nll is not None and eng.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.build
@pytest.mark.parametrize("spec", ["rule=cache-route,alpha=0.5,slots=25%",
                                  "rule=zero,tau=0.1,renorm=on,evict=classlru,slots=25%",
                                  "rule=ser,kmin=2,t=0.5,renorm=on,slots=25%"])
def test_engine_decode_equals_emulate_anchor_policies(spec: str, engine_models: dict[str, Path], engine_text: Path,
                                                      tmp_path: Path, engine_build: Build) -> None:
    """The anchors' rules in engine mode: drops and skips read the spare slot at weight 0, alpha and renorm scale
    the gate weights; the same decisions and outputs as emulate mode."""
    model = engine_models["qwen3moe"]
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=1)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,{spec}", ubatch=1)
    check_ok(emu)
    check_ok(eng)
    assert emu.stats is not None and eng.stats is not None
    check_consistent(eng.stats)
    same_decisions(emu.stats, eng.stats)
    t = eng.stats["total"]
    assert t["substitutions"] + t["drops"] + t["skips"] > 0
    assert eng.stats["engine"]["copied_experts"] == t["fetches"] + t["admissions"]
    assert emu.nll is not None and eng.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.build
def test_engine_band_max_rank_substitutes_only_first_choices(engine_models: dict[str, Path], engine_text: Path,
                                                             tmp_path: Path, engine_build: Build) -> None:
    """rule=band with max_rank=0 (issue 22): every first-choice miss is substituted and no miss at a rank >= 1 is,
    in engine mode as in emulate mode; without max_rank the same band substitutes at later ranks too (so the
    assertion on max_rank=0 can fail)."""
    model = engine_models["qwen3moe"]
    spec = "rule=band,lo=0,hi=1,max_rank=0,slots=25%"
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=1)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,{spec}", ubatch=1)
    every = run_ppl(engine_build, model, engine_text, tmp_path / "every", "mode=emulate,rule=band,lo=0,hi=1,slots=25%",
                    ubatch=1)
    for r in (emu, eng, every):
        check_ok(r)
    assert emu.stats is not None and eng.stats is not None and every.stats is not None
    check_consistent(eng.stats)
    same_decisions(emu.stats, eng.stats)
    t = eng.stats["total"]
    assert eng.stats["config"]["band_max_rank"] == 0
    assert t["substitutions"] == t["subst_first_choice"] > 0
    assert t["fetches"] > 0  # the misses at ranks >= 1
    assert every.stats["total"]["substitutions"] > every.stats["total"]["subst_first_choice"]
    assert emu.nll is not None and eng.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_large_ubatch_equals_emulate(arch: str, engine_models: dict[str, Path], engine_text: Path,
                                            tmp_path: Path, engine_build: Build) -> None:
    """Ubatches of more than one token compute with the full expert tensors and the same decisions."""
    model = engine_models[arch]
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", "mode=emulate,policy=quality,slots=25%")
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", "mode=engine,policy=quality,slots=25%")
    check_ok(emu)
    check_ok(eng)
    assert emu.stats is not None and eng.stats is not None
    same_decisions(emu.stats, eng.stats)
    assert eng.logits == emu.logits
    t = eng.stats["total"]
    # the banks follow the residency once per ubatch: at most one copy per fetch or admission
    assert 0 < eng.stats["engine"]["copied_experts"] <= t["fetches"] + t["admissions"]


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slots", ["25%", str(K), "100%"])
def test_engine_fetch_all_is_stock(arch: str, slots: str, engine_models: dict[str, Path], engine_text: Path,
                                   tmp_path: Path, stock_build: Build, engine_build: Build) -> None:
    model = engine_models[arch]
    stock = run_ppl(stock_build, model, engine_text, tmp_path / "stock", ubatch=1, nll=False)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,policy=fetch-all,slots={slots}",
                  ubatch=1)
    check_ok(stock)
    check_ok(eng)
    assert eng.logits == stock.logits
    assert eng.stats is not None
    t = eng.stats["total"]
    assert t["substitutions"] == 0 and t["drops"] == 0 and t["fetches"] == t["misses"]
    assert eng.stats["engine"]["copied_experts"] == t["fetches"]
    if slots == "100%":
        assert t["misses"] == 0 and eng.stats["engine"]["copied_experts"] == 0
    else:
        assert t["misses"] > 0


@pytest.mark.build
@pytest.mark.parametrize("spec", [
    "policy=quality", "policy=speed", "policy=fetch-all", "policy=fetch-all,evict=lfu",
    "rule=substitute-all,admit=0.05", "rule=threshold,tau=0.3,admit=0.01,evict=lru", "rule=drop",
])
@pytest.mark.parametrize("ubatch", [1, 3])
def test_engine_adversarial(spec: str, ubatch: int, engine_models: dict[str, Path], churn_text: Path,
                            tmp_path: Path, engine_build: Build) -> None:
    """Minimum residency (slots = k) on high-churn text: every token evicts. The engine's GGML_ASSERTs abort the
    run if an expert in use by the token is not resident or its slot's copy has not completed."""
    r = run_ppl(engine_build, engine_models["qwen3moe"], churn_text, tmp_path, f"mode=engine,{spec},slots={K}",
                ubatch=ubatch)
    check_ok(r)
    assert r.stats is not None
    check_consistent(r.stats)
    t = r.stats["total"]
    assert t["misses"] > 0
    e = r.stats["engine"]
    if ubatch == 1:
        assert e["copied_experts"] == t["fetches"] + t["admissions"]
        assert e["background_experts"] == t["admissions"]
    else:
        assert e["copied_experts"] <= t["fetches"] + t["admissions"]
    assert r.nll is not None and np.all(np.isfinite(r.nll))


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("slots", "ubatch"), [("25%", 2), ("50%", 4), ("50%", 3)])
def test_engine_group_equals_emulate(arch: str, slots: str, ubatch: int, engine_models: dict[str, Path],
                                     engine_text: Path, tmp_path: Path, engine_build: Build) -> None:
    """Small multi-token ubatches (ubatch * k <= slots) compute from the banks as a group: the experts of every
    token of the ubatch are held resident together. Emulate mode decides the same groups: identical decisions,
    the same values."""
    model = engine_models[arch]
    spec = f"policy=quality,slots={slots}"
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=ubatch)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,{spec}", ubatch=ubatch)
    check_ok(emu)
    check_ok(eng)
    assert emu.stats is not None and eng.stats is not None
    check_consistent(eng.stats)
    n_slots = eng.stats["config"]["slots"]
    assert eng.stats["group_max"] == n_slots // K >= ubatch
    same_decisions(emu.stats, eng.stats)
    t = eng.stats["total"]
    assert t["misses"] > 0 and t["forced_substitutions"] == 0
    # the banks are brought to the policy's residency once per ubatch: an expert fetched and evicted again
    # within one ubatch is never copied
    assert 0 < eng.stats["engine"]["copied_experts"] <= t["fetches"] + t["admissions"]
    assert emu.nll is not None and eng.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.build
def test_engine_group_off(engine_models: dict[str, Path], engine_text: Path, tmp_path: Path,
                          engine_build: Build) -> None:
    """group=1: only one-token ubatches use the banks; two-token ubatches compute with the full expert tensors."""
    r = run_ppl(engine_build, engine_models["qwen3moe"], engine_text, tmp_path, "mode=engine,policy=quality,"
                "slots=25%,group=1", ubatch=2)
    check_ok(r)
    assert r.stats is not None and r.stats["group_max"] == 1
    bad = run_ppl(engine_build, engine_models["qwen3moe"], engine_text, tmp_path / "bad", "mode=engine,group=x",
                  ubatch=2, nll=False, want="group")
    assert bad.returncode != 0 and "'group'" in bad.output and "auto" in bad.output


@pytest.mark.build
@pytest.mark.parametrize("spec", ["rule=substitute-all,admit=0.05", "policy=quality", "policy=speed,evict=lfu"])
@pytest.mark.parametrize("ubatch", [1, 2])
@pytest.mark.parametrize("host", ["ram", "file"])
def test_engine_async_copies(spec: str, ubatch: int, host: str, engine_models: dict[str, Path], churn_text: Path,
                             tmp_path: Path, engine_build: Build, monkeypatch: pytest.MonkeyPatch) -> None:
    """async=thread: background admissions are copied by a host thread while the token computes, each copy held
    back 300 us (LLAMA_MOE_CACHE_TEST_COPY_DELAY_US), so a slot used before its copy completed would compute
    with stale bytes. Decisions and values equal emulate mode's; admissions next to a slot in use are deferred
    to the next step (the over-read rule) and counted. host=file: the same, the thread reading from the file."""
    monkeypatch.setenv("LLAMA_MOE_CACHE_TEST_COPY_DELAY_US", "300")
    model = engine_models["qwen3moe"]
    full = f"{spec},slots=25%"
    emu = run_ppl(engine_build, model, churn_text, tmp_path / "emu", f"mode=emulate,{full}", ubatch=ubatch)
    # host=file: the copy thread reads the admissions from the model file (async=auto picks it there)
    eng = run_ppl(engine_build, model, churn_text, tmp_path / "eng",
                  f"mode=engine,{'async=thread' if host == 'ram' else 'host=file'},{full}", ubatch=ubatch)
    check_ok(emu)
    check_ok(eng)
    assert emu.stats is not None and eng.stats is not None
    check_consistent(eng.stats)
    same_decisions(emu.stats, eng.stats)
    t, e = eng.stats["total"], eng.stats["engine"]
    assert e["async"] is True
    assert t["admissions"] > 0
    assert 0 <= e["deferred_experts"] <= e["background_experts"] <= t["admissions"]
    if ubatch == 1:
        assert e["background_experts"] == t["admissions"]
        # every fetch and admission is one expert copied, except deferred admissions of the last tokens, which
        # no later step completed (at most one per slot and layer)
        pending = t["fetches"] + t["admissions"] - e["copied_experts"]
        assert 0 <= pending <= min(e["deferred_experts"], N_LAYER * eng.stats["config"]["slots"])
    assert emu.nll is not None and eng.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.build
def test_engine_async_off_and_bad_value(engine_models: dict[str, Path], engine_text: Path,
                                                     tmp_path: Path, engine_build: Build) -> None:
    """async=off: no copier, the statistics say so; a bad async value is a clear error naming the accepted ones."""
    r = run_ppl(engine_build, engine_models["qwen3moe"], engine_text, tmp_path, "mode=engine,async=off,"
                "rule=substitute-all,admit=0.05,slots=25%", ubatch=1)
    check_ok(r)
    assert r.stats is not None and r.stats["engine"]["async"] is False
    assert r.stats["engine"]["deferred_experts"] == 0
    bad = run_ppl(engine_build, engine_models["qwen3moe"], engine_text, tmp_path / "bad", "mode=engine,async=gpu",
                  ubatch=1, nll=False, want="async")
    assert bad.returncode != 0 and "'async'" in bad.output and "thread" in bad.output


@pytest.mark.build
def test_engine_refuses_repacked_weights(tmp_path: Path, engine_text: Path, engine_build: Build) -> None:
    """Q4_0 expert tensors on CPU are repacked (CPU_REPACK) unless --no-repack: the engine cannot copy them slot by
    slot and says to pass --no-repack."""
    model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=N_EXPERT, n_expert_used=K, n_layer=N_LAYER,
                                        seed=5, dtype="q4_0"), tmp_path / "q4.gguf")
    ok = run_ppl(engine_build, model, engine_text, tmp_path / "nr", "mode=engine,policy=quality,slots=25%",
                 ubatch=1, extra=("-nr",))
    check_ok(ok)
    assert ok.stats is not None and ok.stats["engine"]["copied_experts"] > 0
    bad = run_ppl(engine_build, model, engine_text, tmp_path / "repack", "mode=engine,slots=25%", ubatch=1,
                  want="--no-repack")
    if bad.returncode in (-4, 132):
        pytest.skip("this CPU crashes (SIGILL) in ggml's repack kernels while loading, before the engine's check")
    assert bad.returncode != 0
    assert "--no-repack" in bad.output


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_prefill_bypass(arch: str, engine_models: dict[str, Path], engine_text: Path, tmp_path: Path,
                               stock_build: Build, engine_build: Build) -> None:
    """bypass=N: ubatches of N tokens or more take stock routing with the full expert tensors (the stock output),
    decide nothing, and warm the banks with their most selected experts; emulate mode does the same."""
    model = engine_models[arch]
    spec = "policy=quality,slots=25%,bypass=32"
    stock = run_ppl(stock_build, model, engine_text, tmp_path / "stock", nll=False)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,{spec}")
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", f"mode=emulate,{spec}")
    for r in (stock, eng, emu):
        check_ok(r)
    assert eng.logits == stock.logits and emu.logits == stock.logits
    assert eng.stats is not None and emu.stats is not None
    assert eng.stats["bypass"] == 32
    assert eng.stats["total"]["calls"] == 0
    assert eng.stats["bypass_token_layers"] >= N_CHUNKS * N_CTX * (N_LAYER - 1)
    assert eng.stats["bypass_token_layers"] == emu.stats["bypass_token_layers"]
    assert eng.stats["engine"]["copied_experts"] > 0  # the banks were warmed with the prompt's experts


@pytest.mark.build
def test_engine_prefill_then_decode(engine_models: dict[str, Path], tmp_path: Path, engine_build: Build) -> None:
    """llama-bench pp64 + tg16: the prompt through the bypass, the generated tokens through the banks."""
    stats = tmp_path / "stats.json"
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    env["LLAMA_MOE_CACHE"] = f"mode=engine,policy=quality,slots=25%,bypass=32,stats={stats}"
    res = subprocess.run([str(engine_build.tool("llama-bench")), "-m", str(engine_models["qwen3moe"]), "-p", "0",
                          "-n", "0", "-pg", "64,16", "-r", "2", "-t", THREADS, "-o", "jsonl"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads(stats.read_text())
    assert s["bypass_token_layers"] > 0
    assert s["total"]["calls"] > 0 and s["total"]["calls"] == s["total"]["token_layers"] * K
    assert s["total"]["hits"] + s["total"]["misses"] == s["total"]["calls"]
    assert s["engine"]["copied_experts"] >= s["total"]["fetches"] + s["total"]["admissions"]


@pytest.mark.build
def test_engine_vram_budget(engine_models: dict[str, Path], engine_text: Path, tmp_path: Path,
                            engine_build: Build) -> None:
    """vram=SIZE: the slots per layer that fit (more budget, more slots, at most n_expert; the banks within the
    budget); a budget too small for k slots per layer is a clear error naming the minimum."""
    model = engine_models["qwen3moe"]
    slots = []
    for vram in ("1M", "2M", "1G"):
        r = run_ppl(engine_build, model, engine_text, tmp_path / vram,
                    f"mode=engine,policy=quality,vram={vram},vram_reserve=0", ubatch=1, extra=("--fit", "off"))
        check_ok(r)
        assert r.stats is not None
        slots.append(r.stats["config"]["slots"])
        budget = {"1M": 1 << 20, "2M": 2 << 20, "1G": 1 << 30}[vram]
        assert r.stats["engine"]["bank_bytes"] <= budget
    assert K <= slots[0] < slots[1] <= slots[2] == N_EXPERT
    bad = run_ppl(engine_build, model, engine_text, tmp_path / "small", "mode=engine,vram=100K,vram_reserve=0",
                  ubatch=1, extra=("--fit", "off"), want="need at least")
    assert bad.returncode != 0
    assert "is too small" in bad.output and "need at least" in bad.output
    bad = run_ppl(engine_build, model, engine_text, tmp_path / "reserve", "mode=engine,vram=64M", ubatch=1,
                  extra=("--fit", "off"), want="need at least")
    assert bad.returncode != 0 and "vram_reserve" in bad.output  # the default reserve (256 MiB) does not fit


def test_gpu_check_dry_run() -> None:
    """scripts/gpu_check.sh --dry-run: the plan (stock with --n-cpu-moe, engine presets under the same budget)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    res = subprocess.run(["bash", str(script), "--dry-run", "--layers", "8"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "build.sh --cuda --cuda-arch 90" in out
    assert "harness synth" in out and "--experts 512" in out and "--top-k 10" in out
    assert "--arch qwen3next" in out and "--embd 2048 --ff 512 --ff-shexp 512" in out  # the study's layout and shape
    budget = int(out.split("VRAM budget ")[1].split(" MiB")[0])
    ncmoe = int(out.split("--n-cpu-moe ")[1].split()[0])
    assert 0 < ncmoe <= 8
    lines = [line for line in out.splitlines() if line.startswith("+ [")]
    assert [line.split("]")[0][3:] for line in lines] == ["stock", "engine-fetch-all", "engine-quality", "engine-speed"]
    assert f"-ncmoe {ncmoe}" in lines[0] and "LLAMA_MOE_CACHE" not in lines[0]
    for line in lines[1:]:
        assert f"vram={budget}M" in line and "mode=engine" in line and "-ncmoe 8" in line and "--repack 0" in line
    assert all("-lm none" in line for line in lines)  # experts in pinned memory (no mmap), for every run
    assert "--targets llama-bench llama-quantize --share-ggml" in out and "--offline" not in out
    # the model: Q4_K_M as people run it (f16 quantized by the build's llama-quantize)
    assert "--quantize Q4_K_M" in out and "--dtype" not in out.split("harness synth")[1].splitlines()[0]
    # the lent GPU machine has no network: the bundle's trees, build.sh --offline, the harness from the checkout
    res = subprocess.run(["bash", str(script), "--dry-run", "--offline"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "build.sh --offline --cuda --cuda-arch 90 --targets llama-bench" in res.stdout
    assert "gguf-py python3 -m harness synth" in res.stdout and ".venv" not in res.stdout


def _metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:moe_cache_"):
            name, value = line.split()
            key = name[len("llamacpp:moe_cache_"):]
            out[key[:-len("_total")] if key.endswith("_total") else key] = float(value)
    return out


@pytest.mark.build
def test_engine_server_concurrent(engine_models: dict[str, Path], tmp_path: Path, engine_build: Build) -> None:
    """llama-server with the engine answers concurrent requests (2 parallel slots, loopback, bounded) and reports
    consistent cache counters on /metrics, all zero before the first request; /props names the policy."""
    import threading
    import urllib.request

    from harness.tools.server import llama_server

    log_path = tmp_path / "server.log"
    with llama_server(engine_build.tool("llama-server"), engine_models["qwen3moe"], log_path, ctx=1024,
                      spec="mode=engine,policy=quality,slots=25%,bypass=32", extra=["-np", "2", "-t", THREADS],
                      ready_timeout=60) as server:
        base = server.base
        # before the first request: every counter zero (the start-up probe decode after the warmup does not count)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            m0 = _metrics(r.read().decode())
        assert m0 and {k: v for k, v in m0.items() if k not in ("slots", "bank_bytes") and v != 0} == {}, m0

        errors: list[str] = []

        def ask(i: int) -> None:
            body = json.dumps({"prompt": f"request {i}: " + "the quick brown fox " * (1 + i * 5),
                               "n_predict": 12, "seed": i}).encode()
            req = urllib.request.Request(base + "/completion", data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    if r.status != 200 or "content" not in json.loads(r.read()):
                        errors.append(f"request {i}: bad answer")
            except OSError as e:
                errors.append(f"request {i}: {e}")

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors
        assert server.proc.poll() is None
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            m = _metrics(r.read().decode())
        with urllib.request.urlopen(base + "/props", timeout=10) as r:
            props = json.loads(r.read())
    assert props.get("moe_cache") == {"mode": "engine", "policy": "quality", "rule": "threshold", "tau": 0.15,
                                      "evict": "lfu", "admit": True, "host": "ram", "n_slots": N_EXPERT // 4,
                                      "n_expert": N_EXPERT,
                                      "group_max": N_EXPERT // 4 // K, "bank_bytes": int(m["bank_bytes"]),
                                      "async": False}, props.get("moe_cache")
    assert m, "no moe_cache counters in /metrics"
    assert m["slots"] == N_EXPERT // 4 and m["bank_bytes"] > 0
    assert m["calls"] == m["token_layers"] * K > 0
    assert m["hits"] + m["misses"] == m["calls"]
    assert m["fetches"] + m["substitutions"] + m["drops"] == m["misses"]
    assert m["bypass_token_layers"] > 0  # the longer prompts took the prefill bypass
    assert m["background_experts"] <= m["copied_experts"] and m["copy_wait_seconds"] >= 0
    assert 0 < m["copied_experts"]
    # decode graphs were reused (the route op runs in a reused graph and reads the cache's current state)
    reused = [int(n) for n in re.findall(r"graphs reused =\s+(\d+)", log_path.read_text())]
    assert reused and max(reused) > 0


@pytest.mark.build
def test_engine_budget_is_the_harness_plan(engine_models: dict[str, Path], engine_text: Path, tmp_path: Path,
                                           engine_build: Build) -> None:
    """One budget arithmetic: the engine's vram= plan (logged in exact bytes) is harness.domain.plan's formula.
    The harness computes the same bytes per slot and the same banks from the GGUF file; given the engine's weights
    on the device and its context, budgets at the byte where a slot is gained or lost give the same slots on both
    sides, and the same minimum (the spare slot, the padding and the reserve counted alike)."""
    from harness.core.errors import HarnessError
    from harness.domain.plan import budget_terms
    from harness.parsers.cache_plan import CachePlan, parse_cache_plan
    from harness.parsers.gguf_model import read_model_info

    def run(model: Path, vram: int, reserve: int, name: str) -> tuple[Run, CachePlan]:
        r = run_ppl(engine_build, model, engine_text, tmp_path / name,
                    f"mode=engine,policy=quality,vram={vram},vram_reserve={reserve}", ubatch=1,
                    extra=("--fit", "off", "-lv", "4"), want="expert cache plan")
        return r, parse_cache_plan(r.output)

    for arch in ("qwen3moe", "hy_v3"):
        model = engine_models[arch]
        ours = budget_terms(read_model_info(model))
        _, first = run(model, 1 << 20, 0, f"{arch}-probe")
        assert (first.per_slot, first.banks) == (ours.per_slot, ours.n_banks), first
        for reserve in (0, 12345):
            terms = dataclasses.replace(ours, weights=first.weights, context=first.context, reserve=reserve)
            for vram, want in ((terms.fixed + 20 * terms.per_slot, 20), (terms.fixed + 20 * terms.per_slot - 1, 19),
                               (terms.minimum, K)):
                assert terms.slots(vram) == want
                r, logged = run(model, vram, reserve, f"{arch}-{reserve}-{vram}")
                check_ok(r)
                assert r.stats is not None
                assert logged.slots == want == r.stats["config"]["slots"], logged
            with pytest.raises(HarnessError, match="too small"):
                terms.slots(terms.minimum - 1)
            r = run_ppl(engine_build, model, engine_text, tmp_path / f"{arch}-{reserve}-small",
                        f"mode=engine,vram={terms.minimum - 1},vram_reserve={reserve}", ubatch=1,
                        extra=("--fit", "off"), want="need at least")
            m = re.search(r"need at least (\d+) MiB", r.output)
            assert r.returncode != 0 and m, r.output[-2000:]
            assert int(m.group(1)) == math.ceil(terms.minimum / 2**20)


@pytest.mark.build
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("policy", "ubatch"), [("quality", 1), ("speed", 1), ("fetch-all", 1), ("fetch-all", None)])
def test_engine_host_file_equals_ram(arch: str, policy: str, ubatch: int | None, engine_models: dict[str, Path],
                                     engine_text: Path, tmp_path: Path, stock_build: Build,
                                     engine_build: Build) -> None:
    """host=file reads missed experts from the model file instead of the expert tensors in memory: the same
    decisions and the same copies as host=ram, bit-identical output; through the file, fetch-all is stock."""
    model = engine_models[arch]
    spec = f"mode=engine,policy={policy},slots=25%"
    ram = run_ppl(engine_build, model, engine_text, tmp_path / "ram", spec, ubatch=ubatch)
    fil = run_ppl(engine_build, model, engine_text, tmp_path / "file", spec + ",host=file", ubatch=ubatch,
                  extra=("-lv", "4"))
    check_ok(ram)
    check_ok(fil)
    assert ram.stats is not None and fil.stats is not None
    same_decisions(ram.stats, fil.stats)
    assert fil.logits == ram.logits
    assert "host=file: missed experts are read from 1 model file(s)" in fil.output
    for k in ("copied_experts", "copy_bytes", "bank_bytes"):
        assert fil.stats["engine"][k] == ram.stats["engine"][k], k
    assert fil.stats["engine"]["copied_experts"] > 0
    if policy == "fetch-all":
        stock = run_ppl(stock_build, model, engine_text, tmp_path / "stock", ubatch=ubatch, nll=False)
        check_ok(stock)
        assert fil.logits == stock.logits


@pytest.mark.build
def test_tau_file_is_the_file_tier_threshold(engine_models: dict[str, Path], engine_text: Path, tmp_path: Path,
                                             engine_build: Build) -> None:
    """rule=threshold with host=file: misses read from the model file use tau_file. Emulate simulates the file
    tier (reads nothing) and takes exactly the engine's decisions; tau_file=X with host=file decides as tau=X
    from memory, and a larger tau_file substitutes more (fewer reads); without tau_file, tau applies."""
    model = engine_models["qwen3moe"]
    base = "policy=quality,slots=25%"
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", f"mode=emulate,{base},host=file,tau_file=0.3",
                  ubatch=1)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,{base},host=file,tau_file=0.3",
                  ubatch=1)
    ram = run_ppl(engine_build, model, engine_text, tmp_path / "ram", f"mode=emulate,{base},tau=0.3", ubatch=1)
    dflt = run_ppl(engine_build, model, engine_text, tmp_path / "dflt", f"mode=emulate,{base},host=file", ubatch=1)
    q = run_ppl(engine_build, model, engine_text, tmp_path / "q", f"mode=emulate,{base}", ubatch=1)
    for r in (emu, eng, ram, dflt, q):
        check_ok(r)
        assert r.stats is not None
    assert emu.stats is not None and eng.stats is not None and ram.stats is not None
    assert dflt.stats is not None and q.stats is not None
    same_decisions(emu.stats, eng.stats)
    same_decisions(emu.stats, ram.stats)
    assert emu.stats["config"]["tau_file"] == pytest.approx(0.3) and emu.stats["config"]["host"] == "file"
    assert emu.logits == ram.logits and eng.nll is not None and emu.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)
    same_decisions(dflt.stats, q.stats)
    assert emu.stats["total"]["fetches"] < q.stats["total"]["fetches"]
    assert emu.stats["total"]["substitutions"] > q.stats["total"]["substitutions"]


@pytest.mark.build
@pytest.mark.parametrize(("policy", "ubatch", "io"), [("quality", 1, ""), ("speed", 1, ""), ("fetch-all", 1, ""),
                                                      ("fetch-all", None, ""), ("quality", 1, ",async=off"),
                                                      ("speed", 1, ",readers=1,direct=off")])
def test_three_tiers(policy: str, ubatch: int | None, io: str, engine_models: dict[str, Path], engine_text: Path,
                     tmp_path: Path, stock_build: Build, engine_build: Build) -> None:
    """Three tiers (slots <- RAM tier <- model file, ram_slots=): the engine takes exactly emulate's decisions; every
    expert loaded into a slot came from the RAM tier or was read from the file through it, and the bytes read
    from the file are exactly those loads (reader threads or the route step's synchronous reads, O_DIRECT or
    buffered); fetch-all through three tiers is stock bit for bit."""
    model = engine_models["qwen3moe"]
    spec = f"policy={policy},slots=25%,host=file,ram_slots=50%"
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=ubatch)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,{spec}{io}", ubatch=ubatch)
    check_ok(emu)
    check_ok(eng)
    assert emu.stats is not None and eng.stats is not None
    same_decisions(emu.stats, eng.stats)
    t, e = eng.stats["total"], eng.stats["engine"]
    assert eng.stats["config"]["ram_slots"] > 0
    assert t["ram_tier_loads"] > 0 and t["file_loads"] > 0, t
    if ubatch == 1:
        assert t["ram_tier_loads"] + t["file_loads"] == t["fetches"] + t["admissions"] == e["copied_experts"], (t, e)
        per_expert = e["copy_bytes"] // e["copied_experts"]
        assert e["file_read_bytes"] == t["file_loads"] * per_expert, (t, e)
    assert eng.nll is not None and emu.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)
    if policy == "fetch-all":
        stock = run_ppl(stock_build, model, engine_text, tmp_path / "stock", ubatch=ubatch, nll=False)
        check_ok(stock)
        assert eng.logits == stock.logits


@pytest.mark.build
def test_three_tiers_thresholds(engine_models: dict[str, Path], engine_text: Path, tmp_path: Path,
                                engine_build: Build) -> None:
    """Three tiers, rule=threshold: tau for misses the RAM tier holds, tau_file for misses read from the file; a
    larger tau_file reads fewer experts from the file; emulate == engine; ram_slots below k is one line."""
    model = engine_models["qwen3moe"]
    base = "policy=quality,slots=25%,host=file,ram_slots=50%"
    runs = {}
    for name, extra in (("same", ""), ("file", ",tau_file=0.6")):
        for mode in ("emulate", "engine"):
            r = run_ppl(engine_build, model, engine_text, tmp_path / f"{name}-{mode}", f"mode={mode},{base}{extra}",
                        ubatch=1)
            check_ok(r)
            assert r.stats is not None
            runs[name, mode] = r.stats
        same_decisions(runs[name, "emulate"], runs[name, "engine"])
    same, hi = runs["same", "engine"]["total"], runs["file", "engine"]["total"]
    assert hi["file_loads"] < same["file_loads"] and hi["substitutions"] > same["substitutions"], (same, hi)
    bad = run_ppl(engine_build, model, engine_text, tmp_path / "bad", "mode=engine,slots=25%,host=file,ram_slots=2",
                  ubatch=1, nll=False, want="ram_slots")
    assert bad.returncode != 0 and "bad value '2' for key 'ram_slots'" in bad.output, bad.output[-2000:]


@pytest.mark.build
@pytest.mark.parametrize("io", ["readers=1,direct=off", "readers=8,direct=auto", "readers=3,direct=on"])
def test_engine_host_file_readers_and_direct(io: str, engine_models: dict[str, Path], engine_text: Path,
                                             tmp_path: Path, engine_build: Build) -> None:
    """host=file with one or several reader threads, O_DIRECT or buffered reads: host=ram's decisions and output
    bit for bit; every byte copied into the banks was read from the file (the per-tier counters), and the log
    names the readers and the kind of read (the test's file system, ext4 here, accepts O_DIRECT)."""
    model = engine_models["qwen3moe"]
    spec = "mode=engine,policy=quality,slots=25%,admit=on"
    ram = run_ppl(engine_build, model, engine_text, tmp_path / "ram", spec, ubatch=1)
    fil = run_ppl(engine_build, model, engine_text, tmp_path / "file", f"{spec},host=file,{io}", ubatch=1,
                  extra=("-lv", "4"))
    check_ok(ram)
    check_ok(fil)
    assert ram.stats is not None and fil.stats is not None
    same_decisions(ram.stats, fil.stats)
    assert fil.logits == ram.logits
    e = fil.stats["engine"]
    assert e["background_experts"] > 0  # admissions went through the readers too
    assert e["file_read_bytes"] == e["copy_bytes"] > 0 and e["file_reads"] == e["copies"], e
    assert e["file_read_ns"] > 0 and ram.stats["engine"]["file_reads"] == 0
    readers = int(io.split(",")[0].split("=")[1])
    direct = "direct=off" not in io
    assert f"{readers} reader thread(s)" in fil.output, fil.output[-3000:]
    assert ("O_DIRECT reads" in fil.output) == direct and "O_DIRECT refused" not in fil.output


@pytest.mark.build
@pytest.mark.parametrize("where", ["open", "read"])
def test_engine_host_file_direct_refused(where: str, engine_models: dict[str, Path], engine_text: Path,
                                         tmp_path: Path, engine_build: Build) -> None:
    """A file system that refuses O_DIRECT, at open or at the first read (played by a test variable: this kernel's
    tmpfs accepts O_DIRECT): direct=auto says so once and reads buffered, with the same output; direct=on refused
    at open is a one-line error."""
    model = engine_models["qwen3moe"]
    spec = "mode=engine,policy=quality,slots=25%,host=file"
    env = {"LLAMA_MOE_CACHE_TEST_DIRECT": f"refuse-{where}"}
    ref = run_ppl(engine_build, model, engine_text, tmp_path / "ref", spec, ubatch=1)
    auto = run_ppl(engine_build, model, engine_text, tmp_path / "auto", spec, ubatch=1, extra=("-lv", "4"), env=env)
    check_ok(ref)
    check_ok(auto)
    said = "O_DIRECT refused for" if where == "open" else "O_DIRECT reads of"
    assert auto.output.count(said) == 1 and "buffered reads" in auto.output, auto.output[-3000:]
    assert auto.logits == ref.logits
    assert auto.stats is not None and auto.stats["engine"]["file_read_bytes"] == auto.stats["engine"]["copy_bytes"]
    if where == "open":
        on = run_ppl(engine_build, model, engine_text, tmp_path / "on", spec + ",direct=on", ubatch=1, nll=False,
                     want="refuses O_DIRECT", env=env)
        assert on.returncode != 0 and "direct=on: the file system of" in on.output, on.output[-2000:]


@pytest.mark.build
def test_engine_host_file_refusals(engine_models: dict[str, Path], engine_text: Path, tmp_path: Path,
                                   engine_build: Build) -> None:
    """host=file: a clear one-line error without mmap, in emulate mode, or for a bad value."""
    model = engine_models["qwen3moe"]
    cases = [("mode=engine,slots=25%,host=file", ("--load-mode", "none"), "not mapped from a file"),
             ("mode=emulate,slots=25%,host=file,readers=2", (), "emulate reads nothing"),
             ("mode=engine,slots=25%,policy=quality,tau_file=0.3", (), "tau_file is the threshold for misses read"),
             ("mode=engine,slots=25%,host=disk", (), "'host'"),
             ("mode=engine,slots=25%,readers=4", (), "readers= sets how host=file reads"),
             ("mode=engine,slots=25%,host=file,readers=0", (), "'readers'"),
             ("mode=engine,slots=25%,host=file,direct=yes", (), "'direct'")]
    for i, (spec, extra, want) in enumerate(cases):
        r = run_ppl(engine_build, model, engine_text, tmp_path / str(i), spec, ubatch=1, nll=False, want=want,
                    extra=extra)
        assert r.returncode != 0 and want in r.output, (spec, r.output[-1500:])


def _sample_during(args: list[str], env: dict[str, str], read: Callable[[int], int],
                   every: float) -> tuple[int, list[int], str]:
    """Run args, sampling read(pid) (bytes) every `every` seconds until it exits; (returncode, samples, output)."""
    import time

    samples: list[int] = []
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        deadline = time.time() + 300
        while p.poll() is None and time.time() < deadline:
            try:
                samples.append(read(p.pid))
            except (OSError, LookupError):
                break
            time.sleep(every)
        out = p.communicate(timeout=60)[0]
    return int(p.returncode), samples, out


def _rss_during(args: list[str], env: dict[str, str]) -> tuple[int, list[int], str]:
    """Run args, sampling the resident set size every 5 ms; (returncode, samples, output)."""
    import psutil

    def rss(pid: int) -> int:
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error as e:
            raise LookupError(pid) from e

    return _sample_during(args, env, rss, 0.005)


@pytest.mark.build
def test_engine_host_file_keeps_the_experts_out_of_ram(engine_text: Path, tmp_path: Path,
                                                       engine_build: Build) -> None:
    """host=file: decode reads missed experts from the file, and the mapped expert tensors are released, so the
    process holds its banks, the non-expert weights and its buffers, not the experts (which host=ram, copying
    from the mapping, brings into memory)."""
    from harness.parsers.gguf_model import read_model_info

    if b"__asan_init" in engine_build.tool("llama-perplexity").read_bytes():
        pytest.skip("an AddressSanitizer build (scripts/sanitize.sh): its shadow memory and quarantine are in the RSS")
    model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=64, n_expert_used=K, n_layer=2, n_embd=512,
                                        n_ff_exp=512, dtype="q8_0", seed=9), tmp_path / "big-experts.gguf")
    info = read_model_info(model)
    assert info.expert_bytes > 8 * info.non_expert_bytes  # the experts are most of the file
    rss: dict[str, int] = {}
    for host in ("ram", "file"):
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
        stats = tmp_path / f"stats-{host}.json"
        env["LLAMA_MOE_CACHE"] = f"mode=engine,policy=quality,slots=25%,host={host},stats={stats}"
        args = [str(engine_build.tool("llama-perplexity")), "-m", str(model), "-f", str(engine_text), "-c",
                str(N_CTX), "-b", str(N_CTX), "-ub", "1", "--chunks", str(N_CHUNKS), "-t", THREADS, "-nr"]
        rc, samples, out = _rss_during(args, env)
        assert rc == 0, out[-2000:]
        assert len(samples) > 20, "the run was too short to sample"
        rss[host] = sorted(samples[len(samples) // 2:])[len(samples[len(samples) // 2:]) // 2]  # median, 2nd half
        doc = json.loads(stats.read_text())
        banks = doc["engine"]["bank_bytes"]
        assert doc["engine"]["copied_experts"] > 0
    # the banks, the non-expert weights and the runtime (binary, libraries, KV cache, compute buffers)
    assert rss["file"] < banks + info.non_expert_bytes + 96 * 2**20, (rss, banks, info.non_expert_bytes)
    assert rss["ram"] - rss["file"] > info.expert_bytes // 2, (rss, info.expert_bytes)


def _anon_peak(args: list[str], env: dict[str, str]) -> tuple[int, int, str]:
    """Run args, sampling the process's RssAnon every 2 ms; (returncode, peak bytes, output)."""
    def anon(pid: int) -> int:
        m = re.search(r"^RssAnon:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
        return int(m[1]) * 1024 if m else 0

    rc, samples, out = _sample_during(args, env, anon, 0.002)
    return rc, max(samples, default=0), out


@pytest.mark.build
def test_engine_host_file_fill_keeps_reader_buffers_small(engine_text: Path, tmp_path: Path,
                                                         engine_build: Build) -> None:
    """host=file with O_DIRECT: the initial fill reads one run of all the slots per expert tensor, a slice at a time,
    so that each reader thread's aligned buffer stays the one slice (and two blocks) that the ram= budget counts for
    it. Before, a reader's buffer grew to the whole run and stayed (studymoe: 12 MiB over the plan beside 466 slots in
    4 readers); here a run is 64 slices of 272 KiB: 17 MiB a buffer. The same run with buffered reads (direct=off,
    straight into the banks) is the yardstick."""
    if b"__asan_init" in engine_build.tool("llama-perplexity").read_bytes():
        pytest.skip("an AddressSanitizer build (scripts/sanitize.sh): its shadow memory and quarantine are in the RSS")
    model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=64, n_expert_used=K, n_layer=2, n_embd=512,
                                        n_ff_exp=512, dtype="q8_0", seed=9), tmp_path / "big-experts.gguf")
    peak: dict[str, int] = {}
    for direct in ("on", "off"):
        stats = tmp_path / f"stats-{direct}.json"
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
        env["LLAMA_MOE_CACHE"] = f"mode=engine,policy=fetch-all,slots=100%,host=file,readers=4,direct={direct}," \
                                 f"stats={stats}"
        args = [str(engine_build.tool("llama-perplexity")), "-m", str(model), "-f", str(engine_text), "-c",
                str(N_CTX), "-b", str(N_CTX), "-ub", "1", "--chunks", "1", "-t", THREADS, "-nr"]
        rc, peak[direct], out = _anon_peak(args, env)
        if rc != 0 and direct == "on" and "O_DIRECT" in out and "refused" in out:
            pytest.skip("this file system refuses O_DIRECT reads")
        assert rc == 0, out[-2000:]
        assert json.loads(stats.read_text())["engine"]["bank_bytes"] > 64 * 2**20  # every expert, read at the fill
    # 5 buffers of one slice and two blocks: 1.4 MiB; a whole run in each of them: 85 MiB
    assert peak["on"] - peak["off"] < 6 * 2**20, peak


@pytest.mark.build
def test_engine_host_file_warmup_reads_no_expert(tmp_path: Path, engine_build: Build) -> None:
    """A warmup decode (llama_set_warmup: every expert selected, to page the weights in) with host=file computes
    with the banks' spare slot instead of reading every expert through the mapping: the resident set stays put
    (a program against the patched libllama; before the fix it grew by the experts, 104 -> 308 MB here)."""
    import shutil

    from harness.parsers.gguf_model import read_model_info

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    tree = engine_build.bin_dir.parents[1]
    exe = tmp_path / "warmup_reads"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wno-deprecated-declarations", f"-I{tree / 'include'}",
                    f"-I{tree / 'ggml' / 'include'}", str(Path(__file__).parent / "cpp" / "warmup_reads.cpp"),
                    f"-L{engine_build.bin_dir}", "-lllama", "-lggml", "-lggml-base",
                    f"-Wl,-rpath,{engine_build.bin_dir}", "-o", str(exe)], check=True)
    model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=64, n_expert_used=K, n_layer=2, n_embd=512,
                                        n_ff_exp=512, dtype="f16", seed=3), tmp_path / "warm.gguf")
    experts = read_model_info(model).expert_bytes
    env = {**os.environ, "LLAMA_MOE_CACHE": "mode=engine,slots=25%,host=file"}
    out = subprocess.run([str(exe), str(model)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rc, before, after = (int(x) for x in out.stdout.split())
    assert rc == 0 and after - before < experts // 8, (before, after, experts)


@pytest.mark.build
def test_engine_ram_budget(engine_models: dict[str, Path], engine_text: Path, tmp_path: Path,
                           engine_build: Build) -> None:
    """ram=SIZE (host=file): the slots that fit in a RAM budget next to the non-expert weights (exactly the GGUF's
    non-expert bytes), the context and the reserve, by the same formula as vram= and the harness; a budget below k
    slots names its minimum; ram= without host=file, or with vram=, is refused."""
    from harness.core.errors import HarnessError
    from harness.domain.plan import ram_budget_terms
    from harness.parsers.cache_plan import parse_cache_plan
    from harness.parsers.gguf_model import read_model_info

    model = engine_models["qwen3moe"]
    info = read_model_info(model)
    ours = ram_budget_terms(info, 0, 0)  # the process's own terms too: the reader buffers, the runtime's baseline
    probe = run_ppl(engine_build, model, engine_text, tmp_path / "probe",
                    "mode=engine,host=file,ram=64M,vram_reserve=0", ubatch=1, extra=("-lv", "4"),
                    want="expert cache plan")
    check_ok(probe)
    logged = parse_cache_plan(probe.output)
    assert logged.key == "ram" and logged.budget == 64 << 20, logged
    assert logged.weights == info.non_expert_bytes  # the experts stay in the file
    assert (logged.readers, logged.baseline) == (ours.readers, ours.baseline) and ours.readers > 0, logged
    terms = dataclasses.replace(ours, weights=info.non_expert_bytes, context=logged.context)
    assert logged.slots == terms.slots(64 << 20) == N_EXPERT
    for ram, want in ((terms.fixed + 20 * terms.per_slot, 20), (terms.fixed + 20 * terms.per_slot - 1, 19)):
        r = run_ppl(engine_build, model, engine_text, tmp_path / str(ram),
                    f"mode=engine,policy=quality,host=file,ram={ram},vram_reserve=0", ubatch=1)
        check_ok(r)
        assert r.stats is not None and r.stats["config"]["slots"] == want == terms.slots(ram)
    with pytest.raises(HarnessError):
        terms.slots(terms.minimum - 1)
    small = run_ppl(engine_build, model, engine_text, tmp_path / "small",
                    f"mode=engine,host=file,ram={terms.minimum - 1},vram_reserve=0", ubatch=1, nll=False,
                    want="need at least")
    assert small.returncode != 0 and "ram=" in small.output and "is too small" in small.output
    for spec, want in (("mode=engine,ram=64M", "needs host=file"), ("mode=engine,host=file,ram=64M,vram=64M",
                                                                   "two budgets")):
        bad = run_ppl(engine_build, model, engine_text, tmp_path / want.replace(" ", "-"), spec, ubatch=1, nll=False,
                      want=want)
        assert bad.returncode != 0 and want in bad.output


@pytest.mark.build
@pytest.mark.parametrize("copier", ["async=off", "async=thread", "host=file"])
def test_engine_copy_failure_ends_the_compute(copier: str, engine_models: dict[str, Path], engine_text: Path,
                                              tmp_path: Path, engine_build: Build) -> None:
    """A copy into the banks that fails mid-run (the engine's test hook LLAMA_MOE_CACHE_TEST_COPY_FAIL_AFTER: every
    copy after the process's first N fails, as a failed device copy would; ggml's backends abort on a real one), in
    the synchronous copier, the copy thread and the reader threads of host=file: one line names the copy, and the
    compute ends (llama_decode returns 2, the tool fails to decode) instead of computing with a slot that does not
    hold its expert; no perplexity is reported. N=50 is past the initial fill (a few copies). The same on a device:
    tests/test_device.py."""
    r = run_ppl(engine_build, engine_models["qwen3moe"], engine_text, tmp_path,
                f"mode=engine,policy=speed,slots=25%,{copier}", ubatch=1, nll=False,
                env={"LLAMA_MOE_CACHE_TEST_COPY_FAIL_AFTER": "50"}, want="failed to decode")
    assert r.output.count("failed (a test fault: LLAMA_MOE_CACHE_TEST_COPY_FAIL_AFTER=50)") == 1, r.output[-3000:]
    assert "every decode now fails" in r.output
    assert "failed to decode" in r.output and "Final estimate" not in r.output, r.output[-3000:]


@pytest.mark.build
def test_output_paths_checked_first_and_fit_probe_writes_nothing(engine_models: dict[str, Path],
                                                                 engine_text: Path, tmp_path: Path,
                                                                 engine_build: Build) -> None:
    """stats= and profile_out= that cannot be written fail at start with one line (not after the run, exit 0);
    llama.cpp's -fit probe context (a memory-fitting dry run, on by default) writes no statistics: while the real
    run decodes, no stats file exists yet."""
    import time

    model = engine_models["qwen3moe"]
    for key in ("stats", "profile_out"):
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
        env["LLAMA_MOE_CACHE"] = f"mode=emulate,slots=25%,{key}=/proc/none/x"
        bad = subprocess.run([str(engine_build.tool("llama-perplexity")), "-m", str(model), "-f", str(engine_text),
                              "-c", str(N_CTX), "--chunks", "1", "-t", THREADS], env=env, capture_output=True,
                             text=True, timeout=120)
        assert bad.returncode != 0 and f"{key}=/proc/none/x: cannot write there" in bad.stdout + bad.stderr
    long_text = tmp_path / "long.txt"
    long_text.write_text(engine_text.read_text() * 8)
    stats = tmp_path / "s.json"
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    env["LLAMA_MOE_CACHE"] = f"mode=emulate,slots=25%,stats={stats}"
    log = tmp_path / "run.log"
    with log.open("w") as f:
        p = subprocess.Popen([str(engine_build.tool("llama-perplexity")), "-m", str(model), "-f", str(long_text),
                              "-c", str(N_CTX), "-ub", "1", "-t", "1"], env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 60
            while "calculating perplexity" not in log.read_text(errors="replace") and time.time() < deadline:
                time.sleep(0.01)
            assert p.poll() is None, "the run ended before it could be observed"
            assert not stats.exists(), "a statistics file exists before the run's end (the -fit probe wrote it)"
        finally:
            p.kill()
            p.wait()


# ---- K-quants (issue 12, item 2) ------------------------------------------------------------------------------
# Q4_K_M and Q6_K models made by the pinned tree's llama-quantize from a synthetic f16 model (harness.tools.quantize).
# K-quants pack 256 weights per block, so the matrices' rows are 256 wide. Q4_K_M mixes types per tensor (gate/up
# experts Q4_K, the last layer's down experts Q6_K): the banks copy each tensor in its own type. On x86 with AVX2
# ggml repacks Q4_K (not Q6_K) into its CPU_REPACK layout unless --no-repack: every engine run passes -nr, and
# the stock runs it is compared with too (repacked kernels sum in another order).
KQ_ARCHS = ("qwen3moe", "hy_v3")
KQ_EXPERT, KQ_K = 32, 4
NR = ("-nr",)


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory: pytest.TempPathFactory, stock_build: Build,
                 patched_build: Build) -> Callable[[str, str], Path]:
    """(arch, qtype) -> the K-quant model, made on first use."""
    try:
        tool = find_quantize({"stock": stock_build, "patched": patched_build})
    except HarnessError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("kquant-models")
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, qtype: str) -> Path:
        if (arch, qtype) not in made:
            spec = SynthSpec(arch=arch, n_expert=KQ_EXPERT, n_expert_used=KQ_K, n_layer=N_LAYER, n_embd=256,
                             n_ff_exp=256, n_ff_shexp=256, seed=5)
            made[(arch, qtype)] = write_kquant_model(spec, qtype, out / f"{arch}-{qtype}.gguf", tool)
        return made[(arch, qtype)]

    return get


def _expert_types(model: Path) -> dict[str, set[str]]:
    """tensor kind (ffn_down_exps, ...) -> the set of ggml types its layers are stored in."""
    import gguf

    kinds: dict[str, set[str]] = {}
    for t in gguf.GGUFReader(model).tensors:
        if t.name.endswith("_exps.weight"):
            kinds.setdefault(t.name.split(".")[2], set()).add(t.tensor_type.name)
    return kinds


@pytest.mark.build
@pytest.mark.parametrize("arch", KQ_ARCHS)
def test_kquant_models_mix_types(arch: str, kquant_model: Callable[[str, str], Path]) -> None:
    """The test models are the K-quants they are named after: no fallback types; Q4_K_M mixes Q4_K and Q6_K."""
    q4km, q6k = _expert_types(kquant_model(arch, "Q4_K_M")), _expert_types(kquant_model(arch, "Q6_K"))
    assert q4km["ffn_down_exps"] == {"Q4_K", "Q6_K"}  # layer 0 in Q4_K, the last layer in Q6_K
    for kind in ("ffn_gate_up_exps",) if arch == "hy_v3" else ("ffn_gate_exps", "ffn_up_exps"):
        assert q4km[kind] == {"Q4_K"}, kind
    assert all(types == {"Q6_K"} for types in q6k.values()), q6k


@pytest.mark.build
@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("arch", KQ_ARCHS)
def test_kquant_off_and_emulate_fetch_all_are_stock(arch: str, qtype: str, kquant_model: Callable[[str, str], Path],
                                                    engine_text: Path, tmp_path: Path, stock_build: Build,
                                                    patched_build: Build) -> None:
    """Cache unset, mode=off and emulate fetch-all: the stock output bit for bit (weights repacked where ggml
    repacks them: emulate copies nothing)."""
    model = kquant_model(arch, qtype)
    stock = run_ppl(stock_build, model, engine_text, tmp_path / "stock", nll=False)
    skip_if_stock_crashes(stock)
    unset = run_ppl(patched_build, model, engine_text, tmp_path / "unset")
    off = run_ppl(patched_build, model, engine_text, tmp_path / "off", "mode=off")
    emu = run_ppl(patched_build, model, engine_text, tmp_path / "emu", "mode=emulate,policy=fetch-all,slots=25%")
    for r in (stock, unset, off, emu):
        check_ok(r)
    assert unset.logits == stock.logits and off.logits == stock.logits and emu.logits == stock.logits
    assert unset.nll is not None and emu.nll is not None and emu.nll.tobytes() == unset.nll.tobytes()
    assert emu.stats is not None
    t = emu.stats["total"]
    assert t["misses"] > 0 and t["fetches"] == t["misses"] and t["substitutions"] == 0


@pytest.mark.build
@pytest.mark.parametrize("ubatch", [1, None])
@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("arch", KQ_ARCHS)
def test_kquant_engine_fetch_all_is_stock(arch: str, qtype: str, ubatch: int | None,
                                          kquant_model: Callable[[str, str], Path], engine_text: Path, tmp_path: Path,
                                          stock_build: Build, engine_build: Build) -> None:
    """Engine fetch-all copies every missed expert, each tensor in its own K-quant type, into the banks: the stock
    output bit for bit, one-token ubatches (the banks) and the default (the full tensors)."""
    model = kquant_model(arch, qtype)
    stock = run_ppl(stock_build, model, engine_text, tmp_path / "stock", ubatch=ubatch, nll=False, extra=NR)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", "mode=engine,policy=fetch-all,slots=25%",
                  ubatch=ubatch, extra=NR)
    check_ok(stock)
    check_ok(eng)
    assert eng.logits == stock.logits
    assert eng.stats is not None
    t, e = eng.stats["total"], eng.stats["engine"]
    assert t["misses"] > 0 and t["fetches"] == t["misses"] and t["substitutions"] == 0
    if ubatch == 1:
        assert e["copied_experts"] == t["fetches"]
    else:
        assert 0 < e["copied_experts"] <= t["fetches"]


@pytest.mark.build
@pytest.mark.parametrize("policy", ["quality", "speed"])
@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("arch", KQ_ARCHS)
def test_kquant_engine_equals_emulate(arch: str, qtype: str, policy: str, kquant_model: Callable[[str, str], Path],
                                      engine_text: Path, tmp_path: Path, engine_build: Build) -> None:
    """The presets on a K-quant: the engine decides exactly as emulate mode and gives its values."""
    model = kquant_model(arch, qtype)
    spec = f"policy={policy},slots=25%"
    emu = run_ppl(engine_build, model, engine_text, tmp_path / "emu", f"mode=emulate,{spec}", ubatch=1, extra=NR)
    eng = run_ppl(engine_build, model, engine_text, tmp_path / "eng", f"mode=engine,{spec}", ubatch=1, extra=NR)
    check_ok(emu)
    check_ok(eng)
    assert emu.stats is not None and eng.stats is not None
    check_consistent(eng.stats)
    same_decisions(emu.stats, eng.stats)
    t, e = eng.stats["total"], eng.stats["engine"]
    assert t["misses"] > 0 and t["fetches"] > 0
    if policy == "speed":
        assert t["substitutions"] > 0
    else:  # the quality preset never substitutes a first choice nor a weight >= tau
        assert t["subst_first_choice"] == 0 and t["max_subst_weight"] < eng.stats["config"]["tau"]
    assert e["copied_experts"] == t["fetches"] + t["admissions"]
    assert emu.nll is not None and eng.nll is not None
    np.testing.assert_allclose(eng.nll, emu.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.build
@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_repacked_refused(qtype: str, kquant_model: Callable[[str, str], Path], engine_text: Path,
                                 tmp_path: Path, stock_build: Build, engine_build: Build) -> None:
    """Where ggml repacks the K-quant (stock's load log shows a CPU_REPACK buffer: Q4_K on AVX2; Q6_K on ARM with
    i8mm or dotprod), the engine without -nr refuses with the --no-repack message and runs with -nr; where it does
    not, the engine runs without -nr."""
    model = kquant_model("qwen3moe", qtype)
    stock = run_ppl(stock_build, model, engine_text, tmp_path / "stock", nll=False, want="model buffer size",
                    extra=("-lv", "4"))
    skip_if_stock_crashes(stock)
    check_ok(stock)
    repacked = "CPU_REPACK model buffer size" in stock.output
    if qtype == "Q4_K_M" and re.search(r"\bavx2\b", Path("/proc/cpuinfo").read_text(errors="replace")):
        assert repacked, "ggml repacks Q4_K on an AVX2 CPU"
    spec = "mode=engine,policy=quality,slots=25%"
    plain = run_ppl(engine_build, model, engine_text, tmp_path / "plain", spec, ubatch=1, want="--no-repack"
                    if repacked else "")
    if repacked:
        if plain.returncode in (-4, 132):
            pytest.skip("this CPU crashes (SIGILL) in ggml's repack kernels while loading, before the engine's check")
        assert plain.returncode != 0
        assert "repacked CPU layout): pass --no-repack (-nr)" in plain.output, plain.output[-2000:]
        nr = run_ppl(engine_build, model, engine_text, tmp_path / "nr", spec, ubatch=1, extra=NR)
        check_ok(nr)
        assert nr.stats is not None and nr.stats["engine"]["copied_experts"] > 0
    else:
        check_ok(plain)
        assert plain.stats is not None and plain.stats["engine"]["copied_experts"] > 0


@pytest.mark.build
@pytest.mark.parametrize("qtype", KQUANTS)
def test_kquant_host_file(qtype: str, kquant_model: Callable[[str, str], Path], engine_text: Path, tmp_path: Path,
                          stock_build: Build, engine_build: Build) -> None:
    """host=file reads each missed K-quant expert from the model file, every tensor at its own offset and size:
    host=ram's decisions, copies and output; fetch-all through the file is stock."""
    model = kquant_model("qwen3moe", qtype)
    spec = "mode=engine,policy=quality,slots=25%"
    ram = run_ppl(engine_build, model, engine_text, tmp_path / "ram", spec, ubatch=1, extra=NR)
    fil = run_ppl(engine_build, model, engine_text, tmp_path / "file", spec + ",host=file", ubatch=1,
                  extra=(*NR, "-lv", "4"))
    fa = run_ppl(engine_build, model, engine_text, tmp_path / "fa", "mode=engine,policy=fetch-all,slots=25%,host=file",
                 ubatch=1, nll=False, extra=NR)
    stock = run_ppl(stock_build, model, engine_text, tmp_path / "stock", ubatch=1, nll=False, extra=NR)
    for r in (ram, fil, fa, stock):
        check_ok(r)
    assert "host=file: missed experts are read from 1 model file(s)" in fil.output
    assert ram.stats is not None and fil.stats is not None
    same_decisions(ram.stats, fil.stats)
    assert fil.logits == ram.logits
    for k in ("copied_experts", "copy_bytes", "bank_bytes"):
        assert fil.stats["engine"][k] == ram.stats["engine"][k], k
    assert fa.logits == stock.logits


@pytest.mark.build
def test_kquant_budget_is_the_harness_plan(kquant_model: Callable[[str, str], Path], engine_text: Path,
                                           tmp_path: Path, engine_build: Build) -> None:
    """vram= on Q4_K_M, whose layers' experts differ in size (the last layer's down experts in Q6_K): the engine's
    bytes per slot (all MoE layers) and banks are the harness's, and a budget at the byte where a slot is gained
    gives the same slots on both sides."""
    from harness.domain.plan import budget_terms
    from harness.parsers.cache_plan import CachePlan, parse_cache_plan
    from harness.parsers.gguf_model import read_model_info

    model = kquant_model("qwen3moe", "Q4_K_M")
    ours = budget_terms(read_model_info(model))

    def run(vram: int, name: str) -> CachePlan:
        r = run_ppl(engine_build, model, engine_text, tmp_path / name, f"mode=engine,vram={vram},vram_reserve=0",
                    ubatch=1, nll=False, extra=(*NR, "--fit", "off", "-lv", "4"), want="expert cache plan")
        return parse_cache_plan(r.output)

    first = run(64 << 20, "probe")
    assert (first.per_slot, first.banks) == (ours.per_slot, ours.n_banks), first
    terms = dataclasses.replace(ours, weights=first.weights, context=first.context, reserve=0)
    for vram, want in ((terms.fixed + 10 * terms.per_slot, 10), (terms.fixed + 10 * terms.per_slot - 1, 9)):
        assert terms.slots(vram) == want
        assert run(vram, f"b{vram}").slots == want


@pytest.mark.build
def test_fit_probe_reports_nothing_and_agrees_with_the_run(engine_models: dict[str, Path], engine_text: Path,
                                                           engine_build: Build) -> None:
    """llama.cpp's -fit probe (on by default) loads without mmap and counts the weights differently: it must not
    print the cache's errors (the real context prints them, once) nor refuse a budget the real context accepts; a
    budget too small is one error and a non-zero exit, with -fit on as with -fit off."""
    from harness.parsers.cache_plan import parse_cache_plan

    model = engine_models["qwen3moe"]

    def ppl(spec: str, *extra: str) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
        env["LLAMA_MOE_CACHE"] = spec
        r = subprocess.run([str(engine_build.tool("llama-perplexity")), "-m", str(model), "-f", str(engine_text),
                            "-c", str(N_CTX), "-b", str(N_CTX), "--chunks", "1", "-t", THREADS, *extra], env=env,
                           capture_output=True, text=True, timeout=120)
        return r.returncode, r.stdout + r.stderr

    rc, out = ppl("mode=bogus")
    assert rc != 0 and out.count("bad value 'bogus' for key 'mode'") == 1, out[-3000:]
    assert "common_fit_params" not in out, out[-3000:]
    rc, out = ppl("mode=engine,vram=1M,vram_reserve=0", "--fit", "off", "-lv", "4")
    assert rc == 0, out[-3000:]
    plan = parse_cache_plan(out)
    assert plan.key == "vram", plan
    weights, context, reserve, per_slot, banks, k = (plan.weights, plan.context, plan.reserve, plan.per_slot,
                                                     plan.banks, plan.k)
    need = weights + context + reserve + (k + 1) * per_slot + 512 * banks  # the smallest budget the run accepts
    for vram, ok in ((need, True), (need - 1, False)):
        for fit in ("on", "off"):
            rc, out = ppl(f"mode=engine,vram={vram},vram_reserve=0", "--fit", fit)
            assert (rc == 0) == ok, (vram, fit, out[-3000:])
            assert out.count("is too small") == (0 if ok else 1), (vram, fit, out[-3000:])
            assert "common_fit_params" not in out, out[-3000:]


@pytest.mark.build
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a file whose writes fail: ENOSPC)")
@pytest.mark.parametrize(("key", "what"), [("stats", "the statistics"), ("profile_out", "the profile"),
                                           ("trace", "the router trace")])
def test_final_write_failure_exits_nonzero(key: str, what: str, engine_models: dict[str, Path], engine_text: Path,
                                           engine_build: Build) -> None:
    """stats=, profile_out= and trace= pass the check at start on /dev/full, then their write at the end fails (no
    space): one line naming the key, the path and the reason, exit status 1 (not 0), and the tool's last lines
    are not lost (the exit handler runs after common's log drain)."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    env["LLAMA_MOE_CACHE"] = f"mode=emulate,slots=25%,{key}=/dev/full"
    r = subprocess.run([str(engine_build.tool("llama-perplexity")), "-m", str(engine_models["qwen3moe"]), "-f",
                        str(engine_text), "-c", str(N_CTX), "-b", str(N_CTX), "--chunks", "1", "-t", THREADS],
                       env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    line = f"{key}=/dev/full: {what} could not be written at the end of the run (No space left on device)"
    assert out.count(line) == 1, out[-3000:]
    assert "Final estimate: PPL" in out, out[-3000:]


@pytest.mark.build
@pytest.mark.parametrize(("spec", "reason"), [("mode=bogus", "bad value 'bogus' for key 'mode'"),
                                              ("mode=engine,vram=1000", "vram=0 MiB is too small")])
def test_bench_says_why_without_verbose(spec: str, reason: str, engine_models: dict[str, Path],
                                        engine_build: Build) -> None:
    """llama-bench silences llama.cpp's log unless -v: the cache's reason for refusing a context still reaches
    stderr, once (patch 0008), next to llama-bench's own 'failed to create context'; the exit status is 1."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    env["LLAMA_MOE_CACHE"] = spec
    r = subprocess.run([str(engine_build.tool("llama-bench")), "-m", str(engine_models["qwen3moe"]), "-p", "8", "-n",
                        "0", "-t", THREADS, "-r", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count(reason) == 1 and "failed to create context" in r.stderr, r.stderr
