"""Greedy generation with the patched libllama through llama-cpp-python, in a worker process per configuration
(harness.tools.genworker): the same prompts, the same number of tokens, the cache configured by LLAMA_MOE_CACHE
(`None`: no cache, the full model)."""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.project import Build, project_root
from harness.parsers.base import ParseError
from harness.parsers.generation import Generation, parse_generations
from harness.tools.bindings import bindings_env, installed_bindings
from harness.tools.datasets import Prompt
from harness.tools.requests import CACHE_ENV_VAR, CacheSpec
from harness.tools.runners import run_tool


@dataclass(frozen=True)
class GenerationRequest:
    model: Path
    prompts: tuple[Prompt, ...]
    n_predict: int = 48
    n_ctx: int = 512
    threads: int = 1
    cache: CacheSpec | None = None  # without `stats`: the worker writes one statistics file per prompt
    stats_dir: Path | None = None  # where (required with a cache)


def generate(build: Build, req: GenerationRequest, *, timeout_s: float = 3600) -> tuple[list[Generation], float]:
    """Run the worker for `req`; the generations in prompt order and the wall time. Raises a HarnessError when
    llama-cpp-python is missing, the worker fails, or its output does not cover the prompts."""
    if installed_bindings() is None:
        raise HarnessError(f"the generation test needs llama-cpp-python in {sys.executable}: ./build.sh --bindings "
                           "(seconds: the pinned sdist's Python package, no C++ build)")
    if req.cache is not None and (req.cache.stats is not None or req.stats_dir is None):
        raise HarnessError("a generation request with a cache needs stats_dir and no stats= of its own")
    env = bindings_env(build)
    env["PYTHONPATH"] = str(project_root())
    if req.cache is not None:
        env[CACHE_ENV_VAR] = req.cache.render()
    with tempfile.TemporaryDirectory(prefix="moe-gen-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({
            # absolute: the worker runs in its own temporary folder
            "model": str(req.model.resolve()), "n_ctx": req.n_ctx, "threads": req.threads,
            "n_predict": req.n_predict, "stats_dir": str((req.stats_dir or Path(tmp) / "stats").resolve()),
            "prompts": [{"id": p.id, "text": p.text} for p in req.prompts]}))
        out = run_tool(Path(sys.executable), ["-m", "harness.tools.genworker", str(job)], env=env,
                       timeout_s=timeout_s, cwd=Path(tmp), sample_gpu=False)
    try:
        gens = parse_generations(out.stdout)
    except ParseError as e:
        raise ParseError(e.what, out.text, source="the generation worker") from None
    if [g.id for g in gens] != [p.id for p in req.prompts]:
        raise HarnessError(f"the generation worker returned {len(gens)} of {len(req.prompts)} prompts")
    return gens, out.wall_s
