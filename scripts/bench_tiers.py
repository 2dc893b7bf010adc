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
from harness.domain.costmodel import TokenWork, cache_work  # noqa: E402
from harness.domain.plan import slots_for_residency  # noqa: E402
from harness.orchestration.simulate import SimulateOptions, run_calibrate, simulate  # noqa: E402
from harness.parsers.gguf_model import ModelInfo, read_model_info  # noqa: E402
from harness.stats.intervals import mean_ci, ratio_ci  # noqa: E402
from harness.tools.cgroup import MemoryCgroup, check_ram_limit, mem_available  # noqa: E402
from harness.tools.cgroup import drop_page_cache as drop_cache  # noqa: E402


def engine(policy: str, slots: str) -> str:
    """The engine's spec for a policy item: a preset name, optionally with more keys ("quality,tau_file=0.3")."""
    name, _, more = policy.partition(",")
    return f"mode=engine,policy={name},slots={slots},host=file" + (f",{more}" if more else "")


def token_work(info: ModelInfo, doc: dict) -> TokenWork:  # type: ignore[type-arg]
    """What one decoded token of an engine run cost (its statistics), for the cost model."""
    t = doc["total"]
    tokens = max(1, int(t["tokens"]))
    return cache_work(info, int(t["fetches"]) / tokens, admissions_per_token=int(t["admissions"]) / tokens)


