"""End to end: `harness compare` with the real stock and patched builds (CPU) on generated models and on the
project's trained model. Skipped without the builds (run ./build.sh) or without the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.core.records import SCHEMA_VERSION
from harness.domain.options import CompareOptions
from harness.orchestration.compare import compare, default_model


def _check_records(out: Path) -> list[dict[str, object]]:
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for rec in records:
        assert rec["schema_version"] == SCHEMA_VERSION
        prov = rec["provenance"]
        assert isinstance(prov, dict)
        for key in ("pin", "pin_sha256", "patch_series", "binaries", "backend", "gpu", "argv", "started"):
            assert key in prov, key
        assert str(prov["pin"]).startswith("llama-cpp-python-")
        assert any(k.startswith("patched/") for k in prov["binaries"])  # type: ignore[union-attr]
    return records


@pytest.mark.build
def test_compare_on_a_generated_model(stock_build: Build, patched_build: Build, synth_models: dict[str, Path],
                                      synth_text_file: Path, tmp_path: Path) -> None:
    opts = CompareOptions(out=tmp_path / "out", model=synth_models["qwen3moe"], text=synth_text_file,
                          policies=("fetch-all", "substitute-all"), runs=2, n_ctx=128, chunks=4, n_prompt=32,
                          n_gen=8, threads=2, argv=("pytest",))
    res = compare(opts)
    records = _check_records(opts.out)
    keys = [r["key"] for r in records if r["kind"] != "meta"]
    assert keys[:4] == ["ppl:full", "ppl:stock", "ppl:fetch-all", "ppl:substitute-all"]
    assert "bench:stock:0" in keys and "bench:stock:1" in keys
    q = {r.config: r for r in res.quality}
    # the patched build with the cache off computes exactly what stock computes
    assert q["full"].ppl == q["stock"].ppl
    assert not any("must agree" in w for w in res.warnings)
    fetch_all, sub_all = q["fetch-all"], q["substitute-all"]
    assert fetch_all.delta is not None and sub_all.delta is not None
    # fetch-all computes every selected expert: the same NLL on every token
    assert fetch_all.delta.ci_contains_zero and fetch_all.delta.delta_pct == 0.0
    assert fetch_all.cache is not None and fetch_all.cache.substitution_rate == 0.0
    # substitute-all changes the computation (on random weights its sign is not predictable)
    assert sub_all.cache is not None and sub_all.cache.substitution_rate is not None
    assert sub_all.cache.substitution_rate > 0 and sub_all.delta.delta_pct != 0.0
    assert (opts.out / "report.md").read_text().startswith("# harness compare")
    # resume: nothing is redone
    again = compare(opts)
    assert again.n_run == 0 and again.n_resumed == res.n_run


@pytest.mark.build
def test_compare_on_the_trained_model(stock_build: Build, patched_build: Build, tmp_path: Path) -> None:
    try:
        model = default_model()
    except HarnessError as e:
        pytest.skip(str(e))
    opts = CompareOptions(out=tmp_path / "out", model=model, policies=("fetch-all", "substitute-all"),
                          speed=False, n_ctx=256, chunks=12, threads=2, argv=("pytest",))
    res = compare(opts)
    _check_records(opts.out)
    q = {r.config: r for r in res.quality}
    assert q["fetch-all"].delta is not None and q["fetch-all"].delta.ci_contains_zero
    assert q["substitute-all"].delta is not None and not q["substitute-all"].delta.ci_contains_zero
    assert q["substitute-all"].delta.delta_pct > 0
