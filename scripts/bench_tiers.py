#!/usr/bin/env python3
"""Expert tiers benchmark (issue 11): a MoE model bigger than the RAM its runs may use, decoded by stock llama.cpp
(experts paged in from the SSD through mmap) and by the engine reading missed experts from the model file
(`host=file`), all under the same RAM limit. Results, not tests.

How RAM is made scarce: a memory cgroup made for this benchmark alone, inside this process's own memory cgroup
(v1 or v2), whose limit counts the page cache (harness.tools.cgroup, which `harness compare --ram` uses too); each
run is one process started inside it; the cgroup is removed at the end, also on Ctrl-C. The limit is refused when
it exceeds MemAvailable minus a 2 GiB margin (a limit cannot starve the machine, but the runs inside it must not
either). Before each run the model file's pages are dropped from the page cache (posix_fadvise DONTNEED; clean
pages, no root needed), so that no run inherits another's cache.

Per run: decode tokens/s (llama-bench tg, mean and 95% CI over the rounds, interleaved), bytes read from storage
per generated token (the process's read_bytes, load excluded, from a run of 1 token), and for the engine its floor:
bytes read per token / the disk bandwidth this script measures (reads of one expert tensor's slice, the engine's
read size; measured before every round, the median used) plus the compute time with everything in RAM (stock
with the file in the page cache, no limit).

Usage: .venv/bin/python scripts/bench_tiers.py [--layers 5] [--ram 1600M] [--rounds 3] [--tokens 16]
       [--model FILE] [--slots 25%] [--out results/bench-tiers.json]
The default model (qwen3moe, the study's expert shape: 512 experts of 2048x512, top-10, Q4_0, 5 layers, 4.6 GB)
is generated once into results/ (about 6 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.core.errors import HarnessError  # noqa: E402
from harness.core.project import get_build  # noqa: E402
from harness.core.sizes import format_bytes, parse_size  # noqa: E402
from harness.parsers.gguf_model import read_model_info  # noqa: E402
from harness.stats.intervals import mean_ci, ratio_ci  # noqa: E402
from harness.tools.cgroup import MemoryCgroup, check_ram_limit, mem_available  # noqa: E402
from harness.tools.cgroup import drop_page_cache as drop_cache  # noqa: E402


def engine(policy: str, slots: str) -> str:
    return f"mode=engine,policy={policy},slots={slots},host=file"


def disk_bandwidth(path: Path, chunk: int, n: int = 200, seed: int = 0) -> tuple[float, float]:
    """(sequential MB/s with 16 MiB reads over 1 GiB, MB/s of `n` reads of `chunk` bytes at random offsets), both
    from a dropped page cache."""
    size = path.stat().st_size
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < min(size, 1 << 30):
            b = os.pread(fd, 16 << 20, done)
            if not b:
                break
            done += len(b)
        seq = done / (time.perf_counter() - t0) / 1e6
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        rng = random.Random(seed)
        offs = [rng.randrange(0, size - chunk) for _ in range(n)]
        t0 = time.perf_counter()
        for o in offs:
            os.pread(fd, chunk, o)
        rand = n * chunk / (time.perf_counter() - t0) / 1e6
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return seq, rand


def io_read_bytes_of_children() -> int:
    """Storage bytes read by this process's waited-for children (Linux counts ru_inblock in 512-byte units)."""
    return int(resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock) * 512


