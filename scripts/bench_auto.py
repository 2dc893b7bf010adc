#!/usr/bin/env python3
"""`--moe-cache auto` against stock under memory limits (issue 35): never slower beyond the CI where stock runs, never
OOM-killed, never refused where stock runs. A benchmark: run it on a quiet machine.

    .venv/bin/python scripts/bench_auto.py --model models/studymoe-q8_0.gguf --limits 64M,128M,256M,512M \
        --reps 5 --out eval/auto-vs-stock

For each model, limit and repetition, one process of each build in a fresh memory cgroup of that limit (checked
against MemAvailable less a margin; the model file's page cache dropped first), stock and auto alternated: the
process is the sample. The process is llama-bench (`-p 0 -n --tokens -r 1`, decode t/s), or with --perplexity TEXT
llama-perplexity (`-c --ctx -b --batch -ub --ubatch --chunks 1`, whose logits ask for a whole batch). Recorded per
process: exit status, decode t/s (perplexity: passes/s, a pass --ctx tokens), the cgroup's peak and OOM kills, auto's
plan line. Both builds run with `--repack 0` (the file tier needs plain experts) and --threads.

Writes --out/results.jsonl (one record per process, with the settings) and --out/report.md.

Verdict rules, written before any run, per (model, limit) row:
- refused: auto fails where stock ran (exit 0) and its message does not say what to add -> FAIL;
- oom: an auto process OOM-killed (exit 137 or the cgroup's oom_kill count) -> FAIL;
- slower: where both ran every repetition, auto/stock decode t/s ratio of means with a 95% CI (the processes
  resampled, harness.stats.intervals.ratio_ci) whose upper end is below 1 -> FAIL; a CI that contains 1 or lies
  above it passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.core.errors import HarnessError  # noqa: E402
from harness.core.project import read_builds  # noqa: E402
from harness.core.sizes import parse_size  # noqa: E402
from harness.stats.intervals import ratio_ci  # noqa: E402
from harness.tools.cgroup import RAM_MARGIN, MemoryCgroup, check_ram_limit, drop_page_cache, mem_available  # noqa: E402

# what a refusal must name for "refused with the exact line to add" (the plan's one-line errors)
ADVICE = ("add --no-repack", "raise the memory limit", "load it with mmap", "-ub")


def _tool_cmd(tool: Path, model: Path, a: argparse.Namespace) -> list[str]:
    if a.perplexity:
        return [str(tool), "-m", str(model), "-f", str(a.perplexity), "-c", str(a.ctx), "-b", str(a.batch),
                "-ub", str(a.ubatch), "--chunks", "1", "-t", str(a.threads), "--no-repack"]
    return [str(tool), "-m", str(model), "-p", "0", "-n", str(a.tokens), "-r", "1", "-t", str(a.threads),
            "--repack", "0", "-o", "jsonl", "-v"]


def _rate(out: str, err: str, perplexity: bool) -> float | None:
    """Decode t/s of a llama-bench jsonl line, or llama-perplexity's passes per second of its one chunk (a pass is
    --ctx tokens: the ratio of the two builds is the same either way)."""
    if perplexity:
        for line in err.splitlines():  # "perplexity: 1.23 seconds per pass - ETA ..." is per chunk
            if "seconds per pass" in line:
                try:
                    return 1.0 / float(line.split("perplexity:")[1].split("seconds")[0])
                except (IndexError, ValueError):
                    return None
        return None
    for line in out.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            return float(rec["avg_ts"])
    return None


def run_one(build: str, tool: Path, model: Path, limit: int, a: argparse.Namespace) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("LLAMA_MOE_CACHE", None)
    if build == "auto":
        env["LLAMA_MOE_CACHE"] = "auto"
    drop_page_cache(model)
    with MemoryCgroup(limit, prefix="moe-subst-bench-auto") as cg:
        with cg.measure() as meter:
            t0 = time.time()
            rc, out, err = cg.run(_tool_cmd(tool, model, a), env, timeout=a.timeout)
            wall = time.time() - t0
        kills = cg.oom_kills()
    plan = next((ln.split("auto: ", 1)[1] for ln in err.splitlines() if "llama_expert_cache: auto: " in ln), "")
    failure = "" if rc == 0 else next((ln for ln in reversed(err.splitlines()) if ln.strip()), "")
    return {"model": model.name, "limit": limit, "build": build, "rc": rc, "rate": _rate(out, err, bool(a.perplexity)),
            "peak": meter.peak, "oom_kills": kills, "wall_s": round(wall, 3), "plan": plan, "failure": failure[:400]}


def verdict(rows: list[dict[str, object]]) -> tuple[str, str]:
    stock = [r for r in rows if r["build"] == "stock"]
    auto = [r for r in rows if r["build"] == "auto"]
    if any(r["rc"] == 137 or (r["oom_kills"] or 0) > 0 for r in auto):
        return "FAIL", "auto OOM-killed"
    stock_ran = all(r["rc"] == 0 for r in stock)
    if stock_ran and not all(r["rc"] == 0 for r in auto):
        said = " ".join(str(r["failure"]) for r in auto if r["rc"] != 0)
        if not any(x in said for x in ADVICE):
            return "FAIL", "refused where stock ran: " + said[:200]
        return "pass", "refused, naming what to add: " + said[:200]
    if not stock_ran or not all(r["rc"] == 0 for r in auto):
        return "pass", "stock did not run every repetition"
    s = [float(r["rate"]) for r in stock if r["rate"]]  # type: ignore[arg-type]
    p = [float(r["rate"]) for r in auto if r["rate"]]  # type: ignore[arg-type]
    if len(s) < 2 or len(p) < 2:
        return "n/a", "too few rates"
    r = ratio_ci(p, s)
    return ("FAIL" if r.high < 1 else "pass"), f"auto/stock {r.ratio:.2f}x [{r.low:.2f}, {r.high:.2f}]"


def report(records: list[dict[str, object]], a: argparse.Namespace) -> str:
    lines = ["# `--moe-cache auto` against stock under memory limits", "",
             f"Command: `{' '.join(sys.argv)}`", "",
             f"Each row: {a.reps} processes of each build, alternated, in a fresh memory cgroup; "
             f"{'llama-perplexity' if a.perplexity else 'llama-bench decode'} at {a.threads} threads, `--repack 0`, "
             f"read_ahead_kb of the disk: {a.readahead}.", "",
             "| model | limit | stock t/s (runs) | auto t/s (runs) | auto peak MiB | auto's plan | verdict |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(str(r["model"]), int(str(r["limit"]))) for r in records})
    n_fail = 0
    for model, limit in keys:
        rows = [r for r in records if r["model"] == model and r["limit"] == limit]

        def cell(build: str, rows: list[dict[str, object]] = rows) -> str:
            rs = [r for r in rows if r["build"] == build]
            rates = [float(r["rate"]) for r in rs if r["rc"] == 0 and r["rate"]]  # type: ignore[arg-type]
            ok = sum(1 for r in rs if r["rc"] == 0)
            m = f"{statistics.mean(rates):.1f}" if rates else "-"
            return f"{m} ({ok}/{len(rs)} ran)"
        auto = [r for r in rows if r["build"] == "auto"]
        peaks = [int(str(r["peak"])) for r in auto if r["peak"]]
        first = auto[0] if auto else {}
        plan = str(first.get("plan", "")).split(":")[0] or str(first.get("failure", ""))[:80]
        v, why = verdict(rows)
        n_fail += v == "FAIL"
        lines.append(f"| {model} | {limit >> 20} MiB | {cell('stock')} | {cell('auto')} | "
                     f"{max(peaks) / 2**20:.0f} | `{plan}` | {v}: {why} |" if peaks else
                     f"| {model} | {limit >> 20} MiB | {cell('stock')} | {cell('auto')} | - | `{plan}` | {v}: {why} |")
    lines += ["", f"Rows failing a rule: {n_fail} of {len(keys)}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, type=Path)
    ap.add_argument("--limits", required=True, help="memory limits, comma-separated (64M,256M,1G)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--perplexity", type=Path, help="run llama-perplexity on this text instead of llama-bench")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    try:
        builds = read_builds(ROOT)
        tools = {"stock": builds["stock"].tool("llama-perplexity" if a.perplexity else "llama-bench"),
                 "auto": builds["patched"].tool("llama-perplexity" if a.perplexity else "llama-bench")}
        limits = [parse_size(x).resolve(0) for x in a.limits.split(",")]
        for lim in limits:
            check_ram_limit(lim, mem_available(), RAM_MARGIN)
        a.readahead = _readahead()
        a.out.mkdir(parents=True, exist_ok=True)
        records: list[dict[str, object]] = []
        with open(a.out / "results.jsonl", "a") as f:
            for model in a.model:
                for lim in limits:
                    for rep in range(a.reps):
                        for build in (("stock", "auto") if rep % 2 == 0 else ("auto", "stock")):
                            rec = run_one(build, tools[build], model, lim, a)
                            rec.update(rep=rep, threads=a.threads, readahead_kb=a.readahead,
                                       tool="llama-perplexity" if a.perplexity else "llama-bench")
                            rec.update({"ctx": a.ctx, "batch": a.batch, "ubatch": a.ubatch} if a.perplexity else
                                       {"tokens": a.tokens})
                            records.append(rec)
                            f.write(json.dumps(rec) + "\n")
                            f.flush()
                            print(f"bench_auto: {model.name} {lim >> 20} MiB {build} rep {rep}: rc {rec['rc']} "
                                  f"rate {rec['rate']}", file=sys.stderr)
        (a.out / "report.md").write_text(report(records, a))
        print(report(records, a))
    except HarnessError as e:
        print(f"bench_auto: error: {e}", file=sys.stderr)
        return 1
    return 0


def _readahead() -> str:
    try:
        dev = os.stat(ROOT).st_dev
        path = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        ra = path / "queue" / "read_ahead_kb"
        if not ra.exists():
            ra = path.parent / (path.resolve().parent.name) / "queue" / "read_ahead_kb"
        return ra.read_text().strip() + " KiB"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
