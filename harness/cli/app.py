"""The `harness` command: an adapter that parses arguments, calls one library function, renders.

No logic lives here. Every HarnessError becomes one line on stderr and its exit code; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO, TypeVar

from rich.console import Console

from harness.cli import options
from harness.core.errors import HarnessError
from harness.orchestration.warmstart import refuse_cold_never_fetching

console = Console()
err_console = Console(stderr=True)

Handler = Callable[[argparse.Namespace], int]
ProgressFn = Callable[[int, int, str], None]  # (done, total, label), as the commands take it
T = TypeVar("T")


def _cmd_doctor(args: argparse.Namespace) -> int:
    from harness.orchestration import doctor
    from harness.report import terminal

    diagnosis = doctor.diagnose()
    console.print(terminal.render_doctor(diagnosis))
    return 1 if diagnosis.problems else 0


def _cmd_info(args: argparse.Namespace) -> int:
    from harness.core import sizes
    from harness.domain import plan
    from harness.parsers import gguf_model
    from harness.report import terminal

    info = gguf_model.read_model_info(args.model)
    slot_plan = None
    if args.vram:
        reserve = sizes.parse_size(args.reserve, allow_percent=False).bytes if args.reserve else 0
        slot_plan = plan.plan_slots(info, sizes.parse_size(args.vram), reserve or 0)
    console.print(terminal.render_info(info, slot_plan))
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from harness.tools import synth

    spec = synth.SynthSpec(arch=args.arch, n_layer=args.layers, n_expert=args.experts,
                           n_expert_used=args.top_k, n_embd=args.embd, n_ff_exp=args.ff,
                           n_ff_shexp=args.ff_shexp, n_head=args.heads, n_head_kv=args.kv_heads,
                           n_ctx=args.ctx, n_vocab=args.vocab, dtype=args.dtype, seed=args.seed,
                           n_dense_lead=args.dense_lead, n_nextn=args.nextn, fused_gate_up=args.fused_gate_up)
    if args.quantize:
        from harness.tools import quantize

        path = quantize.write_kquant_model(spec, args.quantize, args.output, replace=args.force)
        console.print(f"wrote {path} ({path.stat().st_size / 2**20:.2f} MiB, {args.quantize}): {spec}")
        return 0
    path = synth.write_synth_model(spec, args.output, replace=args.force)
    console.print(f"wrote {path} ({path.stat().st_size / 2**20:.2f} MiB): {spec}")
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    from harness.orchestration import pack

    if args.verify:
        v = _with_progress("verify", lambda progress: pack.verify_pack(args.model, args.out, progress))
        console.print(f"{v.path}: matches {args.model} ({len(v.layout.tensors)} expert tensors in "
                      f"{len(v.layout.layers)} layers, checksum {v.layout.checksum:08x}; {v.seconds:.1f} s)",
                      soft_wrap=True, highlight=False)
        return 0
    r = _with_progress("pack", lambda progress: pack.write_pack(args.model, args.out, progress))
    rec = r.layout.layers[0].record_bytes
    console.print(f"wrote {r.path} ({r.layout.pack_size / 2**20:.2f} MiB: {len(r.layout.layers)} layers x "
                  f"{r.layout.n_expert} experts, records of {rec} bytes; checksum {r.layout.checksum:08x}; "
                  f"{r.seconds:.1f} s)", highlight=False, soft_wrap=True)
    return 0


def _with_progress(name: str, run: Callable[[ProgressFn], T]) -> T:
    """Run `run(progress)` under a transient progress bar on stderr; where stderr is not a terminal (a log file,
    a pipe: rich draws no bar there), one plain line each time a step is done, so that a long unattended run's log
    shows how far it got."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not err_console.is_terminal:
        return run(_progress_lines(name))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task(name, total=None)

        def progress(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=label)

        return run(progress)


def _progress_lines(name: str, stream: TextIO | None = None, every_s: float = 30.0) -> ProgressFn:
    """A progress callback that writes `name: done/total label (elapsed)`, flushed, when a step starts or ends (the
    label changes), at the end, and otherwise at most every `every_s` seconds (a byte counter moving)."""
    start = time.monotonic()
    last_label: str | None = None
    last_at = start - every_s

    def progress(done: int, total: int, label: str) -> None:
        nonlocal last_label, last_at
        now = time.monotonic()
        if label == last_label and done != total and now - last_at < every_s:
            return
        last_label, last_at = label, now
        out = stream if stream is not None else sys.stderr
        out.write(f"{name}: {done}/{total} {label} ({now - start:.0f} s)\n")
        out.flush()

    return progress


# ---- compare, sweep, check, report, topics, study ----------------------------------------------------------------

