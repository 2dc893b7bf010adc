import dataclasses

import pytest

from harness.core.errors import HarnessError
from harness.domain import costmodel
from harness.domain.costmodel import Profile, TokenWork, calibrate, estimate

P = Profile(name="t", description="test", vram_bytes=24 * 2**30, vram_bw_gbs=1000.0, h2d_bw_gbs=20.0,
            fetch_latency_us=10.0, layer_roundtrip_us=50.0, layer_fixed_us=20.0, cpu_bw_gbs=40.0)


def test_hand_computed_cache_token() -> None:
    # 2 GB resident at 1000 GB/s = 2 ms; 48 layers x 20 us = 0.96 ms; 10 fetches of 3 MB at 20 GB/s = 1.5 ms
    # + 10 x 10 us = 0.1 ms; 48 round trips x 50 us = 2.4 ms.  Total 6.96 ms.
    w = TokenWork(n_layers=48, resident_bytes=2e9, fetch_bytes=10 * 3e6, fetch_ops=10, sync_layers=48)
    e = estimate(P, w)
    assert e.compute_ms == pytest.approx(2.96)
    assert e.fetch_ms == pytest.approx(1.6)
    assert e.sync_ms == pytest.approx(2.4)
    assert e.ms_per_token == pytest.approx(6.96)
    assert e.tokens_per_s == pytest.approx(1000 / 6.96)


def test_admission_overlaps_compute() -> None:
    base = TokenWork(n_layers=1, resident_bytes=1e9)  # 1 ms + 0.02 ms
    hidden = dataclasses.replace(base, admit_bytes=10e6)  # 0.5 ms of copies: hidden behind compute
    assert estimate(P, hidden).ms_per_token == pytest.approx(estimate(P, base).ms_per_token)
    visible = dataclasses.replace(base, admit_bytes=30e6)  # 1.5 ms of copies: 0.48 ms shows
    assert estimate(P, visible).admit_ms == pytest.approx(1.5 - 1.02)


def test_host_computed_experts() -> None:
    # 4 experts of 3.5 MB on the host: 14 MB at 40 GB/s = 0.35 ms, + 4 x 20 us (the default fixed cost) = 0.43 ms
    w = TokenWork(n_layers=1, resident_bytes=0, host_experts=4, host_bytes=14e6)
    e = estimate(P, w)
    assert P.host_expert_us == 20.0
    assert e.host_ms == pytest.approx(0.43)
    assert e.ms_per_token == pytest.approx(0.43 + 0.02)
    slow = dataclasses.replace(P, host_expert_us=100.0)
    assert estimate(slow, w).host_ms == pytest.approx(0.35 + 0.4)


def test_cache_work_counts_host_computes() -> None:
    from harness.parsers.gguf_model import ModelInfo

    # 2 MoE layers of 4 experts of 1000 bytes each
    info = ModelInfo(path="m.gguf", arch="qwen3moe", name="m", n_layers=2, moe_layers=(0, 1), n_expert=4,
                     n_expert_used=2, n_expert_shared=0, gating="softmax", weights_norm=True, merged_gate_up=False,
                     expert_tensors=(), expert_bytes=8000, non_expert_bytes=500, file_bytes=9000, file_type="F16")
    assert info.bytes_per_expert == 1000
    w = costmodel.cache_work(info, fetches_per_token=2.0, host_computes_per_token=3.0)
    assert (w.host_experts, w.host_bytes) == (3.0, 3.0 * info.bytes_per_expert)
    assert (w.fetch_bytes, w.fetch_ops) == (2.0 * info.bytes_per_expert, 2.0)
    assert costmodel.cache_work(info, 2.0).host_experts == 0.0


def test_profiles_have_a_host_expert_basis() -> None:
    import json
    from importlib import resources

    for n in costmodel.list_profiles():
        data = json.loads((resources.files("harness.profiles") / f"{n}.json").read_text())
        assert data["host_expert_us"] > 0 and "estimate" in data["sources"]["host_expert_us"], n


def test_stock_cpu_experts() -> None:
    w = TokenWork(n_layers=2, resident_bytes=0, sync_layers=2, cpu_expert_bytes=4e9)
    assert estimate(P, w).cpu_ms == pytest.approx(100.0)


def test_profiles_load() -> None:
    names = costmodel.list_profiles()
    for n in ("rtx3090", "rtx4090", "rtx4060ti-16g-pcie3", "h200"):
        assert n in names
        p = costmodel.load_profile(n)
        assert p.vram_bw_gbs > p.h2d_bw_gbs > 0
    with pytest.raises(HarnessError, match="unknown hardware profile"):
        costmodel.load_profile("nope")


def test_calibration_recovers_known_constants() -> None:
    truth = dataclasses.replace(P, vram_bw_gbs=800.0, h2d_bw_gbs=22.0, fetch_latency_us=7.0,
                                layer_roundtrip_us=35.0, layer_fixed_us=12.0, cpu_bw_gbs=30.0)
    runs = []
    # stock runs with different numbers of CPU MoE layers, cache runs with different fetch counts
    for cpu_layers in (0, 4, 8, 16):
        w = TokenWork(n_layers=24, resident_bytes=1e9 + (24 - cpu_layers) * 1e7, sync_layers=cpu_layers,
                      cpu_expert_bytes=cpu_layers * 1e7)
        runs.append((w, estimate(truth, w).ms_per_token))
    for fetches, ops in ((0, 0), (5, 5), (20, 12), (40, 30)):
        w = TokenWork(n_layers=24, resident_bytes=1.24e9, fetch_bytes=fetches * 1e6, fetch_ops=ops, sync_layers=24)
        runs.append((w, estimate(truth, w).ms_per_token))
    for n_layers in (12, 36):  # a second model size separates the per-layer constant
        w = TokenWork(n_layers=n_layers, resident_bytes=0.5e9 * n_layers / 12, sync_layers=n_layers)
        runs.append((w, estimate(truth, w).ms_per_token))
    fit = calibrate(P, runs)
    for field in ("vram_bw_gbs", "h2d_bw_gbs", "fetch_latency_us", "layer_roundtrip_us", "layer_fixed_us",
                  "cpu_bw_gbs"):
        assert getattr(fit, field) == pytest.approx(getattr(truth, field), rel=1e-3), field


def test_calibration_keeps_unidentifiable_constants() -> None:
    works = [TokenWork(n_layers=10, resident_bytes=b) for b in (1e9, 2e9, 3e9)]
    runs = [(w, estimate(P, w).ms_per_token) for w in works]
    fit = calibrate(P, runs)
    assert fit.vram_bw_gbs == pytest.approx(P.vram_bw_gbs, rel=1e-6)
    assert fit.h2d_bw_gbs == P.h2d_bw_gbs  # no fetch in any run: not identifiable, kept
    with pytest.raises(HarnessError):
        calibrate(P, runs[:1])
