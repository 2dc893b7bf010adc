"""The cells, lines and tables that the terminal and markdown renderers share: one place that says how a
number, a delta with its CI, a configuration and a plan are shown."""

from __future__ import annotations

import math
from pathlib import Path

from harness.core.project import project_root
from harness.core.sizes import format_bytes
from harness.domain.catalogue import FULL, STOCK
from harness.domain.plan import BANK_PADDING, ComparePlan
from harness.domain.results import (
    BoundCell,
    BudgetVerdict,
    CompareResult,
    EstimateRow,
    FrontierRow,
    PresetCheck,
    QualityRow,
    SpeedRow,
    SweepResult,
    SweepRow,
    TopicRow,
)
from harness.stats.intervals import DeltaPPL


def num(x: float | None, fmt: str = ".2f") -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return format(x, fmt)


def config_label(config: str) -> str:
    return {STOCK: "stock llama.cpp", FULL: "full model (cache off)"}.get(config, config)


def speed_unit(result: CompareResult) -> str:
    return "tokens/s (CPU build)" if result.gpu == "none" else "tokens/s"


def ram_plan_lines(plan: ComparePlan) -> list[str]:
    """compare --ram: the limit, the terms of the engine's ram= formula, and what each build does under it."""
    assert plan.ram is not None
    r, t, i = plan.ram, plan.ram.terms, plan.info
    return [
        f"model: {i.name} ({i.arch}), {i.n_moe_layers} MoE layers x {i.n_expert} experts, top-{i.n_expert_used}; "
        f"file {format_bytes(i.file_bytes)}: non-expert weights {format_bytes(i.non_expert_bytes)}, experts "
        f"{format_bytes(i.expert_bytes)}",
        f"RAM limit: {format_bytes(r.limit)} ({r.limit / i.file_bytes:.2f}x the file), a memory cgroup around every "
        "run (page cache counted); both builds on the CPU",
        f"budget terms (the engine's ram= formula): non-expert weights {format_bytes(t.weights)} + context "
        f"{format_bytes(t.context)} (KV cache of {r.n_ctx} tokens, estimated) + reserve {format_bytes(t.reserve)} "
        f"(vram_reserve) + reader buffers {format_bytes(t.readers)} + runtime baseline {format_bytes(t.baseline)} "
        f"+ spare slot and padding {format_bytes(t.per_slot + BANK_PADDING * t.n_banks)}; "
        f"per slot {format_bytes(t.per_slot)} (one expert in each of {i.n_moe_layers} MoE layers) -> "
        f"{r.slots_per_layer} of {i.n_expert} slots per layer ({r.slots_per_layer / i.n_expert:.1%}, "
        f"{format_bytes(r.cache_bytes)}); minimum {format_bytes(t.minimum)}",
        f"stock: mmap, --repack 0: all {format_bytes(i.expert_bytes)} of experts paged in from the file inside "
        "the limit",
        f"patched: mode=engine,host=file,slots={r.slots_per_layer}: missed experts read from the model file into the "
        f"banks; the quality runs (emulate) with the same {r.slots_per_layer} slots per layer",
    ]


RAM_COLUMNS = ("configuration", "runs", "highest peak", "limit", "peak / limit")


def ram_rows(budget: BudgetVerdict) -> list[tuple[str, str, str, str, str]]:
    """compare --ram: per configuration (in the order of its first run), the highest peak of its runs in the
    memory cgroup next to the limit."""
    peaks: dict[str, list[float | None]] = {}
    for c in budget.checks:
        peaks.setdefault(c.config, []).append(c.peak_mib)
    rows = []
    for config, ps in peaks.items():
        got = [p for p in ps if p is not None]
        top = max(got) if got else None
        rows.append((config_label(config), str(len(ps)) + ("" if len(got) == len(ps) else f" ({len(got)} measured)"),
                     f"{top:.1f} MiB" if top is not None else "-", f"{budget.budget_mib:.1f} MiB",
                     f"{top / budget.budget_mib:.0%}" if top is not None else "-"))
    return rows


