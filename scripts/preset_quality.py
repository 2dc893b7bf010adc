#!/usr/bin/env python3
"""Substitution rate and delta-PPL of each cache preset in emulate mode at 25% residency (issue 3 closing note).

Runs the patched llama-perplexity (one sequence per batch, so ubatch order is decode order) with --nll-dump on
generated models, once with the cache off (identical to stock, see tests/test_expert_cache.py) and once per
policy, and reports per policy: substitution rate, miss rate, mean substituted mass, and delta-PPL% =
100 (exp(mean(nll_policy - nll_off)) - 1) with a 95% CI from a bootstrap over chunks (paired, same tokens).
On generated (random-weight) models the numbers show that the machinery works, not what a trained model
would lose; pass --model and --text for a trained one.

Usage: .venv/bin/python scripts/preset_quality.py [--arch qwen3moe] [--chunks 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.core.project import get_build  # noqa: E402
from harness.parsers.nll_dump import read_nll_dump_file  # noqa: E402
from harness.tools.synth import ARCHS, CACHE_REFUSED, SynthSpec, synth_text, write_synth_model  # noqa: E402

POLICIES = ("policy=fetch-all", "policy=quality", "policy=speed", "rule=threshold,admit=off",
            "rule=first-choice,admit=off", "rule=substitute-all,admit=off", "rule=drop")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", action="append", choices=[a for a in ARCHS if a not in CACHE_REFUSED])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--slots", default="25%")
    ap.add_argument("--model", type=Path, help="a GGUF to use instead of generated models")
    ap.add_argument("--text", type=Path, help="the text to score (default: generated)")
    a = ap.parse_args()
    patched = get_build("patched")
    tmp = Path(tempfile.mkdtemp(prefix="preset-quality-"))
    text = a.text or tmp / "text.txt"
    if a.text is None:
        text.write_text(synth_text(150000, seed=5))
    rng = np.random.default_rng(0)
    for arch in ([a.model.stem] if a.model else a.arch or ["qwen3moe"]):
        model = a.model or write_synth_model(SynthSpec(arch=arch, n_expert=64, n_expert_used=8, n_layer=4, seed=7),
                                             tmp / f"{arch}.gguf")

        def run(spec: str | None, tag: str, arch: str = arch,
                model: Path = model) -> tuple[np.ndarray, dict | None]:  # type: ignore[type-arg]
            env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
            stats = tmp / f"{arch}-{tag}.json"
            if spec:
                env["LLAMA_MOE_CACHE"] = f"mode=emulate,{spec},slots={a.slots},stats={stats}"
            nll = tmp / f"{arch}-{tag}.nll"
            subprocess.run([str(patched.tool("llama-perplexity")), "-m", str(model), "-f", str(text),
                            "-c", str(a.ctx), "-b", str(a.ctx), "--chunks", str(a.chunks), "-t", a.threads,
                            "--nll-dump", str(nll)], env=env, check=True, capture_output=True)
            return read_nll_dump_file(nll).nll, (json.loads(stats.read_text()) if spec else None)

        base, _ = run(None, "off")
        per = len(base) // a.chunks
        print(f"{arch}: slots={a.slots}, {a.chunks} chunks x {per} scored tokens, "
              f"PPL(off) = {np.exp(base.mean()):.4f}")
        print(f"  {'policy':32s} {'subst rate':>10s} {'miss rate':>9s} {'mass':>7s} {'fc subst':>8s} "
              f"{'admits':>7s} {'dPPL%':>8s}  95% CI (chunk bootstrap)")
        for spec in POLICIES:
            nll, st = run(spec, spec.replace("=", "-").replace(",", "_"))
            assert st is not None
            d = (nll - base).reshape(a.chunks, per).mean(axis=1)
            boot = [np.exp(d[rng.integers(0, a.chunks, a.chunks)].mean()) - 1 for _ in range(2000)]
            lo, hi = np.percentile(boot, [2.5, 97.5]) * 100
            t = st["total"]
            print(f"  {spec:32s} {t['substitution_rate']:10.4f} {t['miss_rate']:9.4f} {t['substituted_mass']:7.4f} "
                  f"{t['subst_first_choice']:8d} {t['admissions']:7d} {100 * (np.exp(d.mean()) - 1):8.3f}  "
                  f"[{lo:.3f}, {hi:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
