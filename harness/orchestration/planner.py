"""The planner of `harness compare`: where the weights go under one budget, and the run matrix.

Runs (keys are the resume keys):
- quality, on the same text and tokens: `ppl:full` (patched build, cache off: the full model),
  `ppl:stock` (the stock build, the same placement: must agree with `ppl:full`), and `ppl:<policy>` (patched
  build, cache in emulate mode with the planned slots);
- speed: `bench:<config>:<rep>` for rep in 0..runs-1, config in stock and every policy (engine mode);
  each repetition runs every config once, in an order that alternates between repetitions (ABBA), so
  slow drift of the machine affects all configurations alike.

With `--ram SIZE` (plan_compare_ram) every run is made inside one memory cgroup of that limit (page cache counted):
stock runs with mmap and `--repack 0` (its experts paged in from the file), the patched speed runs with
`mode=engine,host=file,slots=N` (missed experts read from the file), both on the CPU; the quality runs are the same
as without --ram, inside the same limit (with `--no-repack`). N is the plan's: the engine's ram= formula
(harness.domain.plan) applied once, for the largest context of the runs, and given to every patched run, quality and
speed alike. (Passing `ram=SIZE` to the speed runs instead let the engine size each context's banks itself, so that
one comparison could measure its quality at one residency and its speed at another.)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.sizes import Size, format_bytes
from harness.domain.catalogue import FULL, STOCK, policy_cache_spec
from harness.domain.costmodel import stock_gpu_moe_layers
from harness.domain.options import CompareOptions
from harness.domain.plan import ENGINE_RESERVE, ComparePlan, RunSpec, SlotPlan, budget_bytes, plan_ram, plan_slots
from harness.orchestration.executor import safe_name
from harness.parsers.gguf_model import ModelInfo
from harness.tools.cgroup import MemoryCgroup
from harness.tools.requests import BenchRequest, CacheSpec, PerplexityRequest, Placement

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


CPU_ONLY = Placement(n_gpu_layers=0, n_cpu_moe=0)
RAM_QUALITY_NOTE = ("--ram: the quality runs (llama-perplexity, batched prompts, emulate mode) read every expert "
                    "through mmap inside the same limit: with a model bigger than the limit they are slow (they "
                    "measure the disk); --no-quality skips them")


def ram_context(opts: CompareOptions) -> int:
    """The context the --ram plan estimates the KV cache for: the largest llama-bench test (each test is its own
    context of n_prompt or n_gen tokens), or the perplexity context without speed runs."""
    return max(opts.n_prompt, opts.n_gen) if opts.speed else opts.n_ctx


def plan_compare_ram(info: ModelInfo, limit: int, *, reserve_bytes: int = 0, n_ctx: int = 512,
                     quality: bool = True) -> ComparePlan:
    """Stock and patched on the CPU inside a memory cgroup of `limit` bytes: stock's experts through mmap, the
    engine's banks sized by its ram= formula (non-expert weights + context + reserve + slots), the rest in the
    file; the slots of that formula are every patched run's. `reserve_bytes` 0 means the engine's default
    vram_reserve."""
    reserve = reserve_bytes or ENGINE_RESERVE
    ram = plan_ram(info, limit, reserve, n_ctx)
    slots = SlotPlan(limit, reserve, info.non_expert_bytes, info.bytes_per_expert, info.n_moe_layers, info.n_expert,
                     ram.slots_per_layer)
    notes: list[str] = []
    if info.file_bytes + ram.terms.context + reserve <= limit:
        notes.append(f"the limit ({format_bytes(limit)}) holds the whole model file ({format_bytes(info.file_bytes)}) "
                     "with its context and reserve: stock need not page experts in; give a smaller --ram to compare "
                     "a model bigger than RAM")
    if quality:
        notes.append(RAM_QUALITY_NOTE)
    return ComparePlan(info, limit, slots, 0, CPU_ONLY, CPU_ONLY, info.expert_bytes, 0, tuple(notes), ram)


def ram_cache_spec(policy: str, plan: ComparePlan, stats: str) -> CacheSpec:
    """A patched speed run of `policy` under --ram: the engine reads misses from the file, with the plan's slots (the
    quality runs' slots: one residency per comparison)."""
    assert plan.ram is not None
    spec = policy_cache_spec(policy, "engine", plan.slots.slots_per_layer, stats)
    return replace(spec, extra=(*spec.extra, ("host", "file")))


def model_of(opts: CompareOptions) -> Path:
    if opts.model is None:
        raise HarnessError("no model given")  # compare() fills in the default; run_compare needs one
    return opts.model


def plan_runs(opts: CompareOptions, plan: ComparePlan, cgroup: MemoryCgroup | None = None) -> list[RunSpec]:
    """The run matrix, in execution order: quality runs first, then interleaved speed repetitions. With --ram
    (plan.ram) every run is made inside `cgroup`. Every patched run with the cache on gets the plan's slots."""
    runs: list[RunSpec] = []
    slots = plan.slots.slots_per_layer
    model = model_of(opts)
    if plan.ram is not None and cgroup is None:
        raise HarnessError("a --ram plan needs its memory cgroup")
    ppl_extra = ("--no-repack",) if plan.ram is not None else ()
    bench_extra = ("--repack", "0") if plan.ram is not None else ()
    if opts.quality and opts.text is not None:
        def ppl(config: str, placement: Placement, cache: CacheSpec | None, dump: bool) -> PerplexityRequest:
            req = opts.perplexity_request(model, opts.text or Path(), placement, cache=cache,
                                          nll_dump=opts.out / "nll" / f"{safe_name(config)}.bin" if dump else None,
                                          label=config)
            return replace(req, extra_args=req.extra_args + ppl_extra, cgroup=cgroup)

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
                    req = BenchRequest(model, plan.stock, opts.n_prompt, opts.n_gen, 1, opts.threads, label=STOCK,
                                       extra_args=bench_extra, cgroup=cgroup)
                    runs.append(RunSpec(f"bench:stock:{rep}", "bench", "stock", STOCK, rep, bench=req))
                else:
                    stats = str(opts.out / "stats" / f"bench-{safe_name(config)}-{rep}.json")
                    cache = opts.warm(ram_cache_spec(config, plan, stats) if plan.ram is not None
                                      else policy_cache_spec(config, opts.bench_cache_mode, slots, stats))
                    req = BenchRequest(model, plan.patched, opts.n_prompt, opts.n_gen, 1, opts.threads, cache,
                                       label=config, extra_args=bench_extra, cgroup=cgroup)
                    runs.append(RunSpec(f"bench:{config}:{rep}", "bench", "patched", config, rep, bench=req))
    return runs