def plan_lines(plan: ComparePlan) -> list[str]:
    if plan.ram is not None:
        return ram_plan_lines(plan)
    i = plan.info
    s = plan.slots
    lines = [
        f"model: {i.name} ({i.arch}), {i.n_moe_layers} MoE layers x {i.n_expert} experts, top-{i.n_expert_used}; "
        f"non-expert weights {format_bytes(i.non_expert_bytes)}, experts {format_bytes(i.expert_bytes)}",
        f"budget: {format_bytes(plan.budget_bytes)}",
        f"stock: non-expert weights + {plan.stock_gpu_moe_layers} of {i.n_moe_layers} MoE layers' experts on the "
        f"device (--n-cpu-moe {plan.stock.n_cpu_moe}); {format_bytes(plan.host_expert_bytes_stock)} of experts "
        "in host memory",
        f"patched: non-expert weights + {s.slots_per_layer} cache slots per layer ({s.resident_fraction:.1%} of the "
        f"experts, {format_bytes(s.cache_bytes)}); all {format_bytes(plan.host_expert_bytes_patched)} of experts "
        "in host memory" if plan.patched.n_cpu_moe else "patched: the whole model on the device, as stock",
    ]
    return lines


def speed_cells(r: SpeedRow) -> tuple[str, str, str, str]:
    ci = r.tokens_per_s
    mean = num(ci.mean)
    pm = f"± {num(ci.half_width)}" if math.isfinite(ci.half_width) else "(n=1, no CI)"
    vs = "-"
    if r.unstable:
        vs = "UNSTABLE (see warnings)"  # a ratio the runs cannot support is not printed as a result
    elif r.vs_stock is not None:
        vs = f"{r.vs_stock.ratio:.2f}x"
        if math.isfinite(r.vs_stock.low):
            vs += f" [{r.vs_stock.low:.2f}, {r.vs_stock.high:.2f}]"
    return mean, pm, str(ci.n), vs


def estimate_cells(e: EstimateRow) -> tuple[str, str, str, str]:
    return (config_label(e.config), f"{e.ms_per_token:.2f}", f"{1000 / e.ms_per_token:.1f}",
            f"{e.vs_stock:.2f}x" if e.vs_stock is not None else "-")


def quality_cells(r: QualityRow) -> tuple[str, str, str, str, str, str]:
    ppl = f"{r.ppl:.4f} ± {r.ppl_se:.4f}"
    if r.delta is not None:
        d = f"{r.delta.delta_pct:+.2f}% [{r.delta.low:+.2f}, {r.delta.high:+.2f}]"
    elif r.config in (FULL, STOCK):
        d = "(reference)" if r.config == FULL else "-"
    else:
        d = r.note or "-"
    c = r.cache
    sub = num(c.substitution_rate * 100, ".2f") + "%" if c and c.substitution_rate is not None else "-"
    mass = num(c.substituted_mass, ".4f") if c else "-"
    fetch = num(c.fetches_per_token, ".2f") if c else "-"
    return config_label(r.config), ppl, d, sub, mass, fetch


def md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def sweep_cells(r: SweepRow, front: tuple[str, ...]) -> list[str]:
    d = r.delta
    delta = f"{d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}]" if d is not None else "-"
    return [r.point.name, f"{r.ppl:.4f}", delta,
            num(r.substitution_rate * 100, ".2f") + "%" if r.substitution_rate is not None else "-",
            num(r.substituted_mass, ".4f"), num(r.fetches_per_token, ".2f"), num(r.est_ms_per_token, ".3f"),
            "*" if r.point.name in front else ""]


SWEEP_HEADER = ["policy", "PPL", "delta PPL [95% CI]", "substituted", "mass", "fetches/token", "est. ms/token",
                 "frontier"]


