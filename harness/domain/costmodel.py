"""A time-per-token cost model for decode with an expert cache, and its calibration from measured runs.

Every number this module returns is an *estimate* from a hardware profile; reports must say so.

Per decoded token (ubatch of one):

    t_compute = resident_bytes / vram_bw + n_layers * layer_fixed
    t_fetch   = fetch_bytes / h2d_bw + fetch_ops * fetch_latency           (synchronous misses)
    t_sync    = sync_layers * layer_roundtrip                              (host route step per MoE layer)
    t_cpu     = cpu_expert_bytes / cpu_bw                                  (stock: experts computed on the CPU)
    t_admit   = max(0, admit_bytes / h2d_bw - t_compute)                   (background copies overlap compute)
    t_host    = host_bytes / cpu_bw + host_experts * host_expert             (light=host: misses computed on the host)
    t         = t_compute + t_fetch + t_sync + t_cpu + t_admit + t_host

A host-computed expert streams its weights from host memory (host_bytes = its bytes, at cpu_bw, as stock's CPU
experts) and pays host_expert_us on top: moving the token's activations to the host and the result back and
the CPU ops' dispatch. It is counted serially (no overlap with the device's compute assumed: an upper bound).

resident_bytes are the weights read from device memory for one token: the non-expert weights plus the k
selected experts of every MoE layer held on the device.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields, replace
from importlib import resources
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from harness.core.errors import HarnessError
from harness.core.files import refuse_special
from harness.parsers.gguf_model import ModelInfo

GB = 1e9


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    vram_bytes: int
    vram_bw_gbs: float
    h2d_bw_gbs: float
    fetch_latency_us: float
    layer_roundtrip_us: float
    layer_fixed_us: float
    cpu_bw_gbs: float
    # light=host: fixed time per expert computed on the host, beyond streaming its weights at cpu_bw_gbs
    # (an estimate; the packaged profiles give its basis); profiles written before it existed get this default
    host_expert_us: float = 20.0


def list_profiles() -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in resources.files("harness.profiles").iterdir()
                  if p.name.endswith(".json"))


def load_profile(name: str) -> Profile:
    res = resources.files("harness.profiles") / f"{name}.json"
    if not res.is_file():
        raise HarnessError(f"unknown hardware profile {name!r}; known: {', '.join(list_profiles())}")
    data = json.loads(res.read_text())
    keys = {f.name for f in fields(Profile)}
    return Profile(**{k: v for k, v in data.items() if k in keys})


def load_profile_file(path: str | Path) -> Profile:
    """A profile from a JSON file (such as `harness calibrate` writes), outside the packaged ones."""
    refuse_special(path, "the hardware profile")
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise HarnessError(f"cannot read the hardware profile {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise HarnessError(f"the hardware profile {path} is not JSON ({e})") from None
    keys = {f.name for f in fields(Profile)}
    required = {f.name for f in fields(Profile) if f.default is MISSING}
    missing = sorted(required - set(data)) if isinstance(data, dict) else sorted(required)
    if missing:
        raise HarnessError(f"the hardware profile {path} lacks {', '.join(missing)}")
    return Profile(**{k: v for k, v in data.items() if k in keys})


def profile_json(profile: Profile, sources: dict[str, str] | None = None) -> str:
    """The profile as the JSON that `load_profile` / `load_profile_file` read."""
    data: dict[str, object] = {f.name: getattr(profile, f.name) for f in fields(Profile)}
    if sources:
        data["sources"] = sources
    return json.dumps(data, indent=2) + "\n"


@dataclass(frozen=True)
class TokenWork:
    """What one decoded token costs, in bytes and operations (averages over a run)."""

    n_layers: int
    resident_bytes: float
    fetch_bytes: float = 0.0
    fetch_ops: float = 0.0
    sync_layers: float = 0.0
    cpu_expert_bytes: float = 0.0
    admit_bytes: float = 0.0
    host_experts: float = 0.0  # light=host: experts computed on the host
    host_bytes: float = 0.0  # their bytes (streamed from host memory)


@dataclass(frozen=True)
class Estimate:
    ms_per_token: float
    compute_ms: float
    fetch_ms: float
    sync_ms: float
    cpu_ms: float
    admit_ms: float
    host_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 / self.ms_per_token


def estimate(profile: Profile, work: TokenWork) -> Estimate:
    compute = work.resident_bytes / (profile.vram_bw_gbs * GB) + work.n_layers * profile.layer_fixed_us * 1e-6
    fetch = work.fetch_bytes / (profile.h2d_bw_gbs * GB) + work.fetch_ops * profile.fetch_latency_us * 1e-6
    sync = work.sync_layers * profile.layer_roundtrip_us * 1e-6
    cpu = work.cpu_expert_bytes / (profile.cpu_bw_gbs * GB)
    admit = max(0.0, work.admit_bytes / (profile.h2d_bw_gbs * GB) - compute)
    host = work.host_bytes / (profile.cpu_bw_gbs * GB) + work.host_experts * profile.host_expert_us * 1e-6
    total = compute + fetch + sync + cpu + admit + host
    return Estimate(total * 1e3, compute * 1e3, fetch * 1e3, sync * 1e3, cpu * 1e3, admit * 1e3, host * 1e3)


def cache_work(info: ModelInfo, fetches_per_token: float, fetch_ops_per_token: float | None = None,
               admissions_per_token: float = 0.0, host_computes_per_token: float = 0.0) -> TokenWork:
    """Decode with the patched engine: every MoE layer has a host round trip; misses are fetched, or computed on
    the host (light=host)."""
    bpe = info.bytes_per_expert
    return TokenWork(
        n_layers=info.n_layers,
        resident_bytes=info.non_expert_bytes + info.n_expert_used * bpe * info.n_moe_layers,
        fetch_bytes=fetches_per_token * bpe,
        fetch_ops=fetches_per_token if fetch_ops_per_token is None else fetch_ops_per_token,
        sync_layers=info.n_moe_layers,
        admit_bytes=admissions_per_token * bpe,
        host_experts=host_computes_per_token,
        host_bytes=host_computes_per_token * bpe,
    )


def stock_gpu_moe_layers(info: ModelInfo, budget_bytes: int, reserve: int = 0) -> int:
    """How many MoE layers stock llama.cpp can keep whole on the device (--n-cpu-moe for the rest)."""
    per_layer = info.bytes_per_expert * info.n_expert
    free = budget_bytes - info.non_expert_bytes - reserve
    return max(0, min(info.n_moe_layers, free // per_layer))


def stock_work(info: ModelInfo, gpu_moe_layers: int) -> TokenWork:
    """Stock llama.cpp with --n-cpu-moe: the experts of the other MoE layers are computed on the CPU,
    each such layer costing a device/host round trip."""
    bpe = info.bytes_per_expert
    cpu_layers = info.n_moe_layers - gpu_moe_layers
    return TokenWork(
        n_layers=info.n_layers,
        resident_bytes=info.non_expert_bytes + info.n_expert_used * bpe * gpu_moe_layers,
        sync_layers=cpu_layers,
        cpu_expert_bytes=info.n_expert_used * bpe * cpu_layers,
    )


# ---- calibration ---------------------------------------------------------------------------------

_FIT = ("vram_bw_gbs", "layer_fixed_us", "h2d_bw_gbs", "fetch_latency_us", "layer_roundtrip_us", "cpu_bw_gbs")


def _features(w: TokenWork) -> list[float]:
    return [w.resident_bytes, w.n_layers, w.fetch_bytes, w.fetch_ops, w.sync_layers, w.cpu_expert_bytes]


def calibrate(base: Profile, runs: Sequence[tuple[TokenWork, float]], name: str | None = None) -> Profile:
    """Fit the profile's constants to measured (work, ms per token) pairs by non-negative least squares.

    Background admission and host computes are not modelled in the fit (measure with admission off and without
    light=host). A constant whose
    feature does not vary across the runs cannot be identified; it keeps the base profile's value."""
    if len(runs) < 2:
        raise HarnessError("calibration needs at least two measured runs")
    x = np.array([_features(w) for w, _ in runs], dtype=np.float64)
    y = np.array([ms * 1e-3 for _, ms in runs], dtype=np.float64)
    base_coef = np.array([1 / (base.vram_bw_gbs * GB), base.layer_fixed_us * 1e-6, 1 / (base.h2d_bw_gbs * GB),
                          base.fetch_latency_us * 1e-6, base.layer_roundtrip_us * 1e-6, 1 / (base.cpu_bw_gbs * GB)])
    # Keep a column only if it adds information (raises the rank); the rest keep the base values.
    scale_all = np.where(np.abs(x).max(axis=0) > 0, np.abs(x).max(axis=0), 1.0)
    xs = x / scale_all
    active: list[int] = []
    for j in range(x.shape[1]):
        if not xs[:, j].any():
            continue
        if np.linalg.matrix_rank(xs[:, active + [j]], tol=1e-9) == len(active) + 1:
            active.append(j)
    fixed = [j for j in range(x.shape[1]) if j not in active]
    resid = y - x[:, fixed] @ base_coef[fixed]
    sol, _ = nnls(xs[:, active], resid)
    scale = scale_all[active]
    coef = base_coef.copy()
    coef[active] = sol / scale
    values = {
        "vram_bw_gbs": 1 / coef[0] / GB if coef[0] > 0 else float("inf"),
        "layer_fixed_us": coef[1] * 1e6,
        "h2d_bw_gbs": 1 / coef[2] / GB if coef[2] > 0 else float("inf"),
        "fetch_latency_us": coef[3] * 1e6,
        "layer_roundtrip_us": coef[4] * 1e6,
        "cpu_bw_gbs": 1 / coef[5] / GB if coef[5] > 0 else float("inf"),
    }
    return replace(base, name=name or f"{base.name}-calibrated",
                   description=f"{base.description}; calibrated from {len(runs)} runs", **values)
