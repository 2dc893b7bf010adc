"""`harness composition`: Experiment B (PAPER.md, finding 3), the design and decision rule in
harness.domain.composition; here the runs.

All runs are llama-perplexity runs of the patched build in emulate mode, recorded in `results.jsonl` of --out
(resumable: a rerun skips what is recorded, and the calibration search replays the same steps from the records).
Calibration runs score `calib_chunks` chunks of calibration.txt (a slice of the text past the evaluation tokens);
evaluation runs score the text's first `chunks` chunks: the full model, and per mass level the heavy and the light
composition.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.core.records import ResultsFile, prepare_out_dir
from harness.domain.catalogue import FULL
from harness.domain.composition import (
    CalibStep,
    Composition,
    CompositionOptions,
    CompositionResult,
    MassLevel,
    finding3_verdict,
)
from harness.domain.plan import RunSpec, slots_for_residency
from harness.orchestration.executor import Environment, Progress, execute_runs, no_progress, safe_name
from harness.orchestration.serialise import warm_key
from harness.orchestration.warmstart import warm_start
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import paired_delta_ppl
from harness.tools.requests import CacheSpec, Placement, Runner


def calibration_text(text: str, offset: int, n_chars: int) -> str:
    """The slice [offset, offset + n_chars) of `text`, widened to whole lines."""
    if offset >= len(text):
        raise HarnessError(f"the text has {len(text)} characters: no calibration part from character {offset} "
                           "(use a longer text or a smaller --calib-offset)")
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", min(len(text), offset + n_chars))
    return text[start: len(text) if end < 0 else end + 1]


def band_items(*, lo: float | None = None, hi: float | None = None, min_rank: int | None = None,
               max_rank: int | None = None, evict: str = "lfu") -> tuple[tuple[str, str], ...]:
    """The `band` rule's spec keys (min_rank, max_rank: the ranks it substitutes at; harness study's rank split)."""
    items: list[tuple[str, str]] = [("rule", "band")]
    if lo is not None:
        items.append(("lo", f"{lo:g}"))
    if hi is not None:
        items.append(("hi", f"{hi:g}"))
    if min_rank is not None:
        items.append(("min_rank", str(min_rank)))
    if max_rank is not None:
        items.append(("max_rank", str(max_rank)))
    return (*items, ("evict", evict), ("admit", "off"))


def run_name(items: tuple[tuple[str, str], ...]) -> str:
    """A run's name (its key in results.jsonl): "heavy lo=L" and "light hi=H" for Experiment B's bands, the spec's
    keys otherwise."""
    d = dict(items)
    if d.get("rule") == "band" and not {"min_rank", "max_rank"} & d.keys():
        return f"heavy lo={d['lo']}" if "lo" in d else f"light hi={d['hi']}"
    return ",".join(f"{k}={v}" for k, v in items)


def _fingerprint(opts: CompositionOptions, model: Path, text: Path, slots: int, code: str) -> str:
    """What must not change between a run and its resumption. Portable between checkouts (a results folder made in
    a worktree resumes in another): the model by name and size, the text by content, the code by the pin and the
    patch-series hash (patches and src/), not by binaries' hashes (which differ with the build folder's path)."""
    d = {"command": "composition", "model": [model.name, model.stat().st_size],
         "text": [text.name, hashlib.sha256(text.read_bytes()).hexdigest()[:16]], "n_ctx": opts.n_ctx,
         "chunks": opts.chunks, "calib": [opts.calib_offset, opts.calib_chars, opts.calib_chunks], "slots": slots,
         "evict": opts.evict, "code": code}
    if opts.calib_text is not None:  # only then, so that folders made before it resume
        d["calib_text"] = [opts.calib_text.name, hashlib.sha256(opts.calib_text.read_bytes()).hexdigest()[:16]]
    d.update(warm_key(opts))
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class Runs:
    """Runs one spec at a time through the executor (resume by key), and reads back what a key recorded."""

    def __init__(self, opts: CompositionOptions, runner: Runner, env: Environment, model: Path, text: Path,
                 calib: Path, slots: int, progress: Progress, info: ModelInfo | None = None) -> None:
        self.builds = env.builds()
        if info is not None:  # every cached run, calibration and evaluation, from the warm profile
            opts = warm_start(opts, model, text, opts.out / "warm", runner, self.builds["patched"], info.n_expert,
                              info.n_moe_layers)
        self.opts, self.runner, self.model, self.text, self.calib, self.slots = opts, runner, model, text, calib, slots
        self.progress = progress
        self.prov = env.provenance(self.builds, opts.argv, env.gpu())
        self.fp = _fingerprint(opts, model, text, slots, f"{self.prov.pin}/{self.prov.patch_series}")
        self.results = ResultsFile(opts.out / "results.jsonl")
        self.meta = {"command": "composition", "options": {
            "heavy_los": list(opts.heavy_los), "tolerance": opts.tolerance, "residency": opts.residency,
            "chunks": opts.chunks, "calib_chunks": opts.calib_chunks, "n_ctx": opts.n_ctx}}
        self.interrupted = False
        self.notes: list[str] = []

    def run(self, part: str, items: tuple[tuple[str, str], ...] | None) -> dict[str, Any]:
        """part "calib" or "eval"; items None: the full model (cache off)."""
        name = FULL if items is None else run_name(items)
        key = f"ppl:{part}:{name}"
        settings = replace(self.opts, chunks=self.opts.calib_chunks) if part == "calib" else self.opts
        stats = str(self.opts.out / "stats" / f"{part}-{safe_name(name)}.json")
        cache = CacheSpec("off") if items is None else CacheSpec("emulate", None, self.slots, stats, items)
        req = settings.perplexity_request(self.model, self.calib if part == "calib" else self.text,
                                          Placement(n_cpu_moe=999), cache=cache,
                                          nll_dump=None if part == "calib" else  # calibration: the mass only
                                          self.opts.out / "nll" / f"{part}-{safe_name(name)}.bin", label=name)
        spec = RunSpec(key, "ppl", "patched", f"{part}:{name}", None, ppl=req)
        outcome = execute_runs([spec], self.runner, self.builds, self.prov, self.fp, self.results, self.progress,
                               meta=self.meta)
        self.notes += outcome.notes
        if outcome.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        rec = next((r for r in self.results.read() if r.get("key") == key), None)
        if rec is None:
            raise HarnessError(f"the run {key} left no record in {self.results.path}")
        return rec

    def nll(self, rec: dict[str, Any]) -> NllDump:
        path = Path(rec["nll_dump"])
        if not path.is_file():  # a results folder moved to another checkout: the dump beside it
            path = self.opts.out / "nll" / path.name
        return self.runner.load_nll(path)


def record_mass(rec: dict[str, Any]) -> float | None:
    c = rec.get("cache_stats") or {}
    m = c.get("substituted_mass")
    return float(m) if m is not None else None


def record_rate(rec: dict[str, Any]) -> float | None:
    c = rec.get("cache_stats") or {}
    r = c.get("substitution_rate")
    return float(r) if r is not None else None


def composition_of(runs: Runs, rec: dict[str, Any], items: tuple[tuple[str, str], ...], full: NllDump) -> Composition:
    data = runs.nll(rec)
    delta = None
    if data.nll.shape == full.nll.shape and (data.tokens == full.tokens).all():
        delta = paired_delta_ppl(full.nll, data.nll, full.chunk, n_boot=runs.opts.n_boot, seed=runs.opts.seed)
    c = rec.get("cache_stats") or {}
    stats_path = Path(runs.opts.out / "stats" / f"eval-{safe_name(run_name(items))}.json")
    fc = mx = None
    if stats_path.is_file():
        total = json.loads(stats_path.read_text()).get("total", {})
        fc, mx = total.get("subst_first_choice"), total.get("max_subst_weight")
    return Composition(run_name(items), ",".join(f"{k}={v}" for k, v in items[:-2]), float(rec["ppl"]), delta,
                       record_mass(rec), c.get("substitution_rate"), fc, mx)


def search_light_edge(mass_of: Any, target: float, upper: float, tolerance: float, max_steps: int) -> tuple[
        float | None, list[CalibStep]]:
    """Bisection for the light band's edge H in (0, upper] whose mass `mass_of(H)` matches `target` within
    `tolerance / 2` (relative; half the decision rule's tolerance, leaving the rest for the evaluation tokens).
    Assumes mass_of grows with H. None when even H = upper stays below the target."""
    steps: list[CalibStep] = []
    top = mass_of(upper)
    steps.append(CalibStep(upper, top))
    if top < target * (1 - tolerance / 2):
        return None, steps
    lo, hi = 0.0, upper
    best = (abs(top - target), upper)
    for _ in range(max_steps):
        mid = round((lo + hi) / 2, 4)
        m = mass_of(mid)
        steps.append(CalibStep(mid, m))
        best = min(best, (abs(m - target), mid))
        if abs(m - target) <= tolerance / 2 * target:
            return mid, steps
        if m < target:
            lo = mid
        else:
            hi = mid
    return best[1], steps


def run_composition(opts: CompositionOptions, runner: Runner, info: ModelInfo, *, env: Environment | None = None,
                    progress: Progress = no_progress) -> CompositionResult:
    env = env or Environment()
    if opts.model is None or opts.text is None:
        raise HarnessError("no model or text given")
    if not opts.text.is_file():
        raise HarnessError(f"cannot read the text {opts.text}: no such file")
    bad = [x for x in opts.heavy_los if not 0 < x < 1]
    if bad or not opts.heavy_los:
        raise HarnessError(f"the heavy bands' edges must lie in (0, 1), got {', '.join(map(str, bad)) or 'none'}")
    if not 0 < opts.tolerance < 1:
        raise HarnessError(f"the mass tolerance must be in (0, 1), got {opts.tolerance}")
    slots = slots_for_residency(opts.residency, info.n_expert, info.n_expert_used)
    calib = opts.out / "calibration.txt"
    if opts.calib_text is not None and not opts.calib_text.is_file():
        raise HarnessError(f"cannot read the calibration text {opts.calib_text}: no such file")
    calib_text = calibration_text((opts.calib_text or opts.text).read_text(), opts.calib_offset, opts.calib_chars)
    if not calib.is_file() or calib.read_text() != calib_text:
        calib.write_text(calib_text)
    runs = Runs(opts, runner, env, opts.model, opts.text, calib, slots, progress, info)
    full_rec = runs.run("eval", None)
    full = runs.nll(full_rec)
    levels: list[MassLevel] = []
    for lo in opts.heavy_los:
        heavy_items = band_items(lo=lo, evict=opts.evict)
        h_cal = record_mass(runs.run("calib", heavy_items))
        if h_cal is None or h_cal <= 0:
            levels.append(MassLevel(lo, h_cal, None, (), None, None, None,
                                    f"the heavy band lo={lo:g} substituted nothing on the calibration text"))
            continue

        def light_mass(hi: float) -> float:
            m = record_mass(runs.run("calib", band_items(hi=hi, evict=opts.evict)))
            if m is None:
                raise HarnessError("a calibration run recorded no cache statistics")
            return m

        edge, steps = search_light_edge(light_mass, h_cal, lo, opts.tolerance, opts.max_steps)
        if edge is None:
            levels.append(MassLevel(lo, h_cal, None, tuple(steps), None, None, None,
                                    f"the light band reaches mass {steps[0].mass:.4f} at most (hi={lo:g}) on the "
                                    f"calibration text, below the heavy band's {h_cal:.4f}"))
            continue
        light_items = band_items(hi=edge, evict=opts.evict)
        heavy = composition_of(runs, runs.run("eval", heavy_items), heavy_items, full)
        light = composition_of(runs, runs.run("eval", light_items), light_items, full)
        pair = None
        hn, ln = runs.nll(runs.run("eval", heavy_items)), runs.nll(runs.run("eval", light_items))
        if hn.nll.shape == ln.nll.shape and (hn.tokens == ln.tokens).all():
            pair = paired_delta_ppl(ln.nll, hn.nll, ln.chunk, n_boot=opts.n_boot, seed=opts.seed)
        levels.append(MassLevel(lo, h_cal, edge, tuple(steps), heavy, light, pair))
    warnings = list(runs.results.warnings) + runs.notes
    return CompositionResult(opts, float(full_rec["ppl"]), slots, tuple(levels),
                             finding3_verdict(levels, opts.tolerance), runs.results.path, tuple(warnings))


def composition(opts: CompositionOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
                env: Environment | None = None) -> CompositionResult:
    """`harness composition`: resolve the default model and text, run (or resume), write report.md."""
    from harness.orchestration.compare import default_model, resolve_text
    from harness.parsers.gguf_model import read_model_info
    from harness.report.composition import render_composition_markdown
    from harness.tools.runners import ToolRunner

    prepare_out_dir(opts.out)
    opts = replace(opts, model=opts.model or default_model(), text=resolve_text(opts.text, None))
    assert opts.model is not None
    result = run_composition(opts, runner or ToolRunner(), read_model_info(opts.model), env=env, progress=progress)
    (opts.out / "report.md").write_text(render_composition_markdown(result))
    return result
