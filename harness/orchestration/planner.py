"""The planner of `harness compare`: where the weights go under one budget, and the run matrix.

Runs (keys are the resume keys):
- quality, on the same text and tokens: `ppl:full` (patched build, cache off: the full model),
  `ppl:stock` (the stock build, the same placement: must agree with `ppl:full`), and `ppl:<policy>` (patched
  build, cache in emulate mode with the planned slots);
- speed: `bench:<config>:<rep>` for rep in 0..runs-1, config in stock and every policy (engine mode);
  each repetition runs every config once, in an order that alternates between repetitions (ABBA), so
  slow drift of the machine affects all configurations alike.
"""

from __future__ import annotations

from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.sizes import Size, format_bytes
from harness.domain.catalogue import FULL, STOCK, policy_cache_spec
from harness.domain.costmodel import stock_gpu_moe_layers
from harness.domain.options import CompareOptions
from harness.domain.plan import ComparePlan, RunSpec, budget_bytes, plan_slots
from harness.orchestration.executor import safe_name
from harness.parsers.gguf_model import ModelInfo
from harness.tools.runners import BenchRequest, CacheSpec, PerplexityRequest, Placement

DEFAULT_RESIDENCY = Size(fraction=0.25)


def _n_cpu_moe_for(info: ModelInfo, gpu_moe_layers: int) -> int:
    """--n-cpu-moe N puts the experts of layers 0..N-1 on the CPU (by layer index, dense layers included),
    so keeping the last `gpu_moe_layers` MoE layers on the device means N = index of the first of them."""
    if gpu_moe_layers >= info.n_moe_layers:
        return 0
    if gpu_moe_layers <= 0:
        return info.n_layers
    return info.moe_layers[info.n_moe_layers - gpu_moe_layers]


def plan_compare(info: ModelInfo, vram: Size | None, *, reserve_bytes: int = 0,
                 host_available_bytes: int | None = None) -> ComparePlan:
    """Stock: non-expert weights on the device plus as many whole MoE layers of experts as fit;
    patched: non-expert weights plus cache slots in the same budget, every expert tensor in host memory."""
    notes: list[str] = []
    size = vram
    if size is None:
        size = DEFAULT_RESIDENCY
        notes.append(f"no --vram given: using the budget that keeps about {DEFAULT_RESIDENCY}"
                     " of the experts resident")
    budget = budget_bytes(info, size, reserve_bytes)
    if budget >= info.total_bytes + reserve_bytes:
        notes.append(f"the budget ({format_bytes(budget)}) holds the whole model ({format_bytes(info.total_bytes)})"
                     ": nothing is offloaded, both builds run fully on the device and the cache has nothing "
                     "to do; pass a smaller --vram to compare offloading")
    slots = plan_slots(info, Size(bytes=budget), reserve=reserve_bytes)
    if slots.slots_per_layer <= info.n_expert_used:
        notes.append(f"only {slots.slots_per_layer} slots per layer for {info.n_expert_used} experts per token: "
                     "every resident expert is in use by almost every token, so eviction has little and background "
                     "admission no room to act; give a larger --vram to see admission work")
    gpu_layers = stock_gpu_moe_layers(info, budget, reserve_bytes)
    stock = Placement(n_cpu_moe=_n_cpu_moe_for(info, gpu_layers))
    # all expert tensors stay in host memory, unless the budget holds them all (then as stock: nothing offloaded)
    patched = Placement(n_cpu_moe=0 if gpu_layers >= info.n_moe_layers else info.n_layers)
    per_layer = info.bytes_per_expert * info.n_expert
    host_stock = (info.n_moe_layers - gpu_layers) * per_layer
    host_patched = info.expert_bytes if patched.n_cpu_moe else 0
    if host_available_bytes is not None:
        for who, need in (("stock", host_stock), ("patched", host_patched)):
            if need > host_available_bytes:
                notes.append(f"{who}: the host-side experts ({format_bytes(need)}) exceed the available RAM "
                             f"({format_bytes(host_available_bytes)}): they will stream from disk through "
                             "mmap, and speed will mostly measure the disk")
    return ComparePlan(info, budget, slots, gpu_layers, stock, patched, host_stock, host_patched, tuple(notes))


def model_of(opts: CompareOptions) -> Path:
    if opts.model is None:
        raise HarnessError("no model given")  # compare() fills in the default; run_compare needs one
    return opts.model


def plan_runs(opts: CompareOptions, plan: ComparePlan) -> list[RunSpec]:
    """The run matrix, in execution order: quality runs first, then interleaved speed repetitions."""
    runs: list[RunSpec] = []
    slots = plan.slots.slots_per_layer
    model = model_of(opts)
    if opts.quality and opts.text is not None:
        def ppl(config: str, placement: Placement, cache: CacheSpec | None, dump: bool) -> PerplexityRequest:
            return opts.perplexity_request(model, opts.text or Path(), placement, cache=cache,
                                           nll_dump=opts.out / "nll" / f"{safe_name(config)}.bin" if dump else None,
                                           label=config)

        runs.append(RunSpec("ppl:full", "ppl", "patched", FULL, None,
                            ppl=ppl(FULL, plan.patched, CacheSpec("off"), True)))
        runs.append(RunSpec("ppl:stock", "ppl", "stock", STOCK, None, ppl=ppl(STOCK, plan.patched, None, False)))
        for pol in opts.policies:
            stats = str(opts.out / "stats" / f"ppl-{safe_name(pol)}.json")
            runs.append(RunSpec(f"ppl:{pol}", "ppl", "patched", pol, None,
                                ppl=ppl(pol, plan.patched, policy_cache_spec(pol, "emulate", slots, stats), True)))
    if opts.speed:
        configs = [STOCK, *opts.policies]
        for rep in range(opts.runs):
            order = configs if rep % 2 == 0 else list(reversed(configs))
            for config in order:
                if config == STOCK:
                    req = BenchRequest(model, plan.stock, opts.n_prompt, opts.n_gen, 1, opts.threads, label=STOCK)
                    runs.append(RunSpec(f"bench:stock:{rep}", "bench", "stock", STOCK, rep, bench=req))
                else:
                    stats = str(opts.out / "stats" / f"bench-{safe_name(config)}-{rep}.json")
                    cache = policy_cache_spec(config, opts.bench_cache_mode, slots, stats)
                    req = BenchRequest(model, plan.patched, opts.n_prompt, opts.n_gen, 1, opts.threads, cache,
                                       label=config)
                    runs.append(RunSpec(f"bench:{config}:{rep}", "bench", "patched", config, rep, bench=req))
    return runs
