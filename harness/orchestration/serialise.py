"""The serialiser: what a results folder holds besides the tools' output, written and read back here.

- the meta record's `options`, with exactly the keys (and key order) every earlier results file has;
- one record per run (`ppl_record`, `bench_record`): the configuration, the raw samples and measurements;
- the fingerprints: what must not change between a run and its resumption.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.core.records import ResultsFile
from harness.core.sizes import Size
from harness.domain.options import CompareOptions, FrontierGrid, FrontierOptions, SweepGrid, SweepOptions
from harness.domain.plan import ComparePlan, RunSpec

# the meta record's options, per command, in the order of the files written so far
COMPARE_OPTION_KEYS = ("out", "model", "vram", "policies", "text", "dataset", "runs", "n_ctx", "n_batch", "chunks",
                       "n_prompt", "n_gen", "threads", "reserve_bytes", "speed", "quality", "bench_cache_mode",
                       "n_boot", "seed", "profile", "argv", "ram", "warm_from", "warm_profile")
SWEEP_OPTION_KEYS = ("out", "model", "text", "grid", "n_ctx", "chunks", "threads", "n_boot", "seed", "profile",
                     "argv", "warm_from", "warm_profile")
SWEEP_GRID_KEYS = ("rules", "taus", "admits", "evicts", "fractions")
FRONTIER_OPTION_KEYS = ("out", "model", "text", "n_ctx", "chunks", "threads", "n_boot", "seed", "profile", "argv",
                        "warm_from", "warm_profile")
FRONTIER_GRID_KEYS = ("families", "fractions", "taus", "admits", "evicts", "j", "m", "alpha", "zero_taus", "renorms",
                      "kmins", "ts")
TOPIC_OPTION_KEYS = ("out", "model", "text", "tokenizer", "policy", "fraction", "window", "n_ctx", "chunks",
                     "threads", "n_boot", "seed", "argv", "warm_from", "warm_profile")
BPB_OPTION_KEYS = ("out", "model", "text", "n_ctx", "chunks", "threads", "n_boot", "seed", "argv")
TUNE_OPTION_KEYS = ("out", "model", "text", "check_text", "max_delta_pct", "strict", "grid", "host", "base_profile",
                    "readers", "measure", "measure_grid", "runs", "n_gen", "n_ctx", "chunks", "threads", "n_boot",
                    "seed", "argv", "warm_from", "warm_profile")


def _json_value(v: Any) -> Any:
    if isinstance(v, Size):
        return {"bytes": v.bytes, "fraction": v.fraction}
    if isinstance(v, Path):
        return str(v.resolve())
    if isinstance(v, tuple):
        return [str(x) if isinstance(x, Path) else x for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return repr(v)


def options_json(opts: object, keys: Sequence[str]) -> dict[str, Any]:
    """Options as JSON (paths and sizes as strings, other objects as their repr), for the meta record."""
    return {k: _json_value(getattr(opts, k)) for k in keys}


def ppl_record(spec: RunSpec, run: Any) -> dict[str, Any]:
    r = run.result
    data: dict[str, Any] = {
        "build": spec.build, "config": spec.config,
        "cache_spec": spec.ppl.cache.render() if spec.ppl and spec.ppl.cache else None,
        "argv": list(run.output.argv), "wall_s": run.output.wall_s,
        "ppl": r.ppl, "ppl_se": r.ppl_se, "n_chunks": r.n_chunks, "n_ctx": r.n_ctx,
        "running_ppl": list(r.running_ppl),
        "peak_device_mib": None, "peak_source": "",
        "nll_dump": str(spec.ppl.nll_dump) if spec.ppl and spec.ppl.nll_dump else None,
        "cache_stats": run.cache_stats.as_dict() if run.cache_stats is not None else None,
    }
    if run.memory is not None and run.memory.device_self_mib is not None:
        data["peak_device_mib"], data["peak_source"] = run.memory.device_self_mib, "memory breakdown"
        data["memory_breakdown"] = [vars(row) for row in run.memory.rows]
    if run.output.peak_gpu_mib is not None and (data["peak_device_mib"] is None
                                                or run.output.peak_gpu_mib > data["peak_device_mib"]):
        data["peak_device_mib"], data["peak_source"] = run.output.peak_gpu_mib, _gpu_source(run.output)
    data.update(_ram_fields(run.output))
    return data


def _gpu_source(output: Any) -> str:
    """Where a run's device peak comes from: nvidia-smi, or ggml-vulkan's allocation log (a Vulkan build)."""
    return str(getattr(output, "peak_gpu_source", "nvidia-smi"))


def _ram_fields(output: Any) -> dict[str, Any]:
    """compare --ram: the run's peak in its memory cgroup and the limit (absent without a cgroup)."""
    if getattr(output, "ram_limit_bytes", None) is None:
        return {}
    return {"peak_ram_bytes": output.peak_ram_bytes, "ram_limit_bytes": output.ram_limit_bytes,
            "peak_ram_source": output.peak_ram_source}


