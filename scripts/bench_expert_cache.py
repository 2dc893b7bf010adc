#!/usr/bin/env python3
"""Benchmarks of the expert cache's emulate mode (issue 3). Results, not tests.

1. Host cost of the route step per token and MoE layer (target <= 2 us, k = 8-10, 64-512 experts):
   llama-bench decode (-p 0 -n N, ubatch 1) and llama-perplexity (ubatch = n_ctx) in emulate mode on
   generated models; the engine measures the route step itself (stats JSON `route_ns_per_token_layer`).
2. Throughput of emulate mode against stock (target >= 90%): llama-bench pp and tg, stock and patched
   interleaved, on a generated model with larger matrices.

Usage: .venv/bin/python scripts/bench_expert_cache.py [--reps 3] [--threads 2] [--out results/bench-expert-cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.project import get_build  # noqa: E402
from harness.synth import SynthSpec, synth_text, write_synth_model  # noqa: E402


def run(args: list[str], spec: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    if spec:
        env["LLAMA_MOE_CACHE"] = spec
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"failed: {' '.join(args)}\n{(res.stdout + res.stderr)[-3000:]}")
    return res.stdout


def bench_ts(bench: Path, model: Path, threads: str, spec: str | None, p: int, n: int, reps: int) -> list[float]:
    out = run([str(bench), "-m", str(model), "-t", threads, "-p", str(p), "-n", str(n), "-r", str(reps),
               "-o", "json"], spec)
    data = json.loads(out)
    return [float(x) for x in data[0]["samples_ts"]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench-expert-cache.json"))
    a = ap.parse_args()

    stock = get_build("stock")
    patched = get_build("patched")
    tmp = Path(tempfile.mkdtemp(prefix="bench-ecache-"))
    text = tmp / "text.txt"
    text.write_text(synth_text(40000, seed=2))
    results: dict[str, object] = {"threads": a.threads, "reps": a.reps}

    # 1. route-step cost
    route: list[dict[str, object]] = []
    for n_expert, k in ((64, 8), (128, 8), (256, 8), (512, 10)):
        model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=n_expert, n_expert_used=k, n_layer=4, seed=1),
                                  tmp / f"route-e{n_expert}.gguf")
        for policy in ("quality", "fetch-all"):
            for kind in ("decode", "batch"):
                stats = tmp / f"stats-{n_expert}-{policy}-{kind}.json"
                spec = f"mode=emulate,policy={policy},slots=25%,stats={stats}"
                if kind == "decode":
                    run([str(patched.tool("llama-bench")), "-m", str(model), "-t", a.threads, "-p", "0", "-n", "256",
                         "-r", "2", "-o", "json"], spec)
                else:
                    run([str(patched.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "256",
                         "-b", "256", "--chunks", "8", "-t", a.threads], spec)
                s = json.loads(stats.read_text())
                row = {"n_expert": n_expert, "k": k, "policy": policy, "kind": kind,
                       "route_ns_per_token_layer": s["route_ns_per_token_layer"],
                       "miss_rate": s["total"]["miss_rate"], "substitution_rate": s["total"]["substitution_rate"]}
                route.append(row)
                print(f"route step: E={n_expert:4d} k={k:2d} {policy:9s} {kind:6s} "
                      f"{s['route_ns_per_token_layer'] / 1000:.3f} us/token-layer "
                      f"(miss {s['total']['miss_rate']:.3f}, subst {s['total']['substitution_rate']:.3f})", flush=True)
    results["route"] = route

    # 2. throughput, stock vs emulate, interleaved
    model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=128, n_expert_used=8, n_layer=4, n_embd=512,
                                        n_ff_exp=256, n_head=8, n_head_kv=4, seed=1), tmp / "thr.gguf")
    thr: dict[str, dict[str, list[float]]] = {}
    for test, (p, n) in (("pp512", (512, 0)), ("tg64", (0, 64))):
        thr[test] = {"stock": [], "emulate-quality": [], "emulate-fetch-all": []}
        for _ in range(a.reps):
            thr[test]["stock"] += bench_ts(stock.tool("llama-bench"), model, a.threads, None, p, n, 1)
            thr[test]["emulate-quality"] += bench_ts(patched.tool("llama-bench"), model, a.threads,
                                                     "mode=emulate,policy=quality,slots=25%", p, n, 1)
            thr[test]["emulate-fetch-all"] += bench_ts(patched.tool("llama-bench"), model, a.threads,
                                                       "mode=emulate,policy=fetch-all,slots=25%", p, n, 1)
        base = statistics.mean(thr[test]["stock"])
        for name, xs in thr[test].items():
            m = statistics.mean(xs)
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            print(f"throughput {test}: {name:18s} {m:9.2f} t/s (sd {sd:.2f}, n={len(xs)})  "
                  f"{100 * m / base:6.1f}% of stock", flush=True)
    results["throughput"] = thr

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
