#!/usr/bin/env python3
"""Benchmark of the expert cache engine on a CPU build (issue 4). Results, not tests.

Decode tokens/s (llama-bench tg) on a generated f16 qwen3moe, stock and patched runs interleaved round by
round so that a shared host's drift hits all of them alike:
  - stock;
  - engine, fetch-all, every expert resident (slots=100%): the cost of the machinery (target >= 95% of stock);
  - engine, quality, 25% resident: synchronous admissions (async=off) and a host copy thread (async=thread).
Prints mean tokens/s with a 95% CI (t distribution over all repetitions), the ratio to stock, and the engine's
own statistics (route step per token-layer, hit rate, experts copied). On a CPU build the banks are RAM and a
"copy" is a memcpy: this measures the machinery's overhead, not PCIe (scripts/gpu_check.sh does that).

Usage: .venv/bin/python scripts/bench_engine.py [--rounds 3] [--reps 3] [--threads 1] [--layers 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.core.project import get_build  # noqa: E402
from harness.stats.intervals import mean_ci, ratio_ci  # noqa: E402
from harness.tools.synth import SynthSpec, write_synth_model  # noqa: E402

RUNS = [
    ("stock", "stock", None),
    ("engine fetch-all 100%", "patched", "mode=engine,policy=fetch-all,slots=100%"),
    ("engine quality 25% sync", "patched", "mode=engine,policy=quality,slots=25%,async=off"),
    ("engine quality 25% thread", "patched", "mode=engine,policy=quality,slots=25%,async=thread"),
]


def bench(bin_dir: Path, model: Path, spec: str | None, stats: Path, reps: int, threads: int,
          n_gen: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    if spec:
        env["LLAMA_MOE_CACHE"] = f"{spec},stats={stats}"
    res = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n_gen),
                          "-r", str(reps), "-t", str(threads), "--repack", "0", "-o", "jsonl"],
                         env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        sys.exit(f"bench_engine: llama-bench failed ({res.returncode}): {res.stderr[-2000:]}")
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return [float(x) for x in rows[0]["samples_ts"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench-engine.json")
    a = ap.parse_args()

    bins = {"stock": get_build("stock").bin_dir, "patched": get_build("patched").bin_dir}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=64, n_expert_used=8, n_layer=a.layers,
                                            n_embd=512, n_ff_exp=256, dtype="f16", seed=1), tmp / "m.gguf")
        samples: dict[str, list[float]] = {name: [] for name, _, _ in RUNS}
        stats: dict[str, dict] = {}  # type: ignore[type-arg]
        for r in range(a.rounds):
            for name, build, spec in RUNS:
                path = tmp / f"{r}-{name.replace(' ', '_').replace('%', '')}.json"
                samples[name] += bench(bins[build], model, spec, path, a.reps, a.threads, a.n_gen)
                if spec and path.exists():
                    stats[name] = json.loads(path.read_text())
            print(f"bench_engine: round {r + 1}/{a.rounds} done", file=sys.stderr)

    out = {"model": f"qwen3moe f16, {a.layers} layers, 64 experts of 512x256, top-8", "threads": a.threads,
           "n_gen": a.n_gen, "runs": {}}
    print(f"{'run':<28} {'tokens/s':>9} {'+/- 95%':>8} {'vs stock [95% CI]':>22}  route us/tl  hit rate  copied")
    for name, _, spec in RUNS:
        ci = mean_ci(samples[name])
        r = ratio_ci(samples[name], samples["stock"])
        s = stats.get(name)
        extra = ""
        if s:
            e = s.get("engine", {})
            extra = (f"  {s['route_ns_per_token_layer'] / 1e3:10.2f}  {s['total']['hit_rate']:8.3f}  "
                     f"{e.get('copied_experts', 0)} ({e.get('background_experts', 0)} bg, "
                     f"{e.get('deferred_experts', 0)} deferred, async={e.get('async')})")
        print(f"{name:<28} {ci.mean:9.2f} {ci.half_width:8.2f} {100 * r.ratio:7.1f}% [{100 * r.low:5.1f}, "
              f"{100 * r.high:5.1f}]{extra}")
        out["runs"][name] = {"spec": spec, "samples_ts": samples[name], "mean": ci.mean, "ci95": ci.half_width,
                             "vs_stock": r.ratio, "vs_stock_ci": [r.low, r.high], "stats": s}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"bench_engine: wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
