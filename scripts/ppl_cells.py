"""One llama-perplexity run of the patched CPU build for the cell scripts (shadow_check.py, mass_budget.py): the
model on the text at n_ctx 512, one chunk per batch, with a cache spec in LLAMA_MOE_CACHE (None: the cache off) and
an NLL dump; a failed run is one line naming the model and the spec."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PPL = ROOT / "vendor/llama.cpp-patched/build-cpu/bin/llama-perplexity"


def perplexity(model: Path, text: Path, chunks: int, threads: int, nll: Path, spec: str | None, *,
               extra: Sequence[str] = (), who: str = "ppl_cells") -> float:
    """Runs it; returns its wall time in seconds."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    if spec:
        env["LLAMA_MOE_CACHE"] = spec
    argv = [str(PPL), "-m", str(model), "-f", str(text), "-c", "512", "-b", "512", *extra, "--chunks", str(chunks),
            "-t", str(threads), "--fit", "off", "--nll-dump", str(nll)]
    t0 = time.monotonic()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"{who}: llama-perplexity failed ({p.returncode}) on {model.name} with {spec!r}: "
                         + " | ".join(tail))
    return time.monotonic() - t0
