"""`harness simulate`: cache policies replayed on a router trace, with decode speed estimated by the cost model.

A router trace (`trace=PATH` in the cache spec, recorded by the patched engine) is replayed by
`llama-moe-sim` (patched build) under each policy x residency; the tool runs the engine's own cache code and
writes the engine's statistics JSON. From the statistics (fetches and admissions per token) the cost model
(harness.domain.costmodel) estimates the decode time per token on a hardware profile, against fetch-every-miss at
the same residency and against stock llama.cpp given the same device memory (the non-expert weights plus
the cache's slots), whose experts that do not fit run on the CPU. **Every time and speed-up here is an
ESTIMATE** from the profile's constants, not a measurement.

The routing replayed is that of the recorded run: substitution changes the hidden states and so the later
layers' routing, which a replay cannot see. Record with `policy=fetch-all` (or any policy that never
substitutes) for the unperturbed model's routing, and `trace_top` = n_expert for substitutes chosen
exactly as the engine chooses them.

`harness calibrate`: fits a profile's constants to measured engine runs (JSON lines of
`{"work": {TokenWork fields}, "ms": ms per token}`) and writes the fitted profile as JSON.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

from harness.core.errors import HarnessError
from harness.core.files import refuse_special
from harness.core.project import Build
from harness.domain.catalogue import BASELINE_POLICY, DEFAULT_POLICIES, policy_items
from harness.domain.costmodel import (
    Profile,
    TokenWork,
    cache_work,
    calibrate,
    estimate,
    load_profile,
    load_profile_file,
    profile_json,
    stock_gpu_moe_layers,
    stock_work,
)
from harness.domain.plan import budget_terms, slots_for_residency
from harness.domain.results import SimRow
from harness.parsers.base import ParseError
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.sim import SIM_TOOL, SimRun, parse_sim_output
from harness.parsers.trace import read_trace_header
from harness.tools.runners import run_tool

BASELINE = BASELINE_POLICY
DEFAULT_RESIDENCIES = ("10%", "25%", "50%")
_RESIDENCY = re.compile(r"^(\d+(\.\d+)?%|\d+)$")


# ---- running the simulator ---------------------------------------------------------------------------------


class SimRunner(Protocol):
    """What run_simulate needs; `ToolSimRunner` runs the real tool, tests pass a fake."""

    def simulate(self, trace: Path, spec: str) -> SimRun: ...


def sim_args(trace: Path, spec: str, *, stats: Path | None = None, repeat: int = 1, verify: bool = False,
             threads: int | None = None) -> list[str]:
    args = ["--trace", str(trace), "--spec", spec, "--quiet"]
    if threads is not None:
        args += ["--threads", str(threads)]
    if stats is not None:
        args += ["--stats", str(stats)]
    if repeat != 1:
        args += ["--repeat", str(repeat)]
    if verify:
        args.append("--verify")
    return args


class ToolSimRunner:
    """Runs llama-moe-sim of a (patched) build; the statistics come on its stdout."""

    def __init__(self, build: Build, timeout_s: float = 3600) -> None:
        self.build = build
        self.timeout_s = timeout_s

    def simulate(self, trace: Path, spec: str) -> SimRun:
        out = run_tool(self.build.tool(SIM_TOOL), sim_args(trace, spec), timeout_s=self.timeout_s, sample_gpu=False)
        try:
            return parse_sim_output(spec, out.stdout, out.stderr)
        except ParseError as e:
            raise ParseError(e.what, out.text, source=SIM_TOOL) from None


# ---- the grid ------------------------------------------------------------------------------------------------


def check_residency(residency: str) -> str:
    r = residency.strip()
    if not _RESIDENCY.match(r):
        raise HarnessError(f"bad residency {residency!r}: give slots per layer as a count (16) or a percentage "
                           "of each layer's experts (25%)")
    if r.endswith("%") and not 0 < float(r[:-1]) <= 100:
        raise HarnessError(f"residency {r} is out of range: a percentage of each layer's experts must be above 0% "
                           "and at most 100%")
    return r


def residency_slots(residency: str, n_expert: int) -> int:
    """Slots per layer of a residency, as the engine gives them (slots_for_residency: its rounding, at least 1)."""
    r = check_residency(residency)
    if r.endswith("%"):
        return slots_for_residency(float(r[:-1]) / 100, n_expert)
    return int(r)


def sim_spec(policy: str, residency: str) -> str:
    """The cache spec of a named policy (the policy catalogue) at a residency ("25%" or a slot count)."""
    items = [*policy_items(policy), ("slots", check_residency(residency))]
    return ",".join(f"{k}={v}" for k, v in items)


def resolve_profile(name_or_path: str | Profile) -> Profile:
    """A packaged profile by name (rtx3090, ...), or a profile JSON file (what `harness calibrate` writes)."""
    if isinstance(name_or_path, Profile):
        return name_or_path
    if name_or_path.endswith(".json") or "/" in name_or_path:
        return load_profile_file(name_or_path)
    return load_profile(name_or_path)


def _total(run: SimRun, key: str) -> float:
    v = run.doc["total"].get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise HarnessError(f"{SIM_TOOL} statistics: total.{key} is {v!r}")
    return float(v)


def per_token(run: SimRun, key: str) -> float:
    """A counter per decoded token: the sum over MoE layers of the layer's count per token it decided. In a
    decode every layer decides every token and this is total[key] / total.tokens; in a llama-perplexity
    trace the last layer decides only the scored (output) tokens, and the per-layer rates are the ones a
    decoder would see."""
    out = 0.0
    for layer in run.doc["layers"]:
        n, v = layer.get("token_layers"), layer.get(key)
        if not isinstance(n, int) or not isinstance(v, (int, float)) or isinstance(v, bool):
            raise HarnessError(f"{SIM_TOOL} statistics: layer {layer.get('layer')} lacks {key} or token_layers")
        out += v / n if n else 0.0
    return out


def cache_budget_bytes(info: ModelInfo, slots: int) -> int:
    """Device memory of the patched engine at `slots` per MoE layer (the engine's arithmetic, budget_terms):
    non-expert weights, the slots, the spare slot and the banks' padding."""
    terms = budget_terms(info)
    return terms.fixed + slots * terms.per_slot


def check_trace_matches(trace: Path, info: ModelInfo) -> None:
    h = read_trace_header(trace)
    if h.n_expert != info.n_expert or h.k != info.n_expert_used:
        raise HarnessError(f"the trace {trace} is of a model with {h.n_expert} experts, {h.k} per token; "
                           f"{info.path} has {info.n_expert}, {info.n_expert_used} per token: pass the model "
                           "the trace was recorded with")
    if h.n_records == 0:
        raise HarnessError(f"the trace {trace} holds no records (no token was decided)")


def check_trace_model(trace: Path, model: Path) -> tuple[str, ...]:
    """A trace recorded on another model (its header's fingerprint is not `model`'s: gguf_model.model_fingerprint)
    is one line of HarnessError: its expert sizes and routing are another model's, and so would every estimate be.
    A trace without a fingerprint (0: one written before the engine wrote it) gives a note that it cannot be checked."""
    from harness.parsers.gguf_model import model_fingerprint

    recorded = read_trace_header(trace).fingerprint
    if recorded == 0:
        return (f"the trace {trace} carries no fingerprint of the model it was recorded on (an older trace): that it "
                f"was recorded on {model} is not checked",)
    mine = model_fingerprint(model)
    if recorded != mine:
        raise HarnessError(f"the trace {trace} was recorded on another model than {model} (model fingerprint "
                           f"{recorded:016x} in the trace, {mine:016x} of this model): pass the model the trace was "
                           "recorded with")
    return ()


def _feasible(residency: str, info: ModelInfo) -> bool:
    return info.n_expert_used <= residency_slots(residency, info.n_expert) <= info.n_expert


def _minimum(info: ModelInfo) -> str:
    k, n = info.n_expert_used, info.n_expert
    return f"{k} (experts used per token: {100 * k / n:.3g}% of {n})"


def plan_residencies(residencies: Sequence[str] | None, info: ModelInfo) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The residencies to replay and notes about them. The user's (`residencies`) are checked as given (run_simulate
    refuses an infeasible one); of the defaults (None), those giving fewer slots than the experts used per token
    are skipped with a note, and an error says so if that leaves none."""
    if residencies is not None:
        return tuple(check_residency(r) for r in residencies), ()
    keep = tuple(r for r in DEFAULT_RESIDENCIES if _feasible(r, info))
    skipped = [r for r in DEFAULT_RESIDENCIES if r not in keep]
    if not keep:
        raise HarnessError(f"none of the default residencies ({', '.join(DEFAULT_RESIDENCIES)}) gives this model "
                           f"enough slots per layer: it needs between {_minimum(info)} and {info.n_expert}; "
                           "pass --residency")
    notes = tuple(f"residency {r} skipped: {residency_slots(r, info.n_expert)} slots per layer, fewer than the "
                  f"{info.n_expert_used} experts used per token" for r in skipped)
    return keep, notes


def run_simulate(trace: Path, model_info: ModelInfo, policies: Sequence[str], residencies: Sequence[str],
                 profile: str | Profile, runner: SimRunner) -> list[SimRow]:
    """Replay `trace` for every policy x residency and estimate each one's decode speed (an ESTIMATE).
    fetch-all is always replayed: it is the baseline of the speed-ups (and gets a row)."""
    prof = resolve_profile(profile)
    info = model_info
    if not policies:
        raise HarnessError("no policies to simulate")
    if not residencies:
        raise HarnessError("no residencies to simulate")
    for p in policies:
        sim_spec(p, "1")  # names are checked before anything runs
    res = [check_residency(r) for r in residencies]
    check_trace_matches(trace, info)
    for r in res:  # the tool refuses these too; saying it here names the residency
        if not _feasible(r, info):
            raise HarnessError(f"residency {r} is {residency_slots(r, info.n_expert)} slots per layer; this model "
                               f"needs between {_minimum(info)} and {info.n_expert}")
    order = list(dict.fromkeys(policies))
    if BASELINE not in order:
        order.append(BASELINE)

    rows: list[SimRow] = []
    for r in res:
        runs = {p: runner.simulate(trace, sim_spec(p, r)) for p in order}
        n_moe = len(runs[BASELINE].doc.get("layers", []))
        if n_moe != info.n_moe_layers:
            raise HarnessError(f"the trace {trace} has records for {n_moe} MoE layers, {info.path} has "
                               f"{info.n_moe_layers}: pass the model the trace was recorded with")

        def ms(run: SimRun) -> float:
            return estimate(prof, cache_work(info, per_token(run, "fetches"),
                                             admissions_per_token=per_token(run, "admissions"),
                                             host_computes_per_token=per_token(run, "host_computes"))).ms_per_token

        fetch_all_ms = ms(runs[BASELINE])
        for p in order:
            run = runs[p]
            slots = int(run.doc["config"]["slots"])
            gpu_layers = stock_gpu_moe_layers(info, cache_budget_bytes(info, slots))
            stock_ms = estimate(prof, stock_work(info, gpu_layers)).ms_per_token
            rows.append(SimRow(
                policy=p, residency=r, slots=slots, n_expert=int(run.doc["config"]["n_expert"]),
                tokens=int(_total(run, "tokens")), hit_rate=_total(run, "hit_rate"),
                fetches_per_token=per_token(run, "fetches"),
                substitution_rate=_total(run, "substitution_rate"),
                substituted_mass=_total(run, "substituted_mass"),
                admissions_per_token=per_token(run, "admissions"),
                profile=prof.name, est_ms_per_token=ms(run), est_fetch_all_ms=fetch_all_ms,
                est_stock_ms=stock_ms, stock_gpu_moe_layers=gpu_layers,
                replay_decisions_per_s=run.summary.decisions_per_s if run.summary else None))
    return rows


@dataclass(frozen=True)
class SimulateOptions:
    trace: Path
    model: Path
    policies: tuple[str, ...] = DEFAULT_POLICIES
    residencies: tuple[str, ...] | None = None  # None: DEFAULT_RESIDENCIES, less those the model cannot run
    profile: str = "rtx3090"


@dataclass(frozen=True)
class SimulateResult:
    rows: tuple[SimRow, ...]
    notes: tuple[str, ...]  # default residencies skipped


def simulate(opts: SimulateOptions, runner: SimRunner | None = None) -> SimulateResult:
    """The `harness simulate` entry point: model info, the residencies (plan_residencies), the patched build's
    llama-moe-sim, run_simulate."""
    from harness.core.project import get_build
    from harness.parsers.gguf_model import read_model_info

    refuse_special(opts.trace, "--trace")
    if not opts.trace.is_file():
        raise HarnessError(f"no trace at {opts.trace}: record one with LLAMA_MOE_CACHE=...,trace=FILE")
    info = read_model_info(opts.model)
    residencies, notes = plan_residencies(opts.residencies, info)
    notes = (*check_trace_model(opts.trace, opts.model), *notes)
    if runner is None:
        runner = ToolSimRunner(get_build("patched"))
    return SimulateResult(tuple(run_simulate(opts.trace, info, opts.policies, residencies, opts.profile, runner)),
                          notes)


# ---- calibration -----------------------------------------------------------------------------------------------


_WORK_FIELDS = {f.name for f in fields(TokenWork)}


def parse_calibration_runs(text: str, source: str = "runs") -> list[tuple[TokenWork, float]]:
    """JSON lines `{"work": {TokenWork fields}, "ms": ms per token}` (other keys are ignored)."""
    runs: list[tuple[TokenWork, float]] = []
    for n, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
            work = rec["work"]
            ms = rec["ms"]
        except (ValueError, KeyError, TypeError) as e:
            raise HarnessError(f"{source}:{n}: not a {{\"work\": {{...}}, \"ms\": ...}} record ({e})") from None
        if not isinstance(work, dict) or not set(work) <= _WORK_FIELDS or "n_layers" not in work \
                or "resident_bytes" not in work:
            raise HarnessError(f"{source}:{n}: work needs n_layers and resident_bytes, and only "
                               f"{', '.join(sorted(_WORK_FIELDS))}")
        vals = [ms, *work.values()]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                   for v in vals) or ms <= 0:
            raise HarnessError(f"{source}:{n}: values must be finite non-negative numbers and ms > 0")
        runs.append((TokenWork(**work), float(ms)))
    return runs


def run_calibrate(runs_path: Path, base: str | Profile, out: Path, name: str | None = None) -> Profile:
    """Fit `base`'s constants to the measured runs (costmodel.calibrate, NNLS) and write the fitted profile to
    `out` as JSON (usable as `--profile out.json`, or as a packaged profile under harness/profiles/)."""
    refuse_special(runs_path, "the measured runs")
    try:
        text = runs_path.read_text()
    except OSError as e:
        raise HarnessError(f"cannot read the measured runs {runs_path}: {e.strerror or e}") from None
    runs = parse_calibration_runs(text, str(runs_path))
    prof = resolve_profile(base)
    fit = calibrate(prof, runs, name=name)
    sources = {"calibrated": f"NNLS fit of {prof.name}'s constants to {len(runs)} measured runs in {runs_path}; "
                             "constants the runs do not identify keep the base value"}
    try:
        out.write_text(profile_json(fit, sources))
    except OSError as e:
        raise HarnessError(f"cannot write the profile {out}: {e.strerror or e}") from None
    return fit
