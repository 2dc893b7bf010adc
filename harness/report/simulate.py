"""Renderers for `harness simulate` and `harness calibrate`: plain text or Markdown tables that say, on every
figure, what is estimated."""

from __future__ import annotations

from collections.abc import Sequence

from harness.domain.costmodel import Profile
from harness.domain.results import SimRow

ESTIMATE_NOTE = ("ms/token and speed-ups are ESTIMATES from the cost model (profile {profile}), not "
                 "measurements; stock = stock llama.cpp with the same device memory (non-expert weights + "
                 "the cache's slots), the MoE layers that do not fit computed on the CPU")
ROUTING_NOTE = ("the routing is the recorded run's: substitution's effect on later layers' routing is not "
                "replayed")
SIM_COLUMNS = ("policy", "resid.", "slots", "hit rate", "fetch/tok", "subst rate", "mass", "admit/tok",
               "ms/tok (EST)", "x fetch-all (EST)", "x stock (EST)")


def _cells(r: SimRow) -> list[str]:
    return [r.policy, r.residency, f"{r.slots}/{r.n_expert}", f"{100 * r.hit_rate:.1f}%",
            f"{r.fetches_per_token:.2f}", f"{100 * r.substitution_rate:.2f}%", f"{r.substituted_mass:.4f}",
            f"{r.admissions_per_token:.3f}", f"{r.est_ms_per_token:.3f}", f"{r.est_speedup_vs_fetch_all:.2f}x",
            f"{r.est_speedup_vs_stock:.2f}x"]


def _notes(rows: Sequence[SimRow]) -> list[str]:
    if not rows:
        return []
    profile = rows[0].profile
    stock = sorted({(r.residency, r.slots, r.stock_gpu_moe_layers, r.est_stock_ms) for r in rows})
    out = [ESTIMATE_NOTE.format(profile=profile)]
    out += [f"stock at {res} ({slots} slots' memory): {g} MoE layers' experts on the device, {ms:.3f} ms/token "
            "(EST)" for res, slots, g, ms in stock]
    out.append(ROUTING_NOTE)
    return out


def render_simulate(rows: Sequence[SimRow], *, markdown: bool = False) -> str:
    """A table of the rows and the notes that say what is estimated; plain text or Markdown."""
    if not rows:
        return "no rows\n"
    body = [_cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(SIM_COLUMNS) + " |", "|" + "---|" * len(SIM_COLUMNS)]
        lines += ["| " + " | ".join(c) + " |" for c in body]
        lines.append("")
        lines += [f"- {n}" for n in _notes(rows)]
        return "\n".join(lines) + "\n"
    widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(SIM_COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    lines = [line(SIM_COLUMNS), line(["-" * w for w in widths]), *(line(c) for c in body), ""]
    lines += [f"note: {n}" for n in _notes(rows)]
    return "\n".join(lines) + "\n"


def render_profile(p: Profile) -> str:
    return "\n".join([f"profile {p.name}: {p.description}",
                      f"  vram_bw {p.vram_bw_gbs:.1f} GB/s, h2d_bw {p.h2d_bw_gbs:.2f} GB/s, "
                      f"fetch latency {p.fetch_latency_us:.2f} us, layer round trip {p.layer_roundtrip_us:.2f} us, "
                      f"layer fixed {p.layer_fixed_us:.2f} us, cpu_bw {p.cpu_bw_gbs:.1f} GB/s"]) + "\n"