def mass_line(result: SweepResult) -> str:
    m = result.mass
    if m.correlation is None:
        return f"mass hypothesis: not tested ({m.note})"
    c = m.correlation
    return (f"mass hypothesis: Pearson r = {c.r:.3f}, 95% CI [{c.low:.3f}, {c.high:.3f}] (Fisher z), over {c.n} "
            "policies that always fetch the first choice (substituted mass vs delta PPL%)")


def shown(path: object) -> str:
    """A path as a report shows it: relative to the checkout when inside it, so reports do not name one machine."""
    p = Path(str(path))
    try:
        return str(p.resolve().relative_to(project_root()))
    except (ValueError, OSError):
        return str(p)


def delta_cell(d: DeltaPPL | None) -> str:
    return f"{d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}]" if d is not None else "-"


def topic_cells(r: TopicRow) -> list[str]:
    return [r.label, delta_cell(r.overall), delta_cell(r.after_change), delta_cell(r.elsewhere)]


# ---- frontier -----------------------------------------------------------------------------------------------

FRONTIER_HEADER = ["family", "policy", "delta PPL [95% CI]", "hit rate", "sync KiB/token", "background KiB/token",
                   "host computes/token", "est. ms/token", "frontier"]


def kib(x: float | None) -> str:
    return num(x / 1024 if x is not None else None, ".1f")


def frontier_cells(r: FrontierRow, time_front: tuple[str, ...], bytes_front: tuple[str, ...]) -> list[str]:
    """`t`: on the delta-PPL / estimated-time frontier; `b`: on the delta-PPL / bytes-moved frontier."""
    mark = ("t" if r.point.name in time_front else "") + ("b" if r.point.name in bytes_front else "")
    return [r.point.family, r.point.name, delta_cell(r.delta),
            num(r.hit_rate * 100 if r.hit_rate is not None else None, ".1f") + ("%" if r.hit_rate is not None else ""),
            kib(r.sync_bytes), kib(r.background_bytes), num(r.host_computes_per_token, ".2f"),
            num(r.est_ms_per_token, ".3f"), mark]


def bound_cell_text(c: BoundCell) -> str:
    r = c.row
    if r is None:
        return "none within the bound"
    moved = r.bytes_moved or 0.0
    extra = f", {r.host_computes_per_token:.1f} host computes" if r.host_computes_per_token else ""
    return (f"{kib(moved)} KiB ({kib(r.sync_bytes)} sync{extra}; est. {num(r.est_ms_per_token, '.3f')} ms): "
            f"`{r.point.name}` {delta_cell(r.delta)}")


def bound_table_rows(cells: tuple[BoundCell, ...], fraction: float) -> tuple[list[str], list[list[str]]]:
    """The side-by-side table of one residency: a row per family, a column per bound."""
    bounds = sorted({c.bound for c in cells if c.fraction == fraction})
    header = ["family"] + [f"at <= +{b:g}% delta PPL: fewest bytes/token" for b in bounds]
    rows: list[list[str]] = []
    for fam in dict.fromkeys(c.family for c in cells if c.fraction == fraction):
        by_bound = {c.bound: c for c in cells if c.fraction == fraction and c.family == fam}
        rows.append([fam] + [bound_cell_text(by_bound[b]) for b in bounds])
    return header, rows


def preset_line(p: PresetCheck) -> str:
    if not p.name:
        return f"{p.preset} at {p.fraction:.1%}: not run"
    if p.on_frontier:
        return f"{p.preset} at {p.fraction:.1%} is on the frontier (delta PPL vs estimated time)"
    doms = "; ".join(p.dominated_by[:5]) + (f"; and {len(p.dominated_by) - 5} more" if len(p.dominated_by) > 5
                                             else "")
    return f"{p.preset} at {p.fraction:.1%} is NOT on the frontier: dominated by {doms}"
