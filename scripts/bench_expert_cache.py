#!/usr/bin/env python3
"""Benchmarks of the expert cache's emulate mode (issue 3). Results, not tests.

1. Host cost of the route step per token and MoE layer (target <= 2 us, k = 8-10, 64-512 experts): the real
   route op of the patched libllama, called directly (scripts/bench_route_step.cpp), one token per call
   (decode) and 128 per call, on synthetic router logits. (The engine also reports its own measurement in
   the stats JSON, `route_ns_per_token_layer`.)
2. Throughput of emulate mode against stock (target >= 90%): llama-perplexity tokens/s (wall time of the
   process) and llama-bench pp512/tg64, stock and patched interleaved, on a generated f16 model (q8_0
   hits SIGILL in the CPU AMX path on this host, stock too).
   Medians, with min and max; on a shared host the spread can be large.

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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.core.project import get_build  # noqa: E402
from harness.tools.synth import SynthSpec, synth_text, write_synth_model  # noqa: E402


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
    ap.add_argument("--skip-route", action="store_true", help="only the throughput part")
    ap.add_argument("--skip-throughput", action="store_true", help="only the route-step part")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench-expert-cache.json"))
    a = ap.parse_args()

    stock = get_build("stock")
    patched = get_build("patched")
    tmp = Path(tempfile.mkdtemp(prefix="bench-ecache-"))
    text = tmp / "text.txt"
    text.write_text(synth_text(150000, seed=2))
    results: dict[str, object] = {"threads": a.threads, "reps": a.reps}

    # 1. route-step cost: the real route op of libllama called directly (scripts/bench_route_step.cpp)
    tree = ROOT / "vendor" / "llama.cpp-patched"
    exe = tmp / "bench_route_step"
    subprocess.run(["c++", "-O2", "-std=c++17", f"-I{tree}/include", f"-I{tree}/ggml/include", f"-I{tree}/src",
                    f"-I{ROOT}/src/llama", f"-I{ROOT}/src/include",
                    str(ROOT / "scripts" / "bench_route_step.cpp"), f"-L{patched.bin_dir}", "-lllama", "-lggml",
                    "-lggml-base", f"-Wl,-rpath,{patched.bin_dir}", "-o", str(exe)], check=True)
    route: list[dict[str, object]] = []
    for n_expert, k in (() if a.skip_route else ((64, 8), (128, 8), (256, 8), (512, 10))):
        model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=n_expert, n_expert_used=k, n_layer=2, seed=1),
                                  tmp / f"route-e{n_expert}.gguf")
        for spec in ("policy=quality", "policy=speed", "policy=fetch-all", "rule=substitute-all,admit=off"):
            for batch in (1, 128):
                out = run([str(exe), str(model), f"{spec},slots=25%", "8192", str(batch)], None)
                row = json.loads(out)
                route.append(row)
                print(f"route step: E={n_expert:4d} k={k:2d} batch={batch:3d} {spec:30s} "
                      f"{row['ns_per_token_layer'] / 1000:.3f} us/token-layer (miss {row['miss_rate']:.3f}, "
                      f"subst {row['substitution_rate']:.3f})", flush=True)
    results["route"] = route

    # 2. throughput, stock vs emulate, interleaved: llama-perplexity (wall time) and llama-bench (pp, tg)
    if a.skip_throughput:
        return finish(results, Path(a.out))
    model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=64, n_expert_used=8, n_layer=4, n_embd=512,
                                        n_ff_exp=128, n_head=8, n_head_kv=4, dtype="f16", seed=1), tmp / "thr.gguf")
    configs: list[tuple[str, Path, str | None]] = [
        ("stock", stock.tool("llama-perplexity"), None),
        ("patched-off", patched.tool("llama-perplexity"), None),
        ("emulate-quality", patched.tool("llama-perplexity"), "mode=emulate,policy=quality,slots=25%"),
        ("emulate-fetch-all", patched.tool("llama-perplexity"), "mode=emulate,policy=fetch-all,slots=25%"),
    ]
    ppl: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    for _ in range(a.reps):
        for name, tool, spec in configs:
            t0 = time.perf_counter()
            run([str(tool), "-m", str(model), "-f", str(text), "-c", "256", "-b", "256", "--chunks", "12",
                 "-t", a.threads], spec)
            ppl[name].append(12 * 256 / (time.perf_counter() - t0))
    base = statistics.median(ppl["stock"])
    for name, xs in ppl.items():
        print(f"llama-perplexity: {name:18s} median {statistics.median(xs):9.1f} tokens/s (n={len(xs)}, "
              f"min {min(xs):.1f}, max {max(xs):.1f})  {100 * statistics.median(xs) / base:6.1f}% of stock",
              flush=True)
    results["perplexity_tokens_per_s"] = ppl

    thr: dict[str, dict[str, list[float]]] = {}
    for test, (p, n) in (("pp512", (512, 0)), ("tg64", (0, 64))):
        thr[test] = {"stock": [], "emulate-quality": [], "emulate-fetch-all": []}
        for _ in range(a.reps):
            thr[test]["stock"] += bench_ts(stock.tool("llama-bench"), model, a.threads, None, p, n, 1)
            thr[test]["emulate-quality"] += bench_ts(patched.tool("llama-bench"), model, a.threads,
                                                     "mode=emulate,policy=quality,slots=25%", p, n, 1)
            thr[test]["emulate-fetch-all"] += bench_ts(patched.tool("llama-bench"), model, a.threads,
                                                       "mode=emulate,policy=fetch-all,slots=25%", p, n, 1)
        base = statistics.median(thr[test]["stock"])
        for name, xs in thr[test].items():
            m = statistics.median(xs)
            print(f"llama-bench {test}: {name:18s} median {m:9.2f} t/s (n={len(xs)}, min {min(xs):.2f}, "
                  f"max {max(xs):.2f})  {100 * m / base:6.1f}% of stock", flush=True)
    results["bench_tokens_per_s"] = thr

    return finish(results, Path(a.out))


def finish(results: dict[str, object], out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