def _engine_slots(run: Any) -> dict[str, Any]:
    """The slots per layer the engine used (its statistics' config), for a run with a cache."""
    stats = getattr(run, "cache_stats", None)
    if stats is None or not stats.raw:
        return {}
    try:
        slots = json.loads(stats.raw).get("config", {}).get("slots")
    except (ValueError, AttributeError):
        return {}
    return {"engine_slots": int(slots)} if isinstance(slots, int) else {}


def bench_record(spec: RunSpec, run: Any) -> dict[str, Any]:
    return {
        "build": spec.build, "config": spec.config, "rep": spec.rep,
        "cache_spec": spec.bench.cache.render() if spec.bench and spec.bench.cache else None,
        "argv": list(run.output.argv), "wall_s": run.output.wall_s,
        "tests": [{"test": t.test, "n_prompt": t.n_prompt, "n_gen": t.n_gen, "n_tokens": t.n_tokens,
                   "samples_ns": list(t.samples_ns), "avg_ts": t.avg_ts, "n_cpu_moe": t.n_cpu_moe,
                   "n_gpu_layers": t.n_gpu_layers, "backends": t.backends, "gpu_info": t.gpu_info,
                   "build_commit": t.build_commit} for t in run.results],
        "peak_device_mib": run.output.peak_gpu_mib,
        "peak_source": _gpu_source(run.output) if run.output.peak_gpu_mib is not None else "",
        **_ram_fields(run.output), **_engine_slots(run),
    }


def read_meta(results: ResultsFile, command: str) -> dict[str, Any]:
    meta = next((r for r in results.read() if r.get("kind") == "meta"), None)
    if meta is None:
        raise HarnessError(f"{results.path}: no meta record (not written by this harness, or empty)")
    if meta.get("command") != command:
        raise HarnessError(f"{results.path} holds `harness {meta.get('command')}` results, not {command}")
    return meta


def size_from_json(d: Any) -> Size | None:
    return Size(d.get("bytes"), d.get("fraction")) if isinstance(d, dict) else None


def opt_path(v: Any) -> Path | None:
    """A path option of a meta record (absent, as the warm start's in the folders made before it: None)."""
    return Path(v) if v else None


def compare_options_from_json(o: dict[str, Any], out: Path, model: Path | None = None) -> CompareOptions:
    """The options of a compare meta record (`model` overrides a moved model)."""
    return CompareOptions(
        out=out, model=model or Path(o["model"]), vram=size_from_json(o.get("vram")), policies=tuple(o["policies"]),
        text=Path(o["text"]) if o.get("text") else None, runs=int(o["runs"]), n_ctx=int(o["n_ctx"]),
        n_batch=o.get("n_batch"), chunks=o.get("chunks"), n_prompt=int(o["n_prompt"]), n_gen=int(o["n_gen"]),
        threads=o.get("threads"), reserve_bytes=int(o["reserve_bytes"]), speed=bool(o["speed"]),
        quality=bool(o["quality"]), bench_cache_mode=str(o["bench_cache_mode"]), n_boot=int(o["n_boot"]),
        seed=int(o["seed"]), profile=o.get("profile"), argv=tuple(o.get("argv", ())), ram=size_from_json(o.get("ram")),
        warm_from=opt_path(o.get("warm_from")),
        warm_profile=opt_path(o.get("warm_profile")))


def sweep_options_from_json(o: dict[str, Any], g: dict[str, Any], out: Path,
                            model: Path | None = None) -> SweepOptions:
    """The options and grid of a sweep meta record (`model` overrides a moved model)."""
    grid = SweepGrid(tuple(g["rules"]), tuple(float(x) for x in g["taus"]), tuple(g["admits"]), tuple(g["evicts"]),
                     tuple(float(x) for x in g["fractions"]))
    return SweepOptions(out=out, model=model or Path(o["model"]), text=Path(o["text"]), grid=grid,
                        n_ctx=int(o["n_ctx"]), chunks=o.get("chunks"), threads=o.get("threads"),
                        n_boot=int(o["n_boot"]), seed=int(o["seed"]), profile=str(o["profile"]),
                        argv=tuple(o.get("argv", ())), warm_from=opt_path(o.get("warm_from")),
        warm_profile=opt_path(o.get("warm_profile")))


