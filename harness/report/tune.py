"""Renderers of `harness tune`'s result: the summary (the choice against the presets) and report.md."""

from __future__ import annotations

from harness.domain.tune import (
    SPEED_CV_WARN,
    CheckRow,
    SpeedCheck,
    TuneResult,
    cv_label,
    grid_verdict,
    residency_label,
    speed_cv,
)


def _delta(r: CheckRow) -> str:
    if r.exact:
        return "0 (exact: nothing substituted or dropped)"
    if r.delta is None:
        return "n/a" + (f" ({r.note})" if r.note else "")
    d = r.delta
    return f"{d.delta_pct:+.2f}% [{d.low:+.2f}, {d.high:+.2f}]"


def _measured(r: CheckRow) -> str:
    m = r.measured
    if m is None:
        return "-"
    if m.n < 2:
        return f"{m.mean:.1f} (1 run)"
    unstable = not (m.cv <= SPEED_CV_WARN)
    return f"{m.mean:.1f} ± {m.high - m.mean:.1f}" + (f" (UNSTABLE: CV {cv_label(m.cv)})" if unstable else "")


def stability_lines(res: TuneResult) -> list[str]:
    """One line when a speed measured stayed unstable after its re-run (the choice rests on it), else none."""
    bad = [c for c in res.speeds if not c.stable]
    if not bad:
        return []
    return [f"**UNSTABLE measurement**: {'; '.join(f'{c.what}, CV {cv_label(c.cv)}' for c in bad)} (above "
            f"{SPEED_CV_WARN * 100:g}% after a re-run): the choice rests on it; tune again on an idle machine.", ""]


def _speed_row(c: SpeedCheck) -> str:
    ci = c.ci
    pm = f" ± {ci.half_width:.1f}" if ci.n >= 2 else ""
    first = f"yes (first round: CV {cv_label(speed_cv(c.first))})" if c.rerun else "no"
    return (f"| {c.what} | {ci.n} | {ci.mean:.1f}{pm} | {cv_label(c.cv)} | {first} | "
            f"{'stable' if c.stable else '**UNSTABLE**'} |")


def summary_lines(res: TuneResult) -> list[str]:
    """The choice against the presets per residency: estimated speed, measured delta-PPL, measured speed."""
    o = res.opts
    lines = [f"## harness tune: {res.identity.file_name}, delta-PPL at most +{o.max_delta_pct:g}%", "",
             *stability_lines(res),
             f"Tier the misses come from: `host={res.host}`. Estimated t/s: the simulator's counters on the cost "
             "model with this machine's measured rates (an ESTIMATE, not a measurement). delta-PPL: emulate mode, "
             "paired against the full model on the same tokens, 95% block-bootstrap CI over chunks; the bound holds "
             f"on the {'95% CI upper end (--strict)' if o.strict else 'point estimate'}."
             + (f" Measured t/s: llama-bench decode with the engine, mean ± 95% CI half-width over {o.runs} "
                "processes after a discarded warm-up (the process is the sample)."
                if o.measure else " Measured t/s: not run (`--measure`)."), ""]
    for ch in res.choices:
        lines += [f"### Residency {ch.residency} ({ch.slots} of {ch.n_expert} experts per layer)", "",
                  "| configuration | policy | est. t/s | est. vs fetch-all | delta-PPL [95% CI] | within bound | "
                  "measured t/s |",
                  "|---|---|---:|---:|---|---|---:|"]
        fa = ch.est_fetch_all_tokens_per_s
        for r in res.rows:
            if r.fraction != ch.fraction or r.role not in ("chosen", "quality", "speed", "fetch-all"):
                continue
            name = "**tuned**" if r.role == "chosen" else r.role
            lines.append(f"| {name} | `{r.policy}` | {r.est_tps:.1f} | {r.est_tps / fa:.2f}x | {_delta(r)} | "
                         f"{'yes' if r.passes else 'no'} | {_measured(r)} |")
        grid = [r for r in res.rows if r.fraction == ch.fraction and r.role == "grid"]
        if grid:
            chosen = next((r for r in res.rows if r.fraction == ch.fraction and r.role == "chosen"), None)
            verdict = grid_verdict(chosen.measured if chosen else None, [r.measured for r in grid])
            lines += ["", f"The choice against the {len(grid)} fastest estimated grid points within the bound "
                      "(`--measure-grid`; delta-PPL: their rung's emulate check, where one ran), measured the same "
                      "way:", "",
                      "| grid point | est. t/s | delta-PPL of its rung | measured t/s |", "|---|---:|---|---:|"]
            lines += [f"| `{r.policy}` | {r.est_tps:.1f} | {_delta(r)} | {_measured(r)} |" for r in grid]
            lines += ["", f"The choice within 5% of the fastest measured of these: **{verdict}**."]
        lines += ["", f"Run it: `--moe-cache {ch.spec}`", ""]
    if res.out_of_sample:
        lines += ["### Out of sample", "", f"Chosen on `{o.text or 'the default text'}`, judged on "
                  f"`{res.out_of_sample[0].text}` (`--check-text`): delta-PPL paired against the full model there.", "",
                  "| residency | configuration | policy | delta-PPL there [95% CI] | within bound there |",
                  "|---|---|---|---|---|"]
        for c in res.out_of_sample:
            d = (f"{c.delta.delta_pct:+.2f}% [{c.delta.low:+.2f}, {c.delta.high:+.2f}]" if c.delta is not None
                 else ("exact" if c.within_bound else "no paired delta"))
            lines.append(f"| {c.residency} | {'**tuned**' if c.role == 'chosen' else c.role} | `{c.policy}` | {d} | "
                         f"{'yes' if c.within_bound else '**no**'} |")
        lines.append("")
    if res.profile_path is not None:
        lines.append(f"Profile: `{res.profile_path}` (`--moe-cache auto` reads it; docs/expert-cache.md, "
                     "\"Tuned profile\").")
    lines.append(f"{res.n_simulated} configurations replayed, "
                 f"{sum(1 for r in res.rows if not r.exact)} emulate runs; {res.wall_s:.0f} s in all.")
    return lines


