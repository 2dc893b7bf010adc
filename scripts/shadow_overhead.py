#!/usr/bin/env python3
"""What the shadow estimate costs in decode (issue 37, rule 3 of eval/shadow-estimate/RULES.md).

llama-bench of the patched build, decode only (`-p 0 -n N`), emulate mode with `policy=quality,slots=25%` on the
given model, with and without `shadow=EVERY`: PROCESSES processes per row, the rows interleaved (A B A B ...), the
process as the sample (its tokens/s is the mean of its repetitions). The slowdown is 1 - (with / without) with a
bootstrap 95% CI over processes. Raw records: OUT/overhead.jsonl (one line per process); summary: OUT/overhead.md.

    .venv/bin/python scripts/shadow_overhead.py --out eval/shadow-estimate
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.parsers.bench import parse_bench_json  # noqa: E402
from harness.stats.intervals import ratio_ci  # noqa: E402

BENCH = ROOT / "vendor/llama.cpp-patched/build-cpu/bin/llama-bench"


def one(model: Path, spec: str, n_gen: int, reps: int, threads: int) -> float:
    env = {**{k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}, "LLAMA_MOE_CACHE": spec}
    argv = [str(BENCH), "-m", str(model), "-p", "0", "-n", str(n_gen), "-r", str(reps), "-t", str(threads),
            "-o", "json"]
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"shadow_overhead: llama-bench failed ({p.returncode}): {(p.stderr or '').strip()[-300:]}")
    return parse_bench_json(p.stdout)[0].avg_ts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "eval/shadow-estimate")
    ap.add_argument("--model", type=Path, default=ROOT / "models/localmoe-q8_0.gguf")
    ap.add_argument("--every", type=int, default=32)
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    if not BENCH.exists():
        raise SystemExit(f"shadow_overhead: {BENCH} is not built: run ./build.sh")
    base = "mode=emulate,policy=quality,slots=25%"
    rows = {"without": base, "with": f"{base},shadow={a.every}"}
    a.out.mkdir(parents=True, exist_ok=True)
    rec = a.out / "overhead.jsonl"
    samples: dict[str, list[float]] = {k: [] for k in rows}
    one(a.model, base, 16, 1, a.threads)  # a discarded warm-up process (page cache)
    for i in range(a.processes):
        for name, spec in rows.items():
            ts = one(a.model, spec, a.n_gen, a.reps, a.threads)
            samples[name].append(ts)
            with rec.open("a") as fh:
                fh.write(json.dumps({"process": i, "row": name, "spec": spec, "model": a.model.name,
                                     "n_gen": a.n_gen, "reps": a.reps, "threads": a.threads, "tokens_per_s": ts})
                         + "\n")
            print(f"{i} {name}: {ts:.2f} t/s", flush=True)
    r = ratio_ci(samples["with"], samples["without"])
    slow, lo, hi = 100 * (1 - r.ratio), 100 * (1 - r.high), 100 * (1 - r.low)
    ok = slow <= 5.0
    text = (f"# The shadow estimate's decode overhead\n\nllama-bench -p 0 -n {a.n_gen} -r {a.reps} -t {a.threads}, "
            f"{a.model.name}, `{base}` with and without `shadow={a.every}`, {a.processes} processes per row, "
            f"interleaved, the process as the sample (records: overhead.jsonl; read_ahead_kb of the disk 8192; "
            f"repack at llama-bench's default).\n\n| row | tokens/s per process |\n|---|---|\n"
            + "".join(f"| {k} | {', '.join(f'{x:.2f}' for x in v)} |\n" for k, v in samples.items())
            + f"\nSlowdown {slow:+.2f}% [{lo:+.2f}, {hi:+.2f}] (95% bootstrap CI over processes). Rule 3 (point "
            f"estimate at most 5%): **{'held' if ok else 'did not hold'}**.\n")
    (a.out / "overhead.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