def _cmd_compare(args: argparse.Namespace) -> int:
    from harness.core import sizes
    from harness.domain.options import CompareOptions
    from harness.orchestration import compare
    from harness.report import terminal

    opts = CompareOptions(
        out=args.out or options.out_dir(args, f"compare-{(args.model or compare.default_model()).stem}"),
        model=args.model,
        vram=sizes.parse_size(args.vram) if args.vram else None,
        ram=sizes.parse_size(args.ram, allow_percent=False) if args.ram else None,
        policies=options.words(args.policies), dataset=args.dataset, runs=args.runs,
        n_prompt=args.n_prompt, n_gen=args.n_gen,
        reserve_bytes=(sizes.parse_size(args.reserve, allow_percent=False).bytes or 0) if args.reserve else 0,
        speed=not args.no_speed, quality=not args.no_quality, bench_cache_mode=args.speed_mode, seed=args.seed,
        argv=tuple(sys.argv), **options.perplexity_settings(args))
    refuse_cold_never_fetching(opts.policies, opts.warm_from)

    def announce(lines: Sequence[str]) -> None:
        err_console.print("\n".join(lines), highlight=False, soft_wrap=True, markup=False)

    env, runner = None, None
    if args.backend == "vulkan":
        from harness.orchestration.executor import VULKAN_RUN_ENV, VulkanEnvironment
        from harness.tools.runners import ToolRunner

        env, runner = VulkanEnvironment(), ToolRunner(extra_env=VULKAN_RUN_ENV)
    result = _with_progress("compare", lambda progress: compare.compare(opts, progress, announce=announce,
                                                                        env=env, runner=runner))
    console.print(terminal.render_compare(result))
    if result.interrupted:
        return 130
    return 1 if result.budget.over else 0


