"""How llama-perplexity runs: one settings type shared by every command that measures perplexity."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from harness.tools.requests import CacheSpec, PerplexityRequest, Placement


@dataclass(frozen=True, kw_only=True)
class PerplexitySettings:
    """The text and llama-perplexity's context, batch, chunks and threads. The options of compare, sweep,
    topics, study and check extend it (so its fields are theirs, by keyword); `text` None means the command's
    default text, `threads` None llama.cpp's default (compare's speed runs use the same threads)."""

    text: Path | None = None
    n_ctx: int = 512
    n_batch: int | None = None  # None: n_ctx (one sequence per batch: token order = decode order)
    chunks: int | None = None  # None: all
    threads: int | None = None
    # the warm start (harness.orchestration.warmstart): `warm_from` the calibration text whose routing profile is
    # every cached run's initial residency (None: cold, the engine's experts 0..slots-1); `warm_profile` the profile
    # file made from it, set by the command before its runs
    warm_from: Path | None = None
    warm_profile: Path | None = None

    def warm(self, cache: CacheSpec | None) -> CacheSpec | None:
        """`cache` starting from the warm profile (`profile=`), where there is one and the cache is on."""
        if cache is None or cache.mode == "off" or self.warm_profile is None:
            return cache
        if any(k == "profile" for k, _ in cache.extra):
            return cache
        return replace(cache, extra=(*cache.extra, ("profile", str(self.warm_profile))))

    def perplexity_request(self, model: Path, text: Path, placement: Placement, *, cache: CacheSpec | None,
                           nll_dump: Path | None, label: str) -> PerplexityRequest:
        """One llama-perplexity run of `model` on `text` with these settings (a cache from the warm profile)."""
        return PerplexityRequest(model=model, text=text, placement=placement, n_ctx=self.n_ctx,
                                 n_batch=self.n_batch or self.n_ctx, chunks=self.chunks, threads=self.threads,
                                 cache=self.warm(cache), nll_dump=nll_dump, label=label)
