#!/usr/bin/env python3
"""Replay speed of llama-moe-sim: token-layer decisions per second (goal: >= 1 million on the dev machine).

Writes a synthetic router trace at the scale of the study's model (Qwen3-Next-80B-A3B: 48 MoE layers,
512 experts, top-10; harness.parsers.trace.synthetic_trace: Zipf popularity with topic changes), or takes a
recorded one (--trace), replays it under each policy at each residency (--repeat times, after one
warm-up replay), and prints the decision rate of each and the slowest. A benchmark, not a test: record
the numbers, do not assert them.

    .venv/bin/python scripts/bench_sim.py                     # synthetic trace, 2048 tokens
    .venv/bin/python scripts/bench_sim.py --trace t.bin --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.core.project import get_build  # noqa: E402
from harness.orchestration.simulate import sim_args, sim_spec  # noqa: E402
from harness.parsers.sim import SIM_TOOL, parse_sim_summary  # noqa: E402
from harness.parsers.trace import read_trace_header, synthetic_trace, write_expert_trace  # noqa: E402
from harness.tools.runners import run_tool  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, help="a recorded trace (default: a synthetic one)")
    ap.add_argument("--tokens", type=int, default=2048, help="synthetic trace: tokens (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--top-m", type=int, default=16, help="router scores per record (default: %(default)s)")
    ap.add_argument("--policies", default="quality,speed,fetch-all")
    ap.add_argument("--residency", default="10%,25%,50%")
    ap.add_argument("--repeat", type=int, default=5, help="replays per measurement (default: %(default)s)")
    ap.add_argument("--threads", default="1,0", help="comma-separated thread counts to measure, 0 = the tool's "
                    "default (the CPUs) (default: %(default)s)")
    ap.add_argument("--zipf", type=float, default=1.0, help="synthetic trace: popularity skew (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    args = ap.parse_args()

    tool = get_build("patched").tool(SIM_TOOL)
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        if trace is None:
            trace = Path(tmp) / "synthetic.bin"
            write_expert_trace(trace, synthetic_trace(n_layer=args.layers, n_expert=args.experts, k=args.top_k,
                                                      n_tokens=args.tokens, top_m=args.top_m, zipf=args.zipf,
                                                      seed=0))
        h = read_trace_header(trace)
        print(f"trace: {trace if args.trace else 'synthetic'}: {h.n_records} token-layers, {h.n_expert} experts, "
              f"k={h.k}, top_m={h.top_m}; {args.repeat} replays per measurement after one warm-up")
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
              "(a busy machine lowers the wall-time rate; the CPU-time rate is the steadier figure)")
        results: list[dict[str, object]] = []
        for threads in [int(t) for t in args.threads.split(",") if t.strip()]:
            for res in [r.strip() for r in args.residency.split(",") if r.strip()]:
                for pol in [p.strip() for p in args.policies.split(",") if p.strip()]:
                    spec = sim_spec(pol, res)
                    stats, n = Path(tmp) / "s.json", threads or None
                    run_tool(tool, sim_args(trace, spec, stats=stats, threads=n), sample_gpu=False)  # warm-up
                    out = run_tool(tool, sim_args(trace, spec, stats=stats, threads=n, repeat=args.repeat),
                                   sample_gpu=False)
                    s = parse_sim_summary(out.stderr)
                    hit = json.loads((Path(tmp) / "s.json").read_text())["total"]["hit_rate"]
                    results.append({"policy": pol, "residency": res, "spec": spec, "threads": s.threads,
                                    "hit_rate": hit, "decisions": s.decisions, "repeat": s.repeat,
                                    "seconds": s.seconds, "cpu_seconds": s.cpu_seconds,
                                    "decisions_per_s": s.decisions_per_s, "decisions_per_cpu_s": s.decisions_per_cpu_s})
                    print(f"  {s.threads:2d} threads  {pol:10s} {res:>5s} (hit rate {100 * hit:4.1f}%): "
                          f"{s.decisions_per_s / 1e6:6.2f} million decisions/s wall, "
                          f"{s.decisions_per_cpu_s / 1e6:6.2f} per CPU-second")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for threads in sorted({int(str(r["threads"])) for r in results}):
        mine = [r for r in results if r["threads"] == threads]
        slowest = min(mine, key=lambda r: float(str(r["decisions_per_s"])))
        print(f"slowest with {threads} threads: {slowest['policy']} at {slowest['residency']}: "
              f"{float(str(slowest['decisions_per_s'])) / 1e6:.2f} million decisions/s wall (goal: >= 1)")
    if args.json:
        args.json.write_text(json.dumps({"schema_version": 1, "machine": platform.node(),
                                         "cpu": platform.processor() or platform.machine(),
                                         "trace": {"n_records": h.n_records, "n_expert": h.n_expert, "k": h.k,
                                                   "top_m": h.top_m, "synthetic": args.trace is None,
                                                   "zipf": args.zipf if args.trace is None else None},
                                         "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
