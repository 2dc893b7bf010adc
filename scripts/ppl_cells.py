"""The cell scripts' common parts (shadow_check.py, mass_budget.py): one llama-perplexity run of the patched CPU
build (the model on the text at n_ctx 512, one chunk per batch, a cache spec in LLAMA_MOE_CACHE or the cache off, an
NLL dump; a failed run is one line naming the model and the spec), and the resumable loop over model x residency x
policy cells with the full model's NLLs per model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.domain.plan import slots_for_residency  # noqa: E402
from harness.parsers.gguf_model import read_model_info  # noqa: E402
from harness.parsers.nll_dump import NllDump, read_nll_dump_file  # noqa: E402

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


@dataclass(frozen=True)
class Cell:
    """One model x residency x policy of a cell script: its name in results.jsonl, the model, the slots of the
    residency, the policy's spec keys, the full model's NLL dump on the same tokens, and a tag for its files."""

    name: str
    model_name: str
    model: Path
    residency: float
    slots: int
    policy: str
    base: NllDump
    tag: str


def run_cells(out: Path, text: Path, chunks: int, threads: int, models: Sequence[str], fractions: Sequence[float],
              policies: Sequence[str], measure: Callable[[Cell, Path], dict[str, Any]], *,
              extra: Sequence[str] = (), who: str = "ppl_cells") -> list[dict[str, Any]]:
    """Every cell: the records already in OUT/results.jsonl as they are (an interrupted run resumes), the others
    measured by `measure(cell, work)` and appended as one JSON line each; the full model's NLL dump once per model
    (cache off, OUT/work/<model>.full.nll). Returns every cell's record in order."""
    results = out / "results.jsonl"
    done: dict[str, dict[str, Any]] = {}
    if results.exists():
        for line in results.read_text().splitlines():
            r = json.loads(line)
            done[r["cell"]] = r
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in models:
        model = ROOT / "models" / name
        info = read_model_info(model)
        full = work / f"{name}.full.nll"
        if not full.exists():
            s = perplexity(model, text, chunks, threads, full, None, extra=extra, who=who)
            print(f"{name}: full model in {s:.0f} s", flush=True)
        base = read_nll_dump_file(full)
        for f in fractions:
            slots = slots_for_residency(f, info.n_expert, info.n_expert_used)
            for pol in policies:
                cell = Cell(f"{name} {f * 100:g}% {pol}", name, model, f, slots, pol, base,
                            f"{name}.{f:g}.{pol.replace('=', '-').replace(',', '.')}")
                if cell.name in done:
                    rows.append(done[cell.name])
                    continue
                r = {"cell": cell.name, "model": name, "residency": f, "slots": slots, "policy": pol,
                     "chunks": chunks, "threads": threads, **measure(cell, work)}
                with results.open("a") as fh:
                    fh.write(json.dumps(r) + "\n")
                rows.append(r)
    return rows
