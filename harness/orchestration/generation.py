"""`harness generate`: the generation test (harness.domain.generation), the runs.

One worker run per configuration (the full model with the cache off, then each policy in emulate mode with the
same slots per layer), each recorded in `results.jsonl` of --out with every prompt's tokens, text and substituted
mass; a rerun skips the recorded configurations (a results file of other prompts, model, settings or binaries is
refused).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.records import ResultsFile, make_record, prepare_out_dir, utc_now
from harness.domain.catalogue import FULL
from harness.domain.generation import (
    DEFAULT_PROMPTS,
    GenerateOptions,
    GenerationResult,
    degeneration,
    generation_policy_items,
    prompt_kinds,
    summarize,
)
from harness.domain.plan import slots_for_residency
from harness.orchestration.executor import Environment, Progress, no_progress, safe_name
from harness.parsers.cache_stats import parse_cache_stats
from harness.parsers.generation import Generation
from harness.parsers.gguf_model import ModelInfo
from harness.tools.datasets import Prompt, dataset_prompts, read_prompts
from harness.tools.generate import GenerationRequest, generate
from harness.tools.requests import CacheSpec


def load_prompts(opts: GenerateOptions, root: Path | None = None) -> list[Prompt]:
    if opts.prompts is not None and opts.dataset is not None:
        raise HarnessError("pass either --prompts or --dataset, not both")
    if opts.dataset is not None:
        prompts = dataset_prompts(opts.dataset, limit=opts.limit)
    else:
        prompts = read_prompts(opts.prompts or (root or project.project_root()) / DEFAULT_PROMPTS)
    return prompts[:opts.limit] if opts.limit else prompts


def _fingerprint(opts: GenerateOptions, model: Path, prompts: list[Prompt], slots: int, code: str) -> str:
    """As harness.orchestration.composition's: portable between checkouts (model by name and size, the code by the
    pin and the patch-series hash)."""
    d = {"command": "generate", "model": [model.name, model.stat().st_size],
         "prompts": hashlib.sha256(json.dumps([[p.id, p.kind, p.text] for p in prompts]).encode()).hexdigest()[:16],
         "n_predict": opts.n_predict, "n_ctx": opts.n_ctx, "slots": slots, "code": code}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _record_data(config: str, cache: CacheSpec | None, gens: list[Generation], wall_s: float) -> dict[str, Any]:
    rows = []
    for g in gens:
        mass = rate = None
        if g.stats is not None and Path(g.stats).is_file():
            s = parse_cache_stats(Path(g.stats).read_text())
            mass, rate = s.substituted_mass, s.substitution_rate
        elif cache is not None:
            raise HarnessError(f"the cache wrote no statistics for prompt {g.id} ({g.stats})")
        rows.append({"id": g.id, "n_prompt": len(g.prompt_tokens), "tokens": list(g.tokens), "text": g.text,
                     "mass": mass, "substitution_rate": rate})
    return {"config": config, "cache_spec": cache.render() if cache else None, "wall_s": wall_s,
            "generations": rows}


def run_generation(opts: GenerateOptions, info: ModelInfo, *, env: Environment | None = None,
                   progress: Progress = no_progress, root: Path | None = None) -> GenerationResult:
    env = env or Environment()
    if opts.model is None:
        raise HarnessError("no model given")
    if opts.n_predict < 1:
        raise HarnessError(f"--n-predict must be at least 1, got {opts.n_predict}")
    for p in opts.policies:
        generation_policy_items(p)
    prompts = load_prompts(opts, root)
    slots = slots_for_residency(opts.residency, info.n_expert, info.n_expert_used)
    builds = env.builds()
    prov = env.provenance(builds, opts.argv, env.gpu())
    fp = _fingerprint(opts, opts.model, prompts, slots, f"{prov.pin}/{prov.patch_series}")
    results = ResultsFile(opts.out / "results.jsonl")
    existing = results.read()
    if {r.get("fingerprint") for r in existing} - {fp}:
        raise HarnessError(f"{results.path} holds generations of other prompts, model, settings or binaries: use a "
                           "new --out folder, or delete the file to start over")
    results.drop_torn_tail()
    if not any(r.get("kind") == "meta" for r in existing):
        results.append(make_record("meta", "meta", prov, {
            "command": "generate", "fingerprint": fp,
            "options": {"n_predict": opts.n_predict, "n_ctx": opts.n_ctx, "residency": opts.residency,
                        "policies": list(opts.policies), "prompts": [p.id for p in prompts]}}))
    done = {str(r["key"]) for r in existing}
    configs = [FULL, *[p for p in opts.policies if p != FULL]]
    threads = opts.threads or env.default_threads()[0]
    for i, config in enumerate(configs):
        key = f"gen:{config}"
        if key in done:
            progress(i + 1, len(configs), f"{key} (recorded)")
            continue
        progress(i, len(configs), key)
        cache = None
        stats_dir = None
        if config != FULL:
            cache = CacheSpec("emulate", None, slots, None, generation_policy_items(config))
            stats_dir = opts.out / "stats" / safe_name(config)
        started = utc_now()
        gens, wall = generate(builds["patched"], GenerationRequest(
            opts.model, tuple(prompts), opts.n_predict, opts.n_ctx, threads, cache, stats_dir))
        data = _record_data(config, cache, gens, wall)
        data["fingerprint"] = fp
        results.append(make_record(key, "gen", prov, data, started=started))
        progress(i + 1, len(configs), key)
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results.read():
        if r.get("kind") == "gen":
            runs[str(r["config"])] = {str(g["id"]): g for g in r["generations"]}
    rows, corr, per = summarize(prompts, runs, configs[1:], n_boot=opts.n_boot, seed=opts.seed)
    first = next(iter(per.values()), ())
    full_answers = sum(o.answer_ref is not None for o in first)
    warnings = list(results.warnings)
    fa = [r for r in rows if r.policy == "fetch-all"]
    if any(r.same.k != r.same.n for r in fa):
        warnings.append("fetch-all did not reproduce the full model's generations exactly: the emulation is not "
                        "exact here (it must be)")
    n_kind = {k: sum(p.kind == k for p in prompts) for k in prompt_kinds(prompts)}
    return GenerationResult(opts, slots, n_kind, rows, corr, full_answers, results.path, tuple(warnings), per,
                            degeneration(prompts, runs[FULL]))


def generation(opts: GenerateOptions, progress: Progress = no_progress, *,
               env: Environment | None = None) -> GenerationResult:
    """`harness generate`: resolve the default model, run (or resume), write report.md."""
    from harness.orchestration.compare import default_model
    from harness.parsers.gguf_model import read_model_info
    from harness.report.generation import render_generation_markdown

    prepare_out_dir(opts.out)
    opts = replace(opts, model=opts.model or default_model())
    assert opts.model is not None
    result = run_generation(opts, read_model_info(opts.model), env=env, progress=progress)
    (opts.out / "report.md").write_text(render_generation_markdown(result))
    return result