def render_tune_markdown(res: TuneResult) -> str:
    o = res.opts
    m = res.machine
    lines = [f"# harness tune: {res.identity.file_name}", "",
             f"Model: {res.identity.name}, {res.identity.file_bytes} bytes, fingerprint {res.identity.fingerprint}, "
             f"{res.identity.n_moe_layers} MoE layers of {res.identity.n_expert} experts, "
             f"{res.identity.n_expert_used} per token. Text: {o.text}, {o.chunks or 'all'} chunks of {o.n_ctx}.", ""]
    lines += summary_lines(res)[2:]
    if res.speeds:
        lines += ["", "## Measurement stability", "",
                  "Each speed: a discarded warm-up process, then repeated processes (the process is the sample); "
                  f"pyperf's rule: a coefficient of variation (sd / mean) above {SPEED_CV_WARN * 100:g}% is unstable, "
                  "measured again once (the re-run's processes are then the measurement). tokens/s: mean ± 95% CI "
                  "half-width.", "",
                  "| measurement | processes | tokens/s | CV | re-run | verdict |", "|---|---:|---:|---:|---|---|"]
        lines += [_speed_row(c) for c in res.speeds]
    lines += ["", "## This machine", "",
              "| fact | value |", "|---|---|",
              f"| CPUs | {m.cpus} |",
              f"| memory | {m.mem_total / 2**30:.1f} GiB, {m.mem_available / 2**30:.1f} GiB available |",
              f"| GPUs | {', '.join(m.gpus) or 'none'} |"]
    if m.disk_readers:
        lines.append(f"| disk (the model file) | {m.disk_gbs:.3f} GB/s: {m.disk_expert_us:.1f} us per expert of "
                     f"{m.disk_expert_bytes} B, reads of {m.disk_read_bytes} B, {m.disk_readers} readers, "
                     f"{'O_DIRECT' if m.disk_direct else 'buffered'} |")
    lines.append(f"| host memory copy | {m.host_copy_gbs:.2f} GB/s |")
    if m.compute_ms_per_token is not None:
        lines.append(f"| decode in memory, cache off | {m.compute_ms_per_token:.3f} ms per token (the processes' "
                     "mean, \"Measurement stability\"; each estimate's span: at the ends of its 95% CI) |")
    p = res.cost_profile
    lines += ["", "The cost model's constants (`harness.domain.costmodel`):", "",
              "| constant | value | from |", "|---|---:|---|"]
    for key in ("vram_bw_gbs", "h2d_bw_gbs", "fetch_latency_us", "layer_roundtrip_us", "layer_fixed_us",
                "cpu_bw_gbs"):
        source = res.cost_sources.get(key, f"the base profile ({o.base_profile})")
        lines.append(f"| {key} | {getattr(p, key):.4g} | {source} |")
    lines += ["", "## The search", "",
              "Per rung (the miss rule and its threshold), of the speed knobs (admission, eviction, prefetch) within "
              "1% of its fastest estimate, those that lose the least gate weight; per chain the most aggressive rung "
              "within the bound by bisection; then the fastest estimate at or below the boundaries. Rows run in "
              "emulate mode:", "",
              "| residency | role | configuration | est. t/s | delta-PPL [95% CI] | within bound |",
              "|---|---|---|---:|---|---|"]
    for r in res.rows:
        lines.append(f"| {residency_label(r.fraction)} | {r.role} | `{r.name}` | {r.est_tps:.1f} | {_delta(r)} | "
                     f"{'yes' if r.passes else 'no'} |")
    lines += ["", "Each rung's best speed knobs (the simulator; lost mass: gate weight substituted or dropped per "
              "token-layer):", "",
              "| residency | chain | configuration | est. t/s | fetches/token | background/token | lost mass | "
              "hit rate |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for s in res.frontier:
        c = s.candidate
        lines.append(f"| {residency_label(c.fraction)} | {c.rung.chain or 'both'} | `{c.name}` | {s.est_tps:.1f} | "
                     f"{s.fetches:.3f} | {s.background:.3f} | {s.lost_mass:.4f} | {s.hit_rate:.3f} |")
    if res.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res.notes]
    lines += ["", f"Records: `{res.results_path}` (the runs), `sim.jsonl` (every replay's counters)."]
    return "\n".join(lines) + "\n"
