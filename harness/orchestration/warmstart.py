"""Warm starts: every cached run of compare, sweep, frontier, topics, study and tune starts from the routing profile
of calibration text, never from the evaluated tokens (issue 36).

Without it the engine's initial residency is experts 0..slots-1 of each layer. A policy that never fetches
(substitute-all) keeps that residency for the whole run, so comparing it with policies that fetch compared a frozen
cold cache with warm ones (its "+161% over the 0.15 rule" was mostly cold against warm). Here one llama-perplexity
run of the model with every expert resident (emulate mode, fetch-all, slots = n_expert: the routing is the full
model's) scores WARM_CHUNKS chunks of the calibration text and writes the engine's profile file (`profile_out=`,
docs/expert-cache.md, "Profile files"); every later cached run gets `profile=` (PerplexitySettings.warm): the
`slots` most selected experts of each layer are its initial residency.

The calibration text: --warm-from FILE, else the project's other held-out text (heldout-docs.txt for any text but
itself, heldout.txt for heldout-docs.txt: disjoint sources, eval/data/README); --cold for the engine's default.
The profile is kept in the results folder under a name from the model, the calibration text's content and the
context, so a resumed run reuses it and another calibration makes another file (and another fingerprint).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from harness.core import project
from harness.core.errors import HarnessError
from harness.domain.settings import PerplexitySettings
from harness.tools.requests import CacheSpec, PerplexityRequest, Placement, Runner

WARM_CHUNKS = 16  # calibration chunks of n_ctx tokens (at 512: 8192 tokens, 81,920 selections per layer at k = 10)
HELDOUT = Path("eval/data/heldout.txt")
HELDOUT_DOCS = Path("eval/data/heldout-docs.txt")
PROFILE_HEADER = "moe-expert-profile 1"
NEVER_FETCHING = ("substitute-all",)  # policies whose residency never changes: compared only from a warm start

S = TypeVar("S", bound=PerplexitySettings)


def default_calibration(text: Path | None, root: Path | None = None) -> Path:
    """The calibration text of a warm start on `text` (None: the default text, heldout.txt): heldout-docs.txt, or
    heldout.txt when the evaluated text is heldout-docs.txt."""
    base = root or project.project_root()
    docs = base / HELDOUT_DOCS
    if text is not None and _same_file(text, docs):
        return base / HELDOUT
    return docs


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def profile_name(model: Path, calib: Path, n_ctx: int) -> str:
    """The profile's file name: what it depends on (the model by name and size, the calibration text by content,
    the context and WARM_CHUNKS)."""
    h = hashlib.sha256()
    h.update(f"{model.name}\0{model.stat().st_size}\0{n_ctx}\0{WARM_CHUNKS}\0".encode())
    h.update(calib.read_bytes())
    return f"warm-{h.hexdigest()[:16]}.profile"


def check_profile(path: Path, n_layers: int | None = None) -> None:
    """A profile file the engine wrote: its header, and one line per MoE layer when `n_layers` is given."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise HarnessError(f"cannot read the warm-start profile {path}: {e}") from None
    if not lines or lines[0].strip() != PROFILE_HEADER:
        raise HarnessError(f"{path} is not an expert profile (first line {lines[0][:40] if lines else ''!r})")
    layers = [ln for ln in lines[1:] if ln.startswith("layer ")]
    if n_layers is not None and len(layers) != n_layers:
        raise HarnessError(f"the warm-start profile {path} has {len(layers)} layers, the model {n_layers}")


def refuse_cold_never_fetching(policies: tuple[str, ...] | list[str], warm_from: Path | None) -> None:
    """A policy that never fetches keeps its initial residency: from a cold cache its loss is the cold cache's."""
    cold = [p for p in policies if p in NEVER_FETCHING]
    if cold and warm_from is None:
        raise HarnessError(f"{', '.join(cold)} never fetches, so a cold start freezes experts 0..n-1 for the whole "
                           "run: compare it only from a warm start (leave out --cold)")


def warm_start(opts: S, model: Path, text: Path | None, out: Path, runner: Runner, build: project.Build,
               n_expert: int, n_layers: int | None = None) -> S:
    """`opts` with `warm_profile` set: the profile of opts.warm_from (made here once, kept in `out`), or `opts`
    unchanged when it asks for a cold start (warm_from None)."""
    calib = opts.warm_from
    if calib is None:
        return opts
    if not calib.is_file():
        raise HarnessError(f"cannot read the warm-start calibration text {calib}: no such file")
    if text is not None and _same_file(calib, text):
        raise HarnessError(f"the warm-start calibration text {calib} is the evaluated text: its profile would be "
                           "made from the evaluated tokens (pass another --warm-from)")
    path = out / profile_name(model, calib, opts.n_ctx)
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        cache = CacheSpec("emulate", "fetch-all", n_expert, None, (("profile_out", str(tmp)),))
        req = PerplexityRequest(model=model, text=calib, placement=Placement(n_cpu_moe=999), n_ctx=opts.n_ctx,
                                n_batch=opts.n_batch or opts.n_ctx, chunks=WARM_CHUNKS, threads=opts.threads,
                                cache=cache, nll_dump=None, label="warm-profile")
        runner.perplexity(build, req)
        if not tmp.is_file():
            raise HarnessError(f"the warm-start run on {calib} wrote no profile ({tmp})")
        check_profile(tmp, n_layers)
        tmp.replace(path)
    else:
        check_profile(path, n_layers)
    return replace(opts, warm_profile=path)