def in_ram_work(info: ModelInfo) -> TokenWork:
    """Stock with every expert in RAM: the compute alone (the k selected experts and the non-expert weights)."""
    experts = info.n_expert_used * info.bytes_per_expert * info.n_moe_layers
    return TokenWork(n_layers=info.n_layers, resident_bytes=info.non_expert_bytes + experts)


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
          stats: Path | None, n_prompt: int = 0, ubatch: int | None = None) -> tuple[list[float], int, str]:
    """llama-bench: tg n_gen (or, with n_prompt, pp n_prompt without warmup: a cold prompt) -> (t/s samples,
    storage bytes read, error)."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    if spec:
        env["LLAMA_MOE_CACHE"] = spec + (f",stats={stats}" if stats else "")
    args = [str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(n_prompt), "-n", str(0 if n_prompt else n_gen),
            "-r", "1", "-t", str(threads), "--repack", "0", "-o", "jsonl"]
    if n_prompt:
        args.append("--no-warmup")
    if ubatch:
        args += ["-ub", str(ubatch)]
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


def cost_model(a: argparse.Namespace, info: ModelInfo, model: Path, compute_ms: float, trace: Path,
               runs: dict[str, tuple[str, list[float], dict | None]]) -> dict[str, dict[str, float]]:  # type: ignore[type-arg]
    """The cost model (harness calibrate, harness simulate): a disk profile fitted to the compute in RAM and the
    fetch-all run (the default readers), then the simulator's estimate for every preset from the fetch-all run's
    trace, against the measurement (the presets other than fetch-all are predictions: not in the fit)."""
    fit_runs = [{"name": "stock in RAM", "work": in_ram_work(info).__dict__, "ms": compute_ms}]
    for name, (spec, ts, doc) in runs.items():
        if spec == engine("fetch-all", a.slots) and doc is not None:
            fit_runs.append({"name": name, "work": token_work(info, doc).__dict__, "ms": 1000.0 / (sum(ts) / len(ts))})
    runs_path = a.out.with_suffix(".calibration.jsonl")
    runs_path.write_text("".join(json.dumps(r) + "\n" for r in fit_runs))
    prof_path = a.out.with_suffix(".profile.json")
    res: dict[str, dict[str, float]] = {}
    try:
        fitted = run_calibrate(runs_path, a.profile, prof_path, name=f"{a.profile}-bench-tiers")
        print(f"\ncost model: harness calibrate --base {a.profile} {runs_path} -o {prof_path}: disk "
              f"{fitted.h2d_bw_gbs:.2f} GB/s, compute {fitted.vram_bw_gbs:.1f} GB/s + {fitted.layer_fixed_us:.0f} us "
              f"per layer, {fitted.fetch_latency_us:.0f} us per read, {fitted.layer_roundtrip_us:.0f} us per route "
              "step")
        if not trace.exists():
            return res
        presets = tuple(p for p in a.policies.split(";") if "," not in p)
        sims = simulate(SimulateOptions(trace=trace, model=model, policies=presets, residencies=(a.slots,),
                                        profile=str(prof_path)))
        print(f"harness simulate --trace {trace} --model {model} --residency {a.slots} --profile {prof_path}")
        print(f"{'policy':<12} {'estimated t/s':>14} {'measured t/s':>13} {'estimate/measured':>18} "
              f"{'in the fit':>11}")
        for row in sims.rows:
            name = next((n for n, (sp, _, _) in runs.items() if sp == engine(row.policy, a.slots)), None)
            if name is None:
                continue
            ts = runs[name][1]
            meas = sum(ts) / len(ts)
            est = 1000.0 / row.est_ms_per_token
            print(f"{row.policy:<12} {est:14.2f} {meas:13.2f} {est / meas:17.2f}x "
                  f"{'yes' if row.policy == 'fetch-all' else 'no':>11}")
            res[row.policy] = {"estimated_ts": est, "measured_ts": meas}
    except HarnessError as e:
        print(f"bench_tiers: cost model: {e}", file=sys.stderr)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--ram", default="1600M", help="the RAM limit of every run (page cache counted)")
    ap.add_argument("--slots", default="25%")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policies", default="fetch-all;quality;speed",
                    help="';'-separated presets, each optionally with more spec keys (quality,tau_file=0.3)")
    ap.add_argument("--prompt", type=int, default=512, help="prefill runs: a cold prompt of this many tokens (0: none)")
    ap.add_argument("--prompt-rounds", type=int, default=2)
    ap.add_argument("--profile", default="cpu-disk", help="the base profile the calibration fits")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench-tiers.json")
    ap.add_argument("--refit", action="store_true", help="only the cost model, from the runs saved in --out")
    a = ap.parse_args()
    if a.refit:
        saved = json.loads(a.out.read_text())
        model = Path(saved["model"])
        runs = {n: (r["spec"], r["samples_ts"], r.get("stats")) for n, r in saved["runs"].items() if r.get("spec")
                and r.get("samples_ts")}
        saved["simulate"] = cost_model(a, read_model_info(model), model, saved["compute_ms_in_ram"],
                                       a.out.parent / "bench-tiers.trace", runs)
        a.out.write_text(json.dumps(saved, indent=1) + "\n")
        return 0

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
    runs += [(f"engine {p} {a.slots} host=file", "patched", engine(p, a.slots)) for p in a.policies.split(";")]
    trace = a.out.parent / "bench-tiers.trace"
    traced = next((n for n, _, sp in runs if sp and "policy=fetch-all" in sp), None)
    samples: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    reads: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    stats_doc: dict[str, dict] = {}  # type: ignore[type-arg]
    errors: dict[str, str] = {}
    try:
        cg = MemoryCgroup(limit, "moe-subst-bench")
    except HarnessError as e:
        sys.exit(f"bench_tiers: {e}")
    for line in cg.cleaned:
        print(f"bench_tiers: {line}", flush=True)

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
                # the router trace of the first fetch-all run, which the simulator replays below
                sp = f"{spec},trace={trace},trace_top={info.n_expert}" if spec and r == 0 and name == traced else spec
                ts, read, err = bench(cg, bins[build], model, sp, a.tokens, a.threads, st)
                if err:
                    errors[name] = err
                    continue
                samples[name] += ts
                reads[name].append(max(0, read - load_reads[name]) / (a.tokens - 1))
                if st and st.exists():
                    stats_doc[name] = json.loads(st.read_text())
                print(f"bench_tiers: round {r + 1}/{a.rounds} {name}: {sum(ts) / len(ts):.2f} t/s", file=sys.stderr)
        # prefill (issue 11 item 5): a cold prompt, stock through mmap; the engine with the default ubatch (above
        # `group`: the full expert tensors through mmap, as stock) and with ubatches of `group` tokens (through
        # the banks, from the file)
        n_slots = (slots_for_residency(float(a.slots[:-1]) / 100, info.n_expert) if a.slots.endswith("%")
                   else int(a.slots))
        group = max(1, n_slots // info.n_expert_used)  # the engine's group=auto
        fa = engine("fetch-all", a.slots)
        prompt_runs: list[tuple[str, str, str | None, int | None]] = []
        if a.prompt:
            prompt_runs = [("stock (mmap), ubatch 512", "stock", None, None),
                           ("engine fetch-all, ubatch 512 (mmap)", "patched", fa, None),
                           (f"engine fetch-all, ubatch {group} (banks)", "patched", fa, group),
                           (f"engine quality, ubatch {group} (banks)", "patched", engine("quality", a.slots), group)]
        for r in range(a.prompt_rounds if a.prompt else 0):
            for name, build, spec, ub in prompt_runs:
                if name in errors:
                    continue
                drop_cache(model)
                ts, read, err = bench(cg, bins[build], model, spec, 0, a.threads, None, n_prompt=a.prompt, ubatch=ub)
                if err:
                    errors[name] = err
                    continue
                samples.setdefault(name, []).extend(ts)
                reads.setdefault(name, []).append(read)
                print(f"bench_tiers: prefill round {r + 1}/{a.prompt_rounds} {name}: {sum(ts) / len(ts):.2f} t/s",
                      file=sys.stderr)
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
    if a.prompt:
        print(f"\nprefill, a cold prompt of {a.prompt} tokens (pp{a.prompt}, no warmup), under the same limit")
        print(f"{'run':<40} {'tokens/s':>9} {'95% CI':>8} {'vs stock':>9} {'GB read':>8}")
        pstock = samples.get(prompt_runs[0][0], [])
        out["prefill"] = {}
        for name, _, spec, ub in prompt_runs:
            if name in errors or not samples.get(name):
                print(f"{name:<40} {errors.get(name, 'no samples')}")
                continue
            ci = mean_ci(samples[name])
            rc = ratio_ci(samples[name], pstock) if pstock else None
            gb = sum(reads[name]) / len(reads[name]) / 1e9
            print(f"{name:<40} {ci.mean:9.2f} {ci.half_width:8.2f} {f'{rc.ratio:8.2f}x' if rc else '       -'} "
                  f"{gb:8.2f}")
            out["prefill"][name] = {  # type: ignore[index]
                "spec": spec, "ubatch": ub, "samples_ts": samples[name], "mean": ci.mean, "ci95": ci.half_width,
                "vs_stock": rc.ratio if rc else None, "read_bytes": gb * 1e9}

    out["simulate"] = cost_model(a, info, model, compute_ms, trace, {
        n: (sp, samples[n], stats_doc.get(n)) for n, _, sp in runs if sp and samples.get(n)})

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"bench_tiers: wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
