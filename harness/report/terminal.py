"""Renderers for `harness doctor` and `harness info`: pure functions returning rich renderables."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from harness.core.sizes import format_bytes
from harness.domain.plan import SlotPlan
from harness.orchestration.doctor import Diagnosis
from harness.parsers.gguf_model import ModelInfo


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
    t.add_row("layers", f"{info.n_layers}, of which MoE: {info.n_moe_layers}")
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