def bench(cg: MemoryCgroup | None, bin_dir: Path, model: Path, spec: str | None, n_gen: int, threads: int,
          stats: Path | None) -> tuple[list[float], int, str]:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    if spec:
        env["LLAMA_MOE_CACHE"] = spec + (f",stats={stats}" if stats else "")
    args = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(n_gen), "-r", "1",
            "-t", str(threads), "--repack", "0", "-o", "jsonl"]
    before = io_read_bytes_of_children()
    if cg is None:
        res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3600)
        rc, out, err = res.returncode, res.stdout, res.stderr
    else:
        rc, out, err = cg.run(args, env, timeout=3600)
    read = io_read_bytes_of_children() - before
    if rc != 0:
        why = "killed (out of memory in the limit?)" if rc in (-9, 137) else f"exit {rc}"
        return [], read, f"{why}: {err.strip().splitlines()[-1] if err.strip() else ''}"
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [float(x) for x in rows[0]["samples_ts"]], read, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--ram", default="1600M", help="the RAM limit of every run (page cache counted)")
    ap.add_argument("--slots", default="25%")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policies", default="fetch-all,quality,speed")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench-tiers.json")
    a = ap.parse_args()

    bins = {"stock": get_build("stock").bin_dir, "patched": get_build("patched").bin_dir}
    model = a.model or ROOT / "results" / f"tiers-qwen3moe-e512k10-L{a.layers}-q4_0.gguf"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        print(f"bench_tiers: generating {model} (the study's expert shape, {a.layers} layers)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "harness", "synth", "-o", str(model), "--arch", "qwen3moe",
                        "--layers", str(a.layers), "--experts", "512", "--top-k", "10", "--embd", "2048",
                        "--ff", "512", "--heads", "16", "--kv-heads", "2", "--dtype", "q4_0"], check=True, cwd=ROOT)
    info = read_model_info(model)
    limit = parse_size(a.ram, allow_percent=False).bytes or 0
    try:
        check_ram_limit(limit, mem_available())
    except HarnessError as e:
        sys.exit(f"bench_tiers: {e}")
    file_bytes = model.stat().st_size
    print(f"bench_tiers: model {model.name}: {format_bytes(file_bytes)} ({file_bytes / limit:.2f}x the RAM limit "
          f"{format_bytes(limit)}), {info.n_moe_layers} MoE layers x {info.n_expert} experts, top-{info.n_expert_used}",
          file=sys.stderr)
    if file_bytes < 2.5 * limit:
        print("bench_tiers: warning: the model is less than 2.5x the RAM limit", file=sys.stderr)

    chunk = max(t.n_bytes // info.n_expert for t in info.expert_tensors)
    disk: list[tuple[float, float]] = []

    def measure_disk() -> None:
        seq, rand = disk_bandwidth(model, chunk, seed=len(disk))
        disk.append((seq, rand))
        print(f"bench_tiers: disk: {seq:.0f} MB/s sequential (16 MiB reads), {rand:.0f} MB/s in reads of one expert "
              f"tensor slice ({format_bytes(chunk)}) at random offsets", file=sys.stderr)

    measure_disk()

    # compute with everything in RAM: stock, file cached, no limit
    subprocess.run(["cat", str(model)], stdout=subprocess.DEVNULL, check=True)
    ram_ts, _, err = bench(None, bins["stock"], model, None, a.tokens, a.threads, None)
    if err:
        sys.exit(f"bench_tiers: the in-RAM stock run failed: {err}")
    compute_ms = 1000.0 / (sum(ram_ts) / len(ram_ts))
    print(f"bench_tiers: in RAM (no limit, file cached): stock {sum(ram_ts) / len(ram_ts):.2f} t/s "
          f"= {compute_ms:.1f} ms/token of compute", file=sys.stderr)

    runs: list[tuple[str, str, str | None]] = [("stock (mmap)", "stock", None)]
    runs += [(f"engine {p} {a.slots} host=file", "patched", engine(p, a.slots)) for p in a.policies.split(",")]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    reads: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    stats_doc: dict[str, dict] = {}  # type: ignore[type-arg]
    errors: dict[str, str] = {}
    try:
        cg = MemoryCgroup(limit, "moe-subst-bench")
    except HarnessError as e:
        sys.exit(f"bench_tiers: {e}")

    def stop(signum: int, frame: object) -> None:
        cg.close()
        sys.exit(f"bench_tiers: interrupted (signal {signum}); the cgroup is removed")

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    tmp = a.out.parent / "bench-tiers-stats"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        # load-only reads (1 token), per configuration, for the bytes read per generated token
        load_reads: dict[str, int] = {}
        for name, build, spec in runs:
            drop_cache(model)
            _, load_reads[name], err = bench(cg, bins[build], model, spec, 1, a.threads, None)
            if err:
                errors[name] = err
        for r in range(a.rounds):
            if r > 0:
                measure_disk()  # the disk of a shared machine varies: measured every round, the median is used
            for name, build, spec in runs:
                if name in errors:
                    continue
                drop_cache(model)
                st = tmp / f"{r}-{len(samples[name])}.json" if spec else None
                ts, read, err = bench(cg, bins[build], model, spec, a.tokens, a.threads, st)
                if err:
                    errors[name] = err
                    continue
                samples[name] += ts
                reads[name].append(max(0, read - load_reads[name]) / (a.tokens - 1))
                if st and st.exists():
                    stats_doc[name] = json.loads(st.read_text())
                print(f"bench_tiers: round {r + 1}/{a.rounds} {name}: {sum(ts) / len(ts):.2f} t/s", file=sys.stderr)
    finally:
        cg.close()

    seq = sorted(d[0] for d in disk)[len(disk) // 2]
    rand = sorted(d[1] for d in disk)[len(disk) // 2]
    print(f"bench_tiers: disk, median of {len(disk)} measurements: {seq:.0f} MB/s sequential, {rand:.0f} MB/s in "
          "expert-slice reads", file=sys.stderr)
    out: dict[str, object] = {"model": str(model), "disk_samples_MBps": disk, "file_bytes": file_bytes,
                              "ram_limit": limit,
                              "disk_seq_MBps": seq, "disk_chunk_MBps": rand, "chunk_bytes": chunk,
                              "compute_ms_in_ram": compute_ms, "tokens": a.tokens, "threads": a.threads,
                              "rounds": a.rounds, "runs": {}}
    stock = samples[runs[0][0]]
    print(f"\n{'run':<34} {'tokens/s':>9} {'95% CI':>8} {'vs stock':>9} {'MB read/token':>14} {'floor t/s':>10} "
          f"{'floor/run':>9}")
    for name, _, spec in runs:
        if name in errors or not samples[name]:
            print(f"{name:<34} {errors.get(name, 'no samples')}")
            out["runs"][name] = {"spec": spec, "error": errors.get(name)}  # type: ignore[index]
            continue
        ci = mean_ci(samples[name])
        rc = ratio_ci(samples[name], stock) if stock else None
        mb = sum(reads[name]) / len(reads[name]) / 1e6
        floor_ms = mb / rand * 1000.0 + compute_ms
        vs = f"{rc.ratio:8.2f}x" if rc else "       -"
        print(f"{name:<34} {ci.mean:9.2f} {ci.half_width:8.2f} {vs} {mb:14.1f} {1000.0 / floor_ms:10.2f} "
              f"{(1000.0 / floor_ms) / ci.mean:8.2f}x")
        out["runs"][name] = {  # type: ignore[index]
            "spec": spec, "samples_ts": samples[name], "mean": ci.mean, "ci95": ci.half_width,
            "vs_stock": rc.ratio if rc else None, "vs_stock_ci": [rc.low, rc.high] if rc else None,
            "read_bytes_per_token": mb * 1e6, "floor_ts": 1000.0 / floor_ms, "stats": stats_doc.get(name)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"bench_tiers: wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
