"""Plans: how many expert slots per MoE layer fit in a device budget next to the non-expert weights (or in a RAM
limit, `compare --ram`), where `harness compare` puts the weights, the points of a sweep, and the runs of a
command."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from harness.core.errors import HarnessError
from harness.core.sizes import Size, format_bytes
from harness.parsers.gguf_model import ModelInfo
from harness.tools.requests import BenchRequest, CacheSpec, PerplexityRequest, Placement


def slots_for_residency(fraction: float, n_expert: int, at_least: int = 1) -> int:
    """Resident experts per MoE layer of a residency (a fraction of each layer's experts), the one rule of the
    project: what the engine gives `slots=P%` with P = 100 * fraction (src/llama, `residency_n`: `std::lround` of
    `n_expert * P / 100` in double, P parsed as a float). Halves round away from zero, as `lround` (and
    `floor(x + 0.5)`) do, not to even as Python's `round()` does: 10 experts at 25% are 3 slots, not 2. The result
    is at most n_expert and at least `at_least`: the engine's floor is 1; the commands that plan their slots pass
    k (the experts used per token), which the engine requires."""
    pct: float = struct.unpack("f", struct.pack("f", fraction * 100))[0]  # the engine parses P into a float
    x = n_expert * pct / 100.0
    n = math.floor(x)
    if x - n >= 0.5:  # exact for x >= 0: lround, without floor(x + 0.5)'s error just below a half
        n += 1
    return max(at_least, min(n_expert, n))


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


# The engine's budget arithmetic (src/llama: the budget planner that logs `expert cache plan:`), the one formula of
# the project: harness info, compare, sweep and study plan with it, and tests/test_engine.py (the tests named
# *budget*) runs the engine with vram= and ram= and checks, through harness.parsers.cache_plan, that this formula,
# given the engine's own inputs, gives its slots and its minimum.
BANK_PADDING = 512  # bytes of alignment padding counted per cache bank (one bank per routed-expert tensor and layer)
ENGINE_RESERVE = 256 * 2**20  # the engine's default vram_reserve (docs/expert-cache-engine.md)
KV_CELL_PAD = 256  # llama.cpp pads the KV cache's cells to a multiple of this
# ram= only (the process's own memory besides weights, context, reserve and banks): the runtime's baseline
# (LLAMA_EXPERT_RUNTIME_BASELINE, src/llama/llama-expert-machine.h) and the reader threads' buffers: with host=file
# each of `readers` threads (the spec's readers=, default ENGINE_READERS) and the calling thread keep one aligned
# buffer of the largest expert slice plus two O_DIRECT blocks (llama-expert-io.cpp). tests/test_machine.py holds the
# constants equal to the C++.
RUNTIME_BASELINE = 48 * 2**20
ENGINE_READERS = 4
READ_ALIGN = 4096


def reader_buffer_bytes(info: ModelInfo, readers: int = ENGINE_READERS) -> int:
    """The reader buffers of a ram= plan with host=file: (readers + 1) x (the largest expert slice + 2 x 4096)."""
    if readers <= 0 or not info.expert_tensors:
        return 0
    return (readers + 1) * (max(info.bytes_per_expert_tensor.values()) + 2 * READ_ALIGN)


@dataclass(frozen=True)
class BudgetTerms:
    """The terms of the arithmetic, in bytes: fixed = weights + context + reserve + readers + baseline + one spare
    slot + padding; slots = min(n_expert, (vram - fixed) // per_slot), at least k."""

    weights: int  # the weights on the device (with --cpu-moe: the non-expert weights)
    context: int  # the context's memory on the device (KV cache); the engine measures it
    reserve: int  # the compute reserve (the spec's vram_reserve)
    per_slot: int  # one expert in every bank of every MoE layer
    n_banks: int  # routed-expert tensors over all MoE layers
    n_expert: int
    k: int
    where: str = "on the device"  # where the budget is: "in RAM" for ram= (compare --ram)
    readers: int = 0  # ram=: the reader threads' buffers (reader_buffer_bytes)
    baseline: int = 0  # ram=: the runtime's baseline (RUNTIME_BASELINE)

    @property
    def fixed(self) -> int:
        return (self.weights + self.context + self.reserve + self.readers + self.baseline + self.per_slot
                + BANK_PADDING * self.n_banks)

    def total(self, slots: int) -> int:
        """The bytes a plan of `slots` per layer holds (what the engine checks against the memory cgroup)."""
        return self.fixed + slots * self.per_slot

    @property
    def minimum(self) -> int:
        return self.fixed + self.k * self.per_slot

    def slots(self, vram: int) -> int:
        """Slots per MoE layer in `vram` bytes; HarnessError naming the minimum when fewer than k fit."""
        if self.per_slot <= 0 or vram < self.minimum:
            raise HarnessError(
                f"a budget of {format_bytes(vram)} is too small for this model: its weights {self.where} take "
                f"{format_bytes(self.weights)}"
                + (f", the context {format_bytes(self.context)}" if self.context else "")
                + (f", the reserve {format_bytes(self.reserve)}" if self.reserve else "")
                + (f", the reader buffers {format_bytes(self.readers)}" if self.readers else "")
                + (f", the runtime's baseline {format_bytes(self.baseline)}" if self.baseline else "")
                + f", and the cache needs at least {self.k} experts per layer plus a spare slot; the minimum is "
                f"{format_bytes(self.minimum)}")
        return min(self.n_expert, (vram - self.fixed) // self.per_slot)


def budget_terms(info: ModelInfo, reserve: int = 0, context: int = 0) -> BudgetTerms:
    """The terms for a model whose routed experts stay in host memory (--cpu-moe): the non-expert weights on the
    device. `reserve` is the harness's --reserve: the compute reserve plus whatever KV cache it should cover."""
    return BudgetTerms(weights=info.non_expert_bytes, context=context, reserve=reserve,
                       per_slot=info.bytes_per_expert * info.n_moe_layers,
                       n_banks=len(info.expert_tensors), n_expert=info.n_expert, k=info.n_expert_used)


def ram_budget_terms(info: ModelInfo, reserve: int, context: int, readers: int = ENGINE_READERS) -> BudgetTerms:
    """The terms of the engine's `ram=` budget (host=file): every non-expert weight and the context in RAM, the
    routed experts in the file, and the process's own memory (the reader buffers of `readers` threads, the runtime's
    baseline); the same formula as `vram=`."""
    return BudgetTerms(weights=info.non_expert_bytes, context=context, reserve=reserve,
                       per_slot=info.bytes_per_expert * info.n_moe_layers, n_banks=len(info.expert_tensors),
                       n_expert=info.n_expert, k=info.n_expert_used, where="in RAM (the routed experts excepted)",
                       readers=reader_buffer_bytes(info, readers), baseline=RUNTIME_BASELINE)


def kv_cache_bytes(info: ModelInfo, n_ctx: int) -> int:
    """The KV cache of a context of `n_ctx` tokens (f16, cells padded as llama.cpp pads them): an estimate from
    the GGUF metadata; the engine measures its own."""
    cells = -(-max(n_ctx, 1) // KV_CELL_PAD) * KV_CELL_PAD
    return cells * info.kv_bytes_per_cell


@dataclass(frozen=True)
class RamPlan:
    """`harness compare --ram`: the limit of the memory cgroup every run is made inside, and the engine's ram=
    budget in it (`terms`, with the context estimated for `n_ctx` tokens)."""

    limit: int
    terms: BudgetTerms
    n_ctx: int
    slots_per_layer: int

    @property
    def cache_bytes(self) -> int:
        return self.slots_per_layer * self.terms.per_slot


def plan_ram(info: ModelInfo, limit: int, reserve: int, n_ctx: int) -> RamPlan:
    """The slots per layer of `ram=limit` (HarnessError naming the minimum when fewer than k fit)."""
    terms = ram_budget_terms(info, reserve, kv_cache_bytes(info, n_ctx))
    return RamPlan(limit, terms, n_ctx, int(terms.slots(limit)))


def budget_bytes(info: ModelInfo, vram: Size, reserve: int = 0) -> int:
    """A percentage budget means: the non-expert weights, the reserve and the cache's own overhead (a spare slot
    and padding) plus that share of the expert weights, so that that share of the experts is resident."""
    if vram.bytes is not None:
        return vram.bytes
    assert vram.fraction is not None
    terms = budget_terms(info, reserve)
    return terms.fixed + int(info.expert_bytes * vram.fraction)


def plan_slots(info: ModelInfo, vram: Size, reserve: int = 0) -> SlotPlan:
    """Slots per layer that the engine would give this budget (budget_terms, BudgetTerms.slots): what is left after
    the non-expert weights, `reserve` (KV cache, compute buffers) and the cache's spare slot and padding, capped at
    n_expert. A budget that cannot hold k slots per layer (k = experts used per token) is an error that names the
    minimum."""
    budget = budget_bytes(info, vram, reserve)
    slots = budget_terms(info, reserve).slots(budget)
    return SlotPlan(budget, reserve, info.non_expert_bytes, info.bytes_per_expert, info.n_moe_layers,
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
    ram: RamPlan | None = None  # compare --ram: every run inside one memory cgroup

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
    family: str = ""  # harness frontier: the family of policies the point belongs to (catalogue.FRONTIER_FAMILIES)
    preset: str | None = None  # a preset (`policy=...`) run as such; rule, tau, admit and evict then describe it
    params: tuple[tuple[str, str], ...] = ()  # further spec keys (j, m, alpha, renorm, kmin, t, light)

    def cache(self, stats: str | None) -> CacheSpec:
        if self.preset is not None:
            return CacheSpec("emulate", self.preset, self.slots, stats, self.params)
        extra: list[tuple[str, str]] = [("rule", self.rule)]
        if self.tau is not None:
            extra.append(("tau", f"{self.tau:g}"))
        extra += [("evict", self.evict), ("admit", self.admit), *self.params]
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