def _add_compare(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("compare", help="stock llama.cpp against the patched build's expert cache under one budget")
    c.add_argument("--vram", metavar="SIZE", help="device budget: 24G, 512M, or 25%% (= non-expert weights + 25%% "
                   "of the experts); default: the budget that keeps about 25%% of the experts resident")
    c.add_argument("--ram", metavar="SIZE", help="RAM limit instead of a device budget, for a model bigger than RAM: "
                   "8G, 1600M (absolute). Every run is made inside a memory cgroup of SIZE (page cache counted; "
                   "needs a writable memory cgroup, v1 or v2; at most MemAvailable less 2 GiB): stock llama.cpp "
                   "with mmap and --repack 0, the patched build with mode=engine,host=file and the slots that the "
                   "engine's ram=SIZE formula gives (missed experts read from the model file; the quality runs with "
                   "the same slots); reports each run's peak next to the limit. Not with --vram")
    c.add_argument("--backend", choices=("default", "vulkan"), default="default",
                   help="vulkan: the Vulkan builds (./build.sh --vulkan) on the first Vulkan device, the budget "
                   "verified by the device's own allocation log (a device of type CPU, e.g. Mesa's lavapipe, needs "
                   "GGML_VK_VISIBLE_DEVICES=0); default: the builds of ./build.sh")
    options.add_model(c)
    options.add_policies(c)
    options.add_text(c, "text for perplexity (default: eval/data/heldout.txt)")
    c.add_argument("--dataset", help="wikitext-2, gsm8k or humaneval instead of --text: fetched once with the "
                   "'datasets' package and cached; offline, pass a local file with --text")
    c.add_argument("--runs", type=int, default=5, help="speed repetitions per configuration (default: %(default)s)")
    options.add_out(c, "results folder (default: results/compare-MODEL); an existing one is resumed")
    options.add_ctx(c, 512)
    options.add_chunks(c, 32)
    c.add_argument("--n-prompt", type=int, default=512, help="llama-bench prompt tokens (default: %(default)s)")
    c.add_argument("--n-gen", type=int, default=128, help="llama-bench generated tokens (default: %(default)s)")
    options.add_threads(c, "CPU threads per run (default: the CPUs free now, without oversubscription: those "
                        "available to the harness less the 1-minute load average, at least 1; the plan says which)")
    c.add_argument("--reserve", metavar="SIZE", help="part of the budget kept for KV cache and compute buffers "
                   "(with --ram: the engine's vram_reserve for the compute buffers, default 256M)")
    c.add_argument("--speed-mode", default="engine", help="cache mode for speed runs (default: %(default)s)")
    c.add_argument("--no-speed", action="store_true", help="skip the llama-bench runs")
    c.add_argument("--no-quality", action="store_true", help="skip the perplexity runs")
    options.add_seed(c)
    options.add_warm(c)
    c.set_defaults(func=_cmd_compare)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from harness.domain.options import SweepGrid, SweepOptions
    from harness.orchestration import sweep
    from harness.report import terminal

    grid = SweepGrid(rules=options.words(args.rules), taus=options.floats(args.taus),
                     admits=options.words(args.admits), evicts=options.words(args.evicts),
                     fractions=tuple(f / 100 for f in options.floats(args.residency)))
    opts = SweepOptions(out=options.out_dir(args, "sweep"), model=args.model, grid=grid, seed=args.seed,
                        profile=args.profile, argv=tuple(sys.argv), **options.perplexity_settings(args))
    refuse_cold_never_fetching(grid.rules, opts.warm_from)
    result = _with_progress("sweep", lambda progress: sweep.sweep(opts, progress))
    console.print(terminal.render_sweep(result))
    return 130 if result.interrupted else 0


def _add_sweep(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from harness.domain.catalogue import SWEEP_RULES, SWEEP_TAUS

    w = sub.add_parser("sweep", help="a grid of cache policies in emulate mode: quality/speed frontier, mass "
                       "hypothesis")
    options.add_model(w)
    options.add_text(w)
    w.add_argument("--rules", default=",".join(SWEEP_RULES), help="miss rules (default: %(default)s)")
    w.add_argument("--taus", default=",".join(f"{t:g}" for t in SWEEP_TAUS), help="thresholds of the threshold rule "
                   "(default: %(default)s)")
    w.add_argument("--admits", default="off,0.5", help="admission: off or beta values (default: %(default)s)")
    w.add_argument("--evicts", default="lfu", help="eviction: lfu, lru, classlru (default: %(default)s)")
    w.add_argument("--residency", default="25", help="resident percent of each layer's experts "
                   "(default: %(default)s)")
    options.add_ctx(w, 512)
    options.add_chunks(w, 32)
    options.add_threads(w)
    w.add_argument("--profile", default="rtx3090", help="hardware profile for time estimates (default: %(default)s)")
    options.add_out(w, "results folder (default: results/sweep); an existing one is resumed")
    options.add_seed(w)
    options.add_warm(w)
    w.set_defaults(func=_cmd_sweep)


def _cmd_frontier(args: argparse.Namespace) -> int:
    from rich.markdown import Markdown

    from harness.domain.options import FrontierGrid, FrontierOptions
    from harness.orchestration import frontier
    from harness.report import markdown

    grid = FrontierGrid(families=options.words(args.families),
                        fractions=tuple(f / 100 for f in options.floats(args.residency)),
                        taus=options.floats(args.taus), admits=options.words(args.admits),
                        evicts=options.words(args.evicts), j=options.ints(args.j, "--j"), m=options.words(args.m),
                        alpha=options.floats(args.alpha), zero_taus=options.floats(args.zero_taus),
                        renorms=options.words(args.renorm), kmins=options.ints(args.kmin, "--kmin"),
                        ts=options.floats(args.t))
    opts = FrontierOptions(out=options.out_dir(args, "frontier"), model=args.model, grid=grid, seed=args.seed,
                           profile=args.profile, argv=tuple(sys.argv), **options.perplexity_settings(args))
    result = _with_progress("frontier", lambda progress: frontier.frontier(opts, progress))
    console.print(Markdown("\n".join(markdown.frontier_summary_lines(result))))
    console.print(f"report: {opts.out / 'report.md'}", markup=False, highlight=False)
    return 130 if result.interrupted else 0


def _add_frontier(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from harness.domain.catalogue import FRONTIER_FAMILIES
    from harness.domain.options import FrontierGrid

    g = FrontierGrid()

    def join(xs: tuple[object, ...]) -> str:
        return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs)

    f = sub.add_parser("frontier", help="every family of policies (ours, fetch-all, the anchors', upstream's CPU "
                       "share, combinations) side by side at the same residencies: delta PPL vs bytes moved and "
                       "estimated time, the frontier, the fewest bytes per family within +0.5%% / +1%%")
    options.add_model(f)
    options.add_text(f)
    f.add_argument("--families", default=join(g.families), help=f"families, from: {', '.join(FRONTIER_FAMILIES)} "
                   "(default: all)")
    f.add_argument("--residency", default=join(tuple(x * 100 for x in g.fractions)),
                   help="resident percent of each layer's experts (default: %(default)s)")
    f.add_argument("--taus", default=join(g.taus), help="ours: thresholds of the threshold rule (default: "
                   "%(default)s)")
    f.add_argument("--admits", default=join(g.admits), help="ours: admission, off or beta values (default: "
                   "%(default)s)")
    f.add_argument("--evicts", default=join(g.evicts), help="fetch-all: evictions (default: %(default)s)")
    f.add_argument("--j", default=join(g.j), help="cache-route: ranks always computed, in [0, k] (default: "
                   "%(default)s)")
    f.add_argument("--m", default=join(g.m), help="cache-route: window of router ranks, in [k, n_expert], a "
                   "multiple of k (4k), or auto = 2k (default: %(default)s)")
    f.add_argument("--alpha", default=join(g.alpha), help="cache-route: substitutes' weight scale, in [0, 1] "
                   "(default: %(default)s)")
    f.add_argument("--zero-taus", default=join(g.zero_taus), help="zero: thresholds, in [0, 1] (default: "
                   "%(default)s)")
    f.add_argument("--renorm", default=join(g.renorms), help="zero, ser: off, on (default: %(default)s)")
    f.add_argument("--kmin", default=join(g.kmins), help="ser: ranks always run, in [1, k] (default: %(default)s)")
    f.add_argument("--t", default=join(g.ts), help="ser: ratio to rank 0's gate weight, in [0, 1] (default: "
                   "%(default)s)")
    options.add_ctx(f, 512)
    options.add_chunks(f, 32)
    options.add_threads(f)
    f.add_argument("--profile", default="rtx3090", help="hardware profile for time estimates (default: %(default)s)")
    options.add_out(f, "results folder (default: results/frontier); an existing one is resumed")
    options.add_seed(f)
    options.add_warm(f)
    f.set_defaults(func=_cmd_frontier)


def _cmd_tune(args: argparse.Namespace) -> int:
    from rich.markdown import Markdown

    from harness.domain.tune import TuneGrid, TuneOptions
    from harness.orchestration import tune
    from harness.report.tune import summary_lines

    grid = TuneGrid(fractions=tuple(f / 100 for f in options.floats(args.residency.replace("%", ""))),
                    taus=options.floats(args.taus), first_choice=not args.no_first_choice,
                    zero_taus=options.floats(args.zero_taus), admits=options.words(args.admits),
                    evicts=options.words(args.evicts), prefetch=options.words(args.prefetch))
    model = args.model or args.model_opt
    name = (model or tune_default_model()).name
    opts = TuneOptions(out=options.out_dir(args, f"tune-{name}"), model=model, grid=grid,
                       max_delta_pct=options.percent(args.max_delta_ppl, "--max-delta-ppl"), strict=args.strict,
                       check_text=args.check_text, host=args.host,
                       base_profile=args.base_profile, readers=args.readers, measure=args.measure,
                       measure_grid=args.measure_grid, runs=args.runs,
                       n_gen=args.n_gen, profile_out=args.profile_out, seed=args.seed, argv=tuple(sys.argv),
                       **options.perplexity_settings(args))
    def warn(line: str) -> None:
        err_console.print(f"harness: warning: {line}", highlight=False, soft_wrap=True, markup=False)

    result = _with_progress("tune", lambda progress: tune.tune(opts, progress, warn=warn))
    for note in result.notes:
        err_console.print(f"harness: note: {note}", highlight=False, soft_wrap=True, markup=False)
    console.print(Markdown("\n".join(summary_lines(result))))
    console.print(f"report: {opts.out / 'report.md'}", markup=False, highlight=False)
    return 0


def tune_default_model() -> Path:
    from harness.orchestration.compare import default_model

    return default_model()


def _add_tune(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from harness.domain.costmodel import list_profiles
    from harness.domain.tune import TuneGrid

    g = TuneGrid()

    def join(xs: tuple[object, ...]) -> str:
        return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in xs)

    t = sub.add_parser("tune", help="the fastest cache policy within a delta-PPL bound on this machine (simulator "
                       "search, emulate checks), written as the tuned profile that --moe-cache auto reads")
    t.add_argument("model", type=Path, nargs="?", help="a .gguf MoE model (default: the project's trained model)")
    t.add_argument("--model", dest="model_opt", type=Path, help=argparse.SUPPRESS)
    t.add_argument("--max-delta-ppl", default="1%", help="the bound on delta-PPL, in percent, on its point estimate "
                   "(default: %(default)s)")
    t.add_argument("--strict", action="store_true", help="the bound on the 95%% CI's upper end instead")
    options.add_text(t)
    t.add_argument("--check-text", type=Path, help="judge the choice (made on --text) and the quality preset on "
                   "this other text too: out of sample, in the report (default: not run)")
    t.add_argument("--residency", default=join(tuple(x * 100 for x in g.fractions)),
                   help="resident percent of each layer's experts, one profile entry each (default: %(default)s)")
    t.add_argument("--taus", default=join(g.taus), help="the threshold rule's taus (default: %(default)s)")
    t.add_argument("--no-first-choice", action="store_true", help="leave first-choice out of the search")
    t.add_argument("--zero-taus", default=join(g.zero_taus), help="the zero rule's taus (drop-light's family; "
                   "default: %(default)s)")
    t.add_argument("--admits", default=join(g.admits), help="admission: off, on or beta values (default: %(default)s)")
    t.add_argument("--evicts", default=join(g.evicts), help="evictions: lfu, lru, classlru (default: %(default)s)")
    t.add_argument("--prefetch", default=join(g.prefetch), help="prefetch: off, on (default: %(default)s)")
    t.add_argument("--host", choices=("file", "ram"), help="where misses come from: the model file (default without "
                   "a GPU) or host memory (default with one)")
    t.add_argument("--base-profile", default="cpu-disk", help=f"the cost model's constants that are not measured: "
                   f"{', '.join(list_profiles())} (default: %(default)s)")
    t.add_argument("--readers", type=int, default=4, help="the engine's reader threads: the disk is measured with "
                   "as many (default: %(default)s)")
    t.add_argument("--measure", action="store_true", help="also measure decode speed with llama-bench and the "
                   "engine for the choice and the presets (a benchmark: use an idle machine)")
    t.add_argument("--measure-grid", type=int, default=0, metavar="N", help="--measure: also the N fastest estimated "
                   "grid points within the bound, to check the choice against the best measured one "
                   "(default: %(default)s)")
    t.add_argument("--runs", type=int, default=5, help="--measure: llama-bench processes per configuration after a "
                   "discarded warm-up, measured again once when their CV is above 10%% (default: %(default)s)")
    t.add_argument("--n-gen", type=int, default=32, help="--measure: decoded tokens per run (default: %(default)s)")
    t.add_argument("--profile-out", type=Path, help="where to write the profile (default: <model>.moe-tune.json "
                   "next to the model, else ~/.cache/moe-subst/tune/<file name>.<fingerprint>.moe-tune.json)")
    options.add_ctx(t, 512)
    options.add_chunks(t, 32)
    options.add_threads(t)
    options.add_out(t, "results folder (default: results/tune-<model>); an existing one is resumed")
    options.add_seed(t)
    options.add_warm(t)
    t.set_defaults(func=_cmd_tune)


def _cmd_check(args: argparse.Namespace) -> int:
    from harness.orchestration import check

    opts = check.CheckOptions(baseline=args.baseline, out=options.out_dir(args, "check"), update=args.update,
                              tolerance_pct=args.tolerance, policies=options.words(args.policies),
                              model=args.model, argv=tuple(sys.argv), **options.perplexity_settings(args))
    result = check.check(opts)
    for line in result.lines:
        console.print(f"{'ok  ' if line.ok else 'FAIL'} {line.policy}: {line.message}", highlight=False)
    if result.updated:
        console.print(f"baseline written to {result.baseline_path}")
    return 0 if result.passed else 1


def _cmd_report(args: argparse.Namespace) -> int:
    from harness.orchestration import rerender

    r = rerender.rerender(args.results, model=args.model, plots=args.plots)
    console.print(r.terminal)
    console.print(f"report: {r.report_path}")
    for note in r.notes:
        console.print(note, markup=False, highlight=False)
    for path in r.plots:
        console.print(f"plot: {path}", markup=False, highlight=False, soft_wrap=True)
    return 0


def _add_check_and_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    k = sub.add_parser("check", help="perplexity regression gate against a recorded baseline (for CI)")
    k.add_argument("--baseline", type=Path, required=True, help="baseline JSON (written by --update)")
    k.add_argument("--update", action="store_true", help="run and (re)write the baseline")
    k.add_argument("--tolerance", type=float, default=0.05, help="floor of the band, in percentage points: a "
                   "policy's delta PPL must stay within the baseline's 95%% CI widened by half its width + this, "
                   "in either direction (0 to 100; written into a new baseline; default: %(default)s)")
    options.add_policies(k, "policies of a new baseline")
    options.add_model(k, "model (default: the baseline's, else the trained model)")
    options.add_text(k, "text (default: the baseline's, else eval/data/heldout.txt)")
    options.add_ctx(k, 256, "context of a new baseline (default: %(default)s)")
    options.add_chunks(k, 12, "chunks of a new baseline (default: %(default)s)")
    options.add_threads(k)
    options.add_out(k, "results folder (default: results/check)")
    k.set_defaults(func=_cmd_check)

    r = sub.add_parser("report", help="re-render the tables and report.md of a compare or sweep results folder")
    r.add_argument("results", type=Path, help="the --out folder (or its results.jsonl)")
    options.add_model(r, "the model, if it moved since the run")
    r.add_argument("--plots", action="store_true", help="also draw a sweep's quality/speed frontier and mass "
                   "hypothesis as PNG and SVG into DIR/plots (needs matplotlib: pip install -e '.[plot]')")
    r.set_defaults(func=_cmd_report)


def _cmd_topics(args: argparse.Namespace) -> int:
    from rich.markdown import Markdown

    from harness.domain.options import TopicOptions
    from harness.orchestration import topics
    from harness.report import markdown

    opts = TopicOptions(out=options.out_dir(args, "topics"), model=args.model, tokenizer=args.tokenizer,
                        policy=args.policy, fraction=args.residency / 100, window=args.window,
                        argv=tuple(sys.argv), **options.perplexity_settings(args))
    result = topics.topic_shift(opts)
    console.print(Markdown(markdown.render_topics_markdown(result)))
    return 0


def _add_topics(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("topics", help="background admission after topic changes (eval/data/topic-shift.txt)")
    options.add_model(t)
    t.add_argument("--tokenizer", type=Path, help="the model's Hugging Face tokenizer.json (default: models/)")
    options.add_text(t, "text with a .json of segments beside it (default: eval/data/topic-shift.txt)")
    t.add_argument("--policy", default="quality", help="quality or speed (default: %(default)s)")
    t.add_argument("--residency", type=float, default=25, help="resident percent of experts (default: %(default)s)")
    t.add_argument("--window", type=int, default=256, help="tokens after a change (default: %(default)s)")
    options.add_ctx(t, 512)
    options.add_chunks(t, 0)
    options.add_threads(t)
    options.add_out(t, "results folder (default: results/topics)")
    options.add_warm(t)
    t.set_defaults(func=_cmd_topics)


def _cmd_study(args: argparse.Namespace) -> int:
    from rich.markdown import Markdown

    from harness.domain.catalogue import STUDY_POLICIES
    from harness.domain.options import StudyOptions
    from harness.orchestration import study
    from harness.report import markdown

    opts = StudyOptions(out=options.out_dir(args, "study"), model=args.model, residency=args.residency / 100,
                        topics=not args.no_topics, frontier=not args.no_frontier,
                        composition=not args.no_composition, generation=not args.no_generation,
                        matched=not args.no_matched,
                        calib_text=args.calib_text, tokenizer=args.tokenizer, seed=args.seed, argv=tuple(sys.argv),
                        **options.perplexity_settings(args))
    refuse_cold_never_fetching(STUDY_POLICIES, opts.warm_from)
    result = _with_progress("study", lambda progress: study.study(opts, progress))
    console.print(Markdown(markdown.render_study_markdown(result)))
    return 0


def _add_study(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("study", help="re-test the study's findings on a model (compare, sweep, topics, Experiment B, "
                       "the generation test), "
                       "with verdicts")
    options.add_model(s)
    options.add_text(s)
    s.add_argument("--tokenizer", type=Path, help="the model's tokenizer.json, for the topic-change part")
    s.add_argument("--residency", type=float, default=25, help="resident percent of experts (default: %(default)s)")
    options.add_ctx(s, 512)
    options.add_chunks(s, 32)
    options.add_threads(s)
    s.add_argument("--no-topics", action="store_true", help="skip the topic-change part")
    s.add_argument("--no-frontier", action="store_true", help="skip the side-by-side frontier (harness frontier at "
                   "the residency and half of it)")
    s.add_argument("--no-composition", action="store_true", help="skip Experiment B (finding 3)")
    s.add_argument("--no-generation", action="store_true", help="skip the generation test (it needs ./build.sh "
                   "--bindings)")
    s.add_argument("--no-matched", action="store_true", help="skip the matched runs (finding 1 against "
                   "lightest-first at the rule's count; rank against weight at equal mass)")
    s.add_argument("--calib-text", type=Path, help="the matched runs' calibration text (default: "
                   "eval/data/heldout-docs.txt with --chunks 0, else a slice of --text past the chunks)")
    options.add_out(s, "results folder (default: results/study); an existing one is resumed")
    options.add_seed(s)
    options.add_warm(s)
    s.set_defaults(func=_cmd_study)


# ---- bpb ----------------------------------------------------------------------------------------------------

def _cmd_bpb(args: argparse.Namespace) -> int:
    from harness.domain.bpb import BpbOptions
    from harness.orchestration import bpb
    from harness.report.bpb import render_bpb_json, render_bpb_terminal

    opts = BpbOptions(out=options.out_dir(args, f"bpb-{args.model.stem}-{(args.text or bpb.DEFAULT_TEXT).stem}"),
                      model=args.model, seed=args.seed, argv=tuple(sys.argv), **options.perplexity_settings(args))
    result = _with_progress("bpb", lambda progress: bpb.bpb(opts, progress))
    if args.json:
        print(render_bpb_json(result), end="")
    else:
        console.print(render_bpb_terminal(result), markup=False, highlight=False, soft_wrap=True)
    return 0


def _add_bpb(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("bpb", help="bits per byte of a text: cross-entropy per byte, comparable between models with "
                       "different tokenizers")
    b.add_argument("model", type=Path, help="a .gguf model with a byte-level BPE vocabulary")
    options.add_text(b, "the text (default: eval/data/heldout.txt)")
    options.add_ctx(b, 0, "context: chunks of this many tokens, the second half of each scored (default: the "
                    "model's training context, or 512 when it states none)")
    options.add_chunks(b, 0, "chunks, 0 = all (default: %(default)s)")
    options.add_threads(b)
    options.add_out(b, "results folder (default: results/bpb-MODEL-TEXT); an existing one is resumed")
    b.add_argument("--json", action="store_true", help="print the result as JSON (what bpb.json in the results "
                   "folder holds)")
    options.add_seed(b)
    b.set_defaults(func=_cmd_bpb)


# ---- composition (Experiment B), generate -------------------------------------------------------------------

def _cmd_composition(args: argparse.Namespace) -> int:
    from rich.markdown import Markdown

    from harness.domain.composition import CompositionOptions
    from harness.orchestration.composition import composition
    from harness.report.composition import render_composition_markdown

    opts = CompositionOptions(out=options.out_dir(args, "composition"), model=args.model,
                              residency=args.residency / 100,
                              heavy_los=tuple(float(x) for x in options.words(args.heavy)),
                              tolerance=args.tolerance / 100, calib_offset=args.calib_offset,
                              calib_chunks=args.calib_chunks, seed=args.seed, argv=tuple(sys.argv),
                              **options.perplexity_settings(args))
    result = _with_progress("composition", lambda progress: composition(opts, progress))
    console.print(Markdown(render_composition_markdown(result)))
    return 0


def _add_composition(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("composition", help="Experiment B (finding 3): heavy vs light substitutions at equal "
                       "substituted mass, with the decision rule")
    options.add_model(c)
    options.add_text(c)
    c.add_argument("--residency", type=float, default=25, help="resident percent of experts (default: %(default)s)")
    c.add_argument("--heavy", default="0.3,0.5", help="the heavy bands' lower gate-weight edges, one mass level "
                   "each (default: %(default)s)")
    c.add_argument("--tolerance", type=float, default=10, help="masses match within this percent of their mean "
                   "(default: %(default)s)")
    c.add_argument("--calib-offset", type=int, default=150_000, help="the calibration text starts at this character "
                   "of the text, past the evaluation chunks (default: %(default)s)")
    c.add_argument("--calib-chunks", type=int, default=8, help="calibration chunks (default: %(default)s)")
    options.add_ctx(c, 512)
    options.add_chunks(c, 32)
    options.add_threads(c)
    options.add_out(c, "results folder (default: results/composition); an existing one is resumed")
    options.add_seed(c)
    options.add_warm(c)
    c.set_defaults(func=_cmd_composition)


def _cmd_generate(args: argparse.Namespace) -> int:
    from rich.markdown import Markdown

    from harness.domain.generation import GenerateOptions
    from harness.orchestration.generation import generation
    from harness.report.generation import render_generation_markdown

    opts = GenerateOptions(out=options.out_dir(args, "generate"), model=args.model, prompts=args.prompts,
                           dataset=args.dataset, limit=args.limit or None, policies=options.words(args.policies),
                           n_predict=args.n_predict, n_ctx=args.ctx, residency=args.residency / 100,
                           threads=args.threads, seed=args.seed, argv=tuple(sys.argv))
    result = _with_progress("generate", lambda progress: generation(opts, progress))
    console.print(Markdown(render_generation_markdown(result)))
    return 0


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from harness.domain.generation import GENERATION_POLICIES

    g = sub.add_parser("generate", help="the generation test: greedy generation under each policy against the full "
                       "model (token agreement, answer agreement, mass vs agreement)")
    options.add_model(g)
    g.add_argument("--prompts", type=Path, help="a prompt file, JSON Lines of {id, kind, text} (default: "
                   "eval/data/gen-prompts.jsonl)")
    g.add_argument("--dataset", choices=("gsm8k", "humaneval"), help="the dataset's test prompts instead (network "
                   "once, then cached)")
    g.add_argument("--limit", type=int, default=0, help="the first N prompts, 0 = all (default: %(default)s)")
    g.add_argument("--policies", default=",".join(GENERATION_POLICIES),
                   help="comma-separated (default: %(default)s)")
    g.add_argument("--n-predict", type=int, default=48, help="tokens per prompt (default: %(default)s)")
    g.add_argument("--residency", type=float, default=25, help="resident percent of experts (default: %(default)s)")
    options.add_ctx(g, 512, "context (default: %(default)s)")
    options.add_threads(g)
    options.add_out(g, "results folder (default: results/generate); an existing one is resumed")
    options.add_seed(g)
    g.set_defaults(func=_cmd_generate)


# ---- simulate, calibrate ----------------------------------------------------------------------------------------

def _cmd_simulate(args: argparse.Namespace) -> int:
    from harness.orchestration import simulate
    from harness.report.simulate import render_simulate

    opts = simulate.SimulateOptions(trace=args.trace, model=args.model, policies=options.words(args.policies),
                                    residencies=options.words(args.residency) if args.residency else None,
                                    profile=args.profile)
    result = simulate.simulate(opts)
    for note in result.notes:
        err_console.print(f"harness: note: {note}", highlight=False, soft_wrap=True, markup=False)
    print(render_simulate(result.rows, markdown=args.markdown), end="")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from harness.orchestration import simulate
    from harness.report.simulate import render_profile

    fit = simulate.run_calibrate(args.runs, args.base, args.output, args.name)
    print(render_profile(fit) + f"wrote {args.output}")
    return 0


def _cmd_routing(args: argparse.Namespace) -> int:
    from harness.parsers.trace import read_expert_trace
    from harness.report.routing import render_routing
    from harness.stats.routing import routing_stats

    trace = read_expert_trace(args.trace)
    stats = routing_stats(trace.records, trace.k, trace.n_expert)
    console.print(render_routing(stats, str(args.trace)), markup=False, highlight=False, soft_wrap=True)
    return 0


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from harness.domain.costmodel import list_profiles
    from harness.orchestration.simulate import DEFAULT_RESIDENCIES

    s = sub.add_parser("simulate", help="replay a router trace under cache policies, with estimated decode speed "
                       "(cost model: estimates, not measurements)")
    s.add_argument("--trace", type=Path, required=True, help="a router trace (LLAMA_MOE_CACHE=...,trace=FILE)")
    options.add_model(s, "the .gguf the trace was recorded with", required=True)
    options.add_policies(s, note="; fetch-all, the baseline, is always included")
    defaults = ",".join(DEFAULT_RESIDENCIES).replace("%", "%%")
    s.add_argument("--residency", help="comma-separated slots per layer: percentages of each layer's experts "
                   f"(above 0%%, at most 100%%) or counts (default: {defaults}, less those giving fewer slots than "
                   "the experts used per token)")
    s.add_argument("--profile", default="rtx3090",
                   help=f"hardware profile: {', '.join(list_profiles())}, or a profile .json (default: %(default)s)")
    s.add_argument("--markdown", action="store_true", help="print a Markdown table")
    s.set_defaults(func=_cmd_simulate)

    r = sub.add_parser("routing", help="routing statistics of a router trace: gate weight by rank, heavy calls, "
                       "expert usage, temporal reuse (how far a model's routing is from the study's)")
    r.add_argument("--trace", type=Path, required=True, help="router trace (trace=PATH in the cache spec; record "
                   "it with policy=fetch-all in emulate mode)")
    r.set_defaults(func=_cmd_routing)

    c = sub.add_parser("calibrate", help="fit a hardware profile's constants to measured engine runs")
    c.add_argument("runs", type=Path, help='JSON lines: {"work": {TokenWork fields}, "ms": ms per token}')
    c.add_argument("--base", default="rtx3090", help="the profile to start from, a name or a .json (default: "
                   "%(default)s); constants the runs do not identify keep its values")
    c.add_argument("-o", "--output", type=Path, required=True, help="where to write the fitted profile (.json)")
    c.add_argument("--name", help="the fitted profile's name (default: <base>-calibrated)")
    c.set_defaults(func=_cmd_calibrate)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description=(
        "moe-subst: run MoE models bigger than VRAM with an expert cache in a patched llama.cpp, "
        "and measure it against stock llama.cpp."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("doctor", help="check builds, backend, GPU, versions, pin and patch series")
    d.set_defaults(func=_cmd_doctor)

    i = sub.add_parser("info", help="what a GGUF MoE model holds, and how many expert slots fit a budget")
    i.add_argument("model", type=Path, help="a .gguf file")
    i.add_argument("--vram", metavar="SIZE", help="device budget: 24G, 24GiB, 512M, or 25%% "
                   "(= non-expert weights + 25%% of the expert weights)")
    i.add_argument("--reserve", metavar="SIZE", help="part of the budget kept for the KV cache and compute "
                   "buffers (default 0)")
    i.set_defaults(func=_cmd_info)

    s = sub.add_parser("synth", help="write a small random-weight MoE GGUF (deterministic by seed)")
    s.add_argument("-o", "--output", type=Path, required=True, help="where to write the .gguf (an existing file is "
                   "refused unless --force)")
    s.add_argument("--force", action="store_true", help="replace an existing file at -o")
    s.add_argument("--arch", default="qwen3moe", help="qwen3moe (softmax, normalised top-k), qwen2moe (shared "
                   "expert), hy_v3 (merged gate_up experts, sigmoid router), mixtral (llama with experts), gpt-oss "
                   "(per-expert biases, softmax after top-k, attention sinks), deepseek2 (MLA, shared expert, "
                   "sigmoid router with selection bias, grouped top-k), qwen3next (hybrid linear attention, "
                   "gated shared expert), glm4moe (GLM-4.5: sigmoid router with selection bias, scaled weights, "
                   "shared expert, partial rotary), grovemoe (refused by the cache: two expert sets per layer)")
    s.add_argument("--layers", type=int, default=2, help="trunk layers (the MTP layers of --nextn come after)")
    s.add_argument("--dense-lead", type=int, default=0, help="leading dense layers (deepseek2, glm4moe)")
    s.add_argument("--nextn", type=int, default=0, help="NextN/MTP layers after the trunk (glm4moe: 0 or 1)")
    s.add_argument("--fused-gate-up", action="store_true", help="qwen3next: one merged ffn_gate_up_exps tensor per "
                   "layer (as convert_hf_to_gguf.py --fuse-gate-up-exps writes it)")
    s.add_argument("--experts", type=int, default=16)
    s.add_argument("--top-k", type=int, default=4)
    s.add_argument("--embd", type=int, default=64)
    s.add_argument("--ff", type=int, default=32, help="expert FFN size")
    s.add_argument("--ff-shexp", type=int, default=64, help="shared-expert FFN size (qwen2moe, hy_v3)")
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--kv-heads", type=int, default=2)
    s.add_argument("--ctx", type=int, default=512, help="training context length")
    s.add_argument("--vocab", type=int, default=512, help="vocabulary size (>= 259)")
    s.add_argument("--dtype", default="f32", help="f32, f16, q8_0, q4_0 (the gguf package cannot write q4_k: "
                   "use --quantize)")
    s.add_argument("--quantize", metavar="TYPE", choices=("Q4_K_M", "Q6_K"), help="K-quant: write f16, then run "
                   "the build's llama-quantize to TYPE (Q4_K_M or Q6_K; rows multiples of 256: --embd, --ff, "
                   "--ff-shexp)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_cmd_synth)

    k = sub.add_parser("pack", help="write a model's expert pack next to it (each expert's tensors in one 4 KiB-"
                       "aligned record: host=file reads a missed expert in one read), or --verify one")
    k.add_argument("model", type=Path, help="a .gguf MoE model")
    k.add_argument("--out", type=Path, help="the pack's path (default: MODEL.moe-pack, where host=file looks for it)")
    k.add_argument("--verify", action="store_true", help="check an existing pack against the model in full: its "
                   "header and the CRC-32 of every expert tensor, in the model and in the pack (reads both)")
    k.set_defaults(func=_cmd_pack)

    _add_compare(sub)
    _add_sweep(sub)
    _add_frontier(sub)
    _add_tune(sub)
    _add_check_and_report(sub)
    _add_topics(sub)
    _add_study(sub)
    _add_composition(sub)
    _add_generate(sub)
    _add_bpb(sub)
    _add_simulate(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Handler = args.func
    try:
        return func(args)
    except HarnessError as e:
        err_console.print(f"harness: error: {e}", highlight=False, soft_wrap=True, markup=False)
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("harness: interrupted; finished results were kept")
        return 130
