"""Plans: how many expert slots per MoE layer fit in a device budget next to the non-expert weights, where
`harness compare` puts the weights, the points of a sweep, and the runs of a command."""

from __future__ import annotations

from dataclasses import dataclass

from harness.core.errors import HarnessError
from harness.core.sizes import Size, format_bytes
from harness.parsers.gguf_model import ModelInfo
from harness.tools.runners import BenchRequest, CacheSpec, PerplexityRequest, Placement


@dataclass(frozen=True)
class SlotPlan:
    budget_bytes: int
    reserve_bytes: int
    non_expert_bytes: int
    bytes_per_expert: int
    n_moe_layers: int
    n_expert: int
    slots_per_layer: int

    @property
    def resident_fraction(self) -> float:
        return self.slots_per_layer / self.n_expert

    @property
    def cache_bytes(self) -> int:
        return self.slots_per_layer * self.bytes_per_expert * self.n_moe_layers

    @property
    def fits_whole_model(self) -> bool:
        return self.slots_per_layer >= self.n_expert


def budget_bytes(info: ModelInfo, vram: Size) -> int:
    """A percentage budget means: the non-expert weights plus that share of the expert weights."""
    if vram.bytes is not None:
        return vram.bytes
    assert vram.fraction is not None
    return info.non_expert_bytes + int(info.expert_bytes * vram.fraction)


def plan_slots(info: ModelInfo, vram: Size, reserve: int = 0) -> SlotPlan:
    """Slots per layer = what is left of the budget after the non-expert weights and `reserve` (KV cache,
    compute buffers), shared equally by the MoE layers, capped at n_expert. A budget that cannot hold
    k slots per layer (k = experts used per token) is an error that names the minimum."""
    budget = budget_bytes(info, vram)
    per_layer_expert = info.bytes_per_expert
    free = budget - info.non_expert_bytes - reserve
    minimum = info.non_expert_bytes + reserve + info.n_expert_used * per_layer_expert * info.n_moe_layers
    if free < info.n_expert_used * per_layer_expert * info.n_moe_layers:
        raise HarnessError(
            f"a budget of {format_bytes(budget)} is too small for this model: its non-expert weights "
            f"take {format_bytes(info.non_expert_bytes)}"
            + (f" and the reserve {format_bytes(reserve)}" if reserve else "")
            + f", and the cache needs at least {info.n_expert_used} experts per layer; the minimum is "
            f"{format_bytes(minimum)}")
    slots = min(info.n_expert, free // (per_layer_expert * info.n_moe_layers))
    return SlotPlan(budget, reserve, info.non_expert_bytes, per_layer_expert, info.n_moe_layers,
                    info.n_expert, int(slots))


@dataclass(frozen=True)
class ComparePlan:
    """Where `harness compare` puts the weights under one budget (harness.orchestration.planner)."""

    info: ModelInfo
    budget_bytes: int
    slots: SlotPlan
    stock_gpu_moe_layers: int
    stock: Placement
    patched: Placement
    host_expert_bytes_stock: int
    host_expert_bytes_patched: int
    notes: tuple[str, ...]

    @property
    def fits_whole_model(self) -> bool:
        return self.slots.fits_whole_model


@dataclass(frozen=True)
class SweepPoint:
    """One cache configuration of a sweep's grid (harness.orchestration.sweep.grid_points)."""

    name: str
    rule: str
    tau: float | None
    admit: str
    evict: str
    fraction: float
    slots: int

    def cache(self, stats: str | None) -> CacheSpec:
        extra: list[tuple[str, str]] = [("rule", self.rule)]
        if self.tau is not None:
            extra.append(("tau", f"{self.tau:g}"))
        extra += [("evict", self.evict), ("admit", self.admit)]
        return CacheSpec("emulate", None, self.slots, stats, tuple(extra))


@dataclass(frozen=True)
class RunSpec:
    """One run of a command's matrix; `key` is its resume key."""

    key: str
    kind: str  # "ppl" or "bench"
    build: str  # "stock" or "patched"
    config: str  # "stock", "full", or a policy
    rep: int | None
    ppl: PerplexityRequest | None = None
    bench: BenchRequest | None = None
