"""Terminal renderers: pure functions returning rich renderables (doctor, info, compare, sweep), and the
comparison as plain text for logs and tests."""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from harness.core.sizes import format_bytes
from harness.domain.plan import SlotPlan
from harness.domain.results import CompareResult, Diagnosis, SweepResult
from harness.parsers.gguf_model import ModelInfo
from harness.report.tables import (
    RAM_COLUMNS,
    SWEEP_HEADER,
    config_label,
    estimate_cells,
    mass_line,
    num,
    plan_lines,
    quality_cells,
    ram_rows,
    speed_cells,
    speed_unit,
    sweep_cells,
)


def render_doctor(d: Diagnosis) -> Group:
    t = Table(title="moe-subst doctor", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("pin", f"{d.pin} (sha256 {d.pin_sha256[:16]}...)")
    t.add_row("source", "vendor/llama.cpp unpacked" if d.source_unpacked else "not unpacked (run ./build.sh)")
    t.add_row("patch series", f"{d.n_patches} patches, hash {d.patch_series}")
    for b in d.builds:
        if b.present:
            t.add_row(f"{b.name} build", f"{b.backend}: {b.bin_dir}\n{b.version}")
        else:
            t.add_row(f"{b.name} build", "missing (run ./build.sh)")
    t.add_row("GPU", "\n".join(d.gpus) if d.gpus else "none found (speed figures will be CPU-build figures)")
    t.add_row("nvcc", d.nvcc or "not found")
    t.add_row("host", f"{d.cpu_count} cores, {format_bytes(d.host_ram_bytes)} RAM, Python {d.python}")
    lines: list[Table | Text] = [t]
    if d.problems:
        lines.append(Text("\n".join(f"problem: {p}" for p in d.problems), style="bold red"))
    else:
        lines.append(Text("all good", style="bold green"))
    return Group(*lines)


def render_info(info: ModelInfo, slot_plan: SlotPlan | None = None) -> Group:
    t = Table(title=f"{info.path}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("architecture", f"{info.arch} ({info.name})")
    mtp = (f"; the last {info.n_nextn_layers} NextN/MTP (loaded only for MTP decoding, "
           f"{info.nextn_bytes / 2**20:.1f} MiB)" if info.n_nextn_layers else "")
    t.add_row("layers", f"{info.n_layers}, of which MoE: {info.n_moe_layers}{mtp}")
    t.add_row("experts per layer", str(info.n_expert))
    t.add_row("experts used per token", str(info.n_expert_used))
    t.add_row("shared experts", str(info.n_expert_shared))
    t.add_row("gating", info.gating + ("" if info.weights_norm is None
                                       else f", weights normalised: {'yes' if info.weights_norm else 'no'}"))
    t.add_row("expert tensors", ("merged gate_up + down" if info.merged_gate_up else "gate, up, down")
              + f" ({info.file_type})")
    t.add_row("bytes per expert", f"{format_bytes(info.bytes_per_expert)} ({info.bytes_per_expert} B)")
    t.add_row("bytes per expert tensor",
              ", ".join(f"{k}: {v} B" for k, v in sorted(info.bytes_per_expert_tensor.items())))
    t.add_row("expert weights", f"{format_bytes(info.expert_bytes)} ({info.expert_bytes} B)")
    t.add_row("non-expert weights", f"{format_bytes(info.non_expert_bytes)} ({info.non_expert_bytes} B)")
    t.add_row("file", format_bytes(info.file_bytes))
    parts: list[Table | Text] = [t]
    if slot_plan is not None:
        p = slot_plan
        text = (f"budget {format_bytes(p.budget_bytes)}: non-expert weights {format_bytes(p.non_expert_bytes)}"
                + (f" + reserve {format_bytes(p.reserve_bytes)}" if p.reserve_bytes else "")
                + f" + cache {format_bytes(p.cache_bytes)} = {p.slots_per_layer} expert slots per layer "
                f"({p.resident_fraction:.1%} of {p.n_expert} resident) x {p.n_moe_layers} MoE layers")
        if p.fits_whole_model:
            text += "\nthe whole model fits: nothing is offloaded, so stock and patched both run fully on the device"
        parts.append(Text(text))
    return Group(*parts)


def render_compare(result: CompareResult) -> Group:
    """The terminal view: plan, quality table, speed table, budget verdict, warnings."""
    parts: list[Table | Text] = [Text("\n".join(plan_lines(result.plan) + list(result.notes)))]
    if result.quality:
        t = Table(title="quality (same tokens; PPL ± one SE; delta vs the full model, 95% CI by block bootstrap)",
                  title_justify="left")
        for col in ("configuration", "PPL ± SE", "delta PPL [95% CI]", "substituted", "mass", "fetches/token"):
            t.add_column(col, justify="left" if col in ("configuration",) else "right")
        for q in result.quality:
            t.add_row(*quality_cells(q))
        parts.append(t)
    if result.speed:
        t = Table(title=f"speed ({speed_unit(result)}; mean ± 95% CI over repetitions, stock and patched "
                  "interleaved; ratio to stock with a bootstrap 95% CI)", title_justify="left")
        for col in ("configuration", "test", "mean", "± 95% CI", "n", "vs stock"):
            t.add_column(col, justify="left" if col in ("configuration", "test") else "right")
        for r in result.speed:
            t.add_row(config_label(r.config), r.test, *speed_cells(r))
        parts.append(t)
    if result.estimates:
        t = Table(title=f"ESTIMATED decode speed on a {result.estimate_profile} (cost model from the emulate runs' "
                  "fetches per token; an estimate, not a measurement)", title_justify="left")
        for col in ("configuration", "est. ms/token", "est. tokens/s", "est. vs stock"):
            t.add_column(col, justify="left" if col == "configuration" else "right")
        for e in result.estimates:
            t.add_row(*estimate_cells(e))
        parts.append(t)
    if result.budget.memory == "RAM" and result.budget.checks:
        t = Table(title="RAM: each configuration's highest peak in the memory cgroup (page cache counted) next to the "
                  "limit", title_justify="left")
        for col in RAM_COLUMNS:
            t.add_column(col, justify="left" if col == "configuration" else "right")
        for row in ram_rows(result.budget):
            t.add_row(*row)
        parts.append(t)
    parts.append(Text("budget: " + result.budget.message,
                      style="bold red" if result.budget.over else ("yellow" if not result.budget.ok else "green")))
    warnings = [w for r in result.speed for w in r.warnings] + list(result.warnings)
    if warnings:
        parts.append(Text("\n".join("warning: " + w for w in warnings), style="yellow"))
    parts.append(Text(f"results: {result.results_path} ({result.n_run} runs now, {result.n_resumed} resumed)"))
    return Group(*parts)


def render_compare_text(result: CompareResult, width: int = 120) -> str:
    """The terminal view as plain text (for logs and tests)."""
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(render_compare(result))
    out = console.file
    assert isinstance(out, io.StringIO)
    return out.getvalue()


def render_sweep(result: SweepResult) -> Group:
    t = Table(title=f"sweep on the same tokens (full model PPL {num(result.full_ppl, '.4f')}; delta vs the full "
              "model, 95% CI by block bootstrap; est. = cost model estimate on "
              f"{result.options.profile}, not measured; * = on the quality/speed frontier)", title_justify="left")
    for col in SWEEP_HEADER:
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in result.rows:
        t.add_row(*sweep_cells(r, result.frontier))
    parts: list[Table | Text] = [t, Text(mass_line(result))]
    if result.warnings:
        parts.append(Text("\n".join("warning: " + w for w in result.warnings), style="yellow"))
    parts.append(Text(f"results: {result.results_path} ({result.n_run} runs now, {result.n_resumed} resumed)"))
    return Group(*parts)