def frontier_options_from_json(o: dict[str, Any], g: dict[str, Any], out: Path,
                               model: Path | None = None) -> FrontierOptions:
    """The options and grid of a frontier meta record (`model` overrides a moved model)."""
    grid = FrontierGrid(
        families=tuple(g["families"]), fractions=tuple(float(x) for x in g["fractions"]),
        taus=tuple(float(x) for x in g["taus"]), admits=tuple(g["admits"]), evicts=tuple(g["evicts"]),
        j=tuple(int(x) for x in g["j"]), m=tuple(str(x) for x in g["m"]), alpha=tuple(float(x) for x in g["alpha"]),
        zero_taus=tuple(float(x) for x in g["zero_taus"]), renorms=tuple(g["renorms"]),
        kmins=tuple(int(x) for x in g["kmins"]), ts=tuple(float(x) for x in g["ts"]))
    return FrontierOptions(out=out, model=model or Path(o["model"]), text=Path(o["text"]), grid=grid,
                           n_ctx=int(o["n_ctx"]), chunks=o.get("chunks"), threads=o.get("threads"),
                           n_boot=int(o["n_boot"]), seed=int(o["seed"]), profile=str(o["profile"]),
                           argv=tuple(o.get("argv", ())), warm_from=opt_path(o.get("warm_from")),
        warm_profile=opt_path(o.get("warm_profile")))


def _model_stat(model: Path) -> list[Any]:
    st = model.stat()
    return [str(model.resolve()), st.st_size, int(st.st_mtime)]


def _digest(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def compare_fingerprint(opts: CompareOptions, plan: ComparePlan, binaries: dict[str, str]) -> str:
    """What must not change between a run and its resumption: model file, budget plan, run settings, binaries."""
    if opts.model is None:
        raise HarnessError("no model given")
    d = {
        "model": _model_stat(opts.model),
        "budget": plan.budget_bytes, "slots": plan.slots.slots_per_layer, "n_cpu_moe": plan.stock.n_cpu_moe,
        "text": str(opts.text) if opts.text else None, "n_ctx": opts.n_ctx, "n_batch": opts.n_batch,
        "chunks": opts.chunks, "n_prompt": opts.n_prompt, "n_gen": opts.n_gen, "threads": opts.threads,
        "bench_cache_mode": opts.bench_cache_mode, "binaries": binaries,
    }
    if plan.ram is not None:  # only then: the fingerprints of earlier results stay what they were
        # "slots": the speed runs get the plan's slots (before, ram=: the engine's own, perhaps another residency)
        d["ram"] = [plan.ram.limit, plan.ram.terms.reserve, "slots"]
    return _digest({**d, **warm_key(opts)})


def warm_key(opts: Any) -> dict[str, str]:
    """The warm start's part of a fingerprint: the profile's name (from the model, the calibration text's content
    and the context); nothing for a cold start, so that the folders made before warm starts resume."""
    profile = getattr(opts, "warm_profile", None)
    return {"warm": Path(profile).name} if profile is not None else {}


def sweep_fingerprint(model: Path, text: Path, opts: SweepOptions, binaries: dict[str, str]) -> str:
    return _digest({"model": _model_stat(model), "text": str(text), "n_ctx": opts.n_ctx, "chunks": opts.chunks,
                    "binaries": binaries, "command": "sweep", **warm_key(opts)})


def frontier_fingerprint(model: Path, text: Path, opts: FrontierOptions, binaries: dict[str, str]) -> str:
    return _digest({"model": _model_stat(model), "text": str(text), "n_ctx": opts.n_ctx, "chunks": opts.chunks,
                    "binaries": binaries, "command": "frontier", **warm_key(opts)})


def topics_fingerprint(model: Path, text: Path, n_ctx: int, chunks: int | None, policy: str, slots: int,
                       binaries: dict[str, str], warm: dict[str, str] | None = None) -> str:
    return _digest({"model": _model_stat(model), "text": str(text), "n_ctx": n_ctx, "chunks": chunks,
                    "policy": policy, "slots": slots, "binaries": binaries, "command": "topics", **(warm or {})})


def bpb_fingerprint(model: Path, text: Path, n_ctx: int, chunks: int | None, binaries: dict[str, str]) -> str:
    """What a resumed bpb run must share: the model and the text (path, size, mtime), context, chunks, binaries."""
    return _digest({"model": _model_stat(model), "text": _model_stat(text), "n_ctx": n_ctx, "chunks": chunks,
                    "binaries": binaries, "command": "bpb"})


def tune_fingerprint(model: Path, text: Path, opts: Any, binaries: dict[str, str]) -> str:
    """What a resumed tune must share with its records: the model and the text (path, size, mtime), context, chunks,
    threads (the decode rate) and binaries. The bound and the grid may change: a record is one configuration's run,
    named by its spec, whatever the search that asked for it."""
    return _digest({"model": _model_stat(model), "text": _model_stat(text), "n_ctx": opts.n_ctx,
                    "chunks": opts.chunks, "threads": opts.threads, "binaries": binaries, "command": "tune",
                    **warm_key(opts)})
