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

`--full-scale` (issue 23) is another benchmark: the study's whole geometry (48 layers) in an 8 GB budget, both stock
readaheads, floors from the engine's own read pattern, decode over distinct sequences, raw records under eval/,
each policy's delta-PPL beside its speed, optionally a trained model's routing replayed (`--full-scale --help`;
docs/expert-cache-engine.md "The full-scale benchmark"). `--full-scale --pack` adds, per policy, a row that reads
each missed expert in one read from the expert pack (written next to the model first when missing or stale) beside
the three-read row, a disk probe in its pattern, and the verdict of the rule harness.domain.tiers.pack_verdict
(target: one read >= 1.2x three reads where the disk is latency-bound, or the measured reason it is not).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.core.errors import HarnessError  # noqa: E402
from harness.core.project import get_build  # noqa: E402
from harness.core.sizes import format_bytes, parse_size  # noqa: E402
from harness.domain.costmodel import TokenWork, cache_work  # noqa: E402
from harness.domain.plan import plan_ram, slots_for_residency  # noqa: E402
from harness.orchestration.simulate import SimulateOptions, run_calibrate, simulate  # noqa: E402
from harness.parsers.gguf_model import ModelInfo, read_model_info  # noqa: E402
from harness.stats.intervals import mean_ci, ratio_ci  # noqa: E402
from harness.tools.cgroup import RAM_MARGIN, MemoryCgroup, check_ram_limit, mem_available  # noqa: E402
from harness.tools.cgroup import drop_page_cache as drop_cache  # noqa: E402
from harness.tools.synth import SynthSpec, direct_supported, iter_plan, write_synth_model  # noqa: E402
from harness.tools.synth_layouts import dtype_of, n_bytes  # noqa: E402

F32 = 0  # GGML_TYPE_F32


def engine(policy: str, slots: str, pack: str = "off") -> str:
    """The engine's spec for a policy item: a preset name, optionally with more keys ("quality,tau_file=0.3").
    pack: off (three reads per expert, whatever lies next to the model) or the expert pack's path (one read)."""
    name, _, more = policy.partition(",")
    return f"mode=engine,policy={name},slots={slots},host=file,pack={pack}" + (f",{more}" if more else "")


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
    if "--full-scale" in sys.argv[1:]:
        try:
            return full_scale(sys.argv[1:])
        except HarnessError as e:
            sys.exit(f"bench_tiers: {e}")
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


# ------------------------------------------------------------------------------------------------------------------
# --full-scale (issue 23 items 1, 2, 5, 6)

FULL_DOC = """--full-scale: the study's whole geometry (48 layers of 512 experts of 2048x512, top-10, Q4_0, ~45 GB),
generated by streaming (harness.tools.synth: chunks of rows, one pass, no second copy), decoded in a RAM budget (a
memory cgroup of the benchmark's own, default 8G, page cache counted) by stock llama.cpp (mmap, --no-repack) at the
device's own read_ahead_kb and at --readahead-low (set for those runs, always restored), and by the engine
(host=file, the slots the engine's ram= formula gives). Decode = llama-perplexity teacher-forcing real text one token
per ubatch (-ub 1): every chunk a distinct sequence of --ctx tokens, each round a distinct slice of the text, the
configurations interleaved within a round on the same slice; each chunk's t/s and storage reads are taken as it
finishes (harness.tools.chunked). Per round the disk is probed in the engine's own pattern (O_DIRECT reads of one
expert tensor slice at random experts, --readers threads). Floors per run: the engine's bytes read per token / the
median probe bandwidth, beside the compute time per token with every expert in RAM (stock, file cached, no limit) on
shallower models of the same layer shape (--compute-layers), extrapolated to the depth by a line. Quality: each
policy's delta-PPL on a trained model (--quality-model) in emulate mode at the same residency fraction (harness
sweep's runs and statistics). --replay-trace T adds every policy under a trained model's routing (the engine's
LLAMA_MOE_CACHE_TEST_REPLAY, each round's trace rotated to start elsewhere).
Writes into --out: runs.jsonl (one raw record per run: harness.domain.tiers RUN_SCHEMA), summary.json (the
setup, disk samples, compute scaling, quality rows, readahead) and table.md; scratch files into --work."""


def _full_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_tiers.py --full-scale", description=FULL_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full-scale", action="store_true")
    ap.add_argument("--model", type=Path, help="the model to time (default: generated into --work)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dtype", default="q4_0")
    ap.add_argument("--compute-layers", default="4,8",
                    help="depths of the shallower models whose compute in RAM is extrapolated to --layers")
    ap.add_argument("--ram", help="the RAM budget (default 8G, less where MemAvailable less 2 GiB is smaller)")
    ap.add_argument("--reserve", default="256M", help="the engine's vram_reserve in the ram= formula")
    ap.add_argument("--slots", help="override the slots the ram= formula gives (count or P%%; reported as such)")
    ap.add_argument("--ctx", type=int, default=32, help="tokens per sequence (a llama-perplexity chunk)")
    ap.add_argument("--sequences", type=int, default=3, help="measured sequences per engine run")
    ap.add_argument("--stock-sequences", type=int, default=1, help="measured sequences per stock run (slow)")
    ap.add_argument("--warmup", type=int, default=1, help="sequences decoded before the measured ones, per run")
    ap.add_argument("--tail-chunks", type=int, default=1,
                    help="sequences decoded after the measured ones and never measured: llama.cpp's log worker can "
                    "lose its last lines at exit (upstream issue 22142), the last chunk's result among them")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policies", default="fetch-all;quality;speed",
                    help="';'-separated presets, each optionally with more spec keys (quality,tau_file=0.3)")
    ap.add_argument("--readers", type=int, default=4, help="the engine's reader threads (and the probe's)")
    ap.add_argument("--probe-reads", type=int, default=400, help="reads per disk probe")
    ap.add_argument("--readahead-low", type=int, default=128, help="the tuned stock row's read_ahead_kb")
    ap.add_argument("--no-readahead", action="store_true", help="never change read_ahead_kb (one stock row)")
    ap.add_argument("--no-stock", action="store_true",
                    help="no stock rows (for the pack's and prefetch's comparisons, which need none)")
    ap.add_argument("--sysfs", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)  # tests: a fake tree
    ap.add_argument("--text", type=Path, default=ROOT / "eval" / "data" / "heldout.txt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay-trace", type=Path,
                    help="a router trace recorded with trace= on a trained model of the same n_expert and k")
    ap.add_argument("--quality-model", default=str(ROOT / "models" / "tinymoe-f16.gguf"),
                    help="the trained model whose delta-PPL prices each policy ('none': no quality runs)")
    ap.add_argument("--quality-text", type=Path, default=ROOT / "eval" / "data" / "heldout.txt")
    ap.add_argument("--quality-ctx", type=int, default=512)
    ap.add_argument("--quality-chunks", type=int, default=32)
    ap.add_argument("--pack", action="store_true",
                    help="also time every policy with the expert pack (one read per expert; MODEL.moe-pack, written "
                    "first when missing or stale: the experts' size again on disk) beside three reads per expert, "
                    "with a disk probe of whole-expert reads and the verdict (harness.domain.tiers.pack_verdict)")
    ap.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per run")
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "bench-tiers-full")
    ap.add_argument("--work", type=Path, default=ROOT / "results" / "bench-tiers-full")
    ap.add_argument("--rerender", action="store_true", help="only table.md, from --out's runs.jsonl and summary.json")
    return ap.parse_args(argv)


def _study_spec(a: argparse.Namespace, layers: int) -> SynthSpec:
    return SynthSpec(arch="qwen3moe", n_layer=layers, n_expert=a.experts, n_expert_used=a.top_k, n_embd=a.embd,
                     n_ff_exp=a.ff, n_head=a.heads, n_head_kv=a.kv_heads, dtype=a.dtype, seed=0)


def _ensure_model(path: Path, spec: SynthSpec) -> None:
    """Generate the model by streaming, after checking the disk has room for it (and 2 GiB more). Q4_0 and Q8_0
    expert blocks are drawn directly (harness.tools.synth, direct=True: minutes for 45 GB, not an hour)."""
    if path.exists():
        return
    need = sum(n_bytes(shape, dtype_of(spec.dtype).ggml if q else F32) for _, shape, q in iter_plan(spec))
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < need + (2 << 30):
        sys.exit(f"bench_tiers: generating {path.name} needs {format_bytes(need)} and {path.parent} has "
                 f"{format_bytes(free)} free (2 GiB kept): free space or pass --work elsewhere")
    t0 = time.time()
    print(f"bench_tiers: generating {path} ({format_bytes(need)}, {spec.n_layer} layers; streamed)", file=sys.stderr)
    write_synth_model(spec, path, direct=direct_supported(dtype_of(spec.dtype).ggml))
    print(f"bench_tiers: generated in {time.time() - t0:.0f} s", file=sys.stderr)


def _budget(a: argparse.Namespace) -> tuple[int, str]:
    available = mem_available()
    if a.ram is None:
        want = 8 << 30
        cap = available - RAM_MARGIN
        if want > cap:
            return cap, (f"RAM budget {format_bytes(cap)}: MemAvailable ({format_bytes(available)}) less "
                         f"{format_bytes(RAM_MARGIN)}, below the default 8G")
        return want, "RAM budget 8G (the default)"
    limit = parse_size(a.ram, allow_percent=False).bytes or 0
    try:
        check_ram_limit(limit, available)
    except HarnessError as e:
        sys.exit(f"bench_tiers: {e}")
    return limit, f"RAM budget {format_bytes(limit)} (--ram)"


def _quality(a: argparse.Namespace, policies: list[str], fraction: float, work: Path) -> dict[str, Any]:
    """Each policy's delta-PPL on the trained model in emulate mode at `fraction` (harness sweep's machinery: the
    full model and one llama-perplexity run per policy, NLL dumps paired by chunks)."""
    from harness.core.records import ResultsFile
    from harness.domain.options import SweepOptions
    from harness.domain.plan import SweepPoint
    from harness.orchestration.executor import Environment, execute_runs
    from harness.orchestration.serialise import sweep_fingerprint
    from harness.orchestration.summary import load_nlls, summarize_quality
    from harness.orchestration.sweep import sweep_runs
    from harness.tools.runners import ToolRunner

    qm = Path(a.quality_model)
    qinfo = read_model_info(qm)
    slots = slots_for_residency(fraction, qinfo.n_expert, qinfo.n_expert_used)
    points = []
    for p in policies:
        name, _, more = p.partition(",")
        params = (("host", "file"), *(tuple(kv.split("=", 1)) for kv in more.split(",") if kv))
        points.append(SweepPoint(p, "", None, "", "", fraction, slots, preset=name,
                                 params=params))  # type: ignore[arg-type]
    opts = SweepOptions(out=work / "quality", model=qm, text=a.quality_text, n_ctx=a.quality_ctx,
                        chunks=a.quality_chunks, threads=a.threads)
    env = Environment()
    builds = env.builds()
    prov = env.provenance(builds, tuple(sys.argv), "none")
    results = ResultsFile(opts.out / "results.jsonl")
    runner = ToolRunner()
    execute_runs(sweep_runs(opts, points), runner, builds, prov,
                 sweep_fingerprint(qm, a.quality_text, opts, dict(prov.binaries)), results,
                 lambda done, total, label: print(f"bench_tiers: quality ({done}/{total} done) {label}",
                                                  file=sys.stderr))
    records = results.read()
    nll, warnings = load_nlls(records, runner.load_nll)
    rows, qwarn = summarize_quality(records, nll, policies)
    out: dict[str, Any] = {"model": qm.name, "text": a.quality_text.name, "n_ctx": a.quality_ctx,
                           "chunks": a.quality_chunks, "slots": slots, "n_expert": qinfo.n_expert,
                           "fraction": fraction, "warnings": [*warnings, *qwarn], "rows": {}}
    for r in rows:
        if r.config in policies:
            d = r.delta
            out["rows"][r.config] = {
                "ppl": r.ppl, "delta_pct": d.delta_pct if d else None, "low": d.low if d else None,
                "high": d.high if d else None, "n_tokens": d.n_tokens if d else None,
                "substitution_rate": r.cache.substitution_rate if r.cache else None,
                "fetches_per_token": r.cache.fetches_per_token if r.cache else None, "note": r.note}
    return out


def _machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    total = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                  if ln.startswith("MemTotal:")), 0)
    return {"cpu": cpu, "cpus": os.cpu_count(), "kernel": os.uname().release, "mem_total": total,
            "mem_available": mem_available(), "load_avg": os.getloadavg()}


def full_scale(argv: list[str]) -> int:
    from contextlib import nullcontext

    from harness.domain.tiers import (
        MMAP_REPLAY_ROW,
        PACK_ROW,
        ExpertSlices,
        depth_scaled_compute_ms,
        engine_counters,
        expert_read_spans,
        record_read_spans,
        rotated_trace,
        run_record,
        text_sequences,
    )
    from harness.parsers.trace import read_expert_trace, read_trace_header, write_expert_trace
    from harness.tools.chunked import run_chunked_perplexity
    from harness.tools.diskbw import read_bandwidth
    from harness.tools.readahead import ReadAhead

    a = _full_args(argv)
    if a.rerender:
        return full_scale_rerender(a.out)
    notes: list[str] = []
    bins = {"stock": get_build("stock").bin_dir, "patched": get_build("patched").bin_dir}
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    spec = _study_spec(a, a.layers)
    model = a.model or a.work / f"tiers-qwen3moe-e{a.experts}k{a.top_k}-L{a.layers}-{a.dtype}.gguf"
    if a.model is None:
        _ensure_model(model, spec)
    depths = [int(x) for x in a.compute_layers.split(",") if x]
    compute_models = {d: a.work / f"tiers-qwen3moe-e{a.experts}k{a.top_k}-L{d}-{a.dtype}.gguf" for d in depths}
    for d, p in compute_models.items():
        _ensure_model(p, _study_spec(a, d))
    info = read_model_info(model)
    for d, p in compute_models.items():
        ci = read_model_info(p)
        shape = (ci.arch, ci.n_expert, ci.n_expert_used, ci.bytes_per_expert, ci.file_type)
        if shape != (info.arch, info.n_expert, info.n_expert_used, info.bytes_per_expert, info.file_type):
            sys.exit(f"bench_tiers: {p.name} (the compute model of {d} layers) has not the layer shape of "
                     f"{model.name}: give the geometry options of --model, or another --work")
    limit, how = _budget(a)
    notes.append(how)
    if a.model is None and direct_supported(dtype_of(a.dtype).ggml):
        notes.append("weights: random, generated here (harness.tools.synth, seed 0); the quantized tensors' blocks "
                     "drawn directly (uniform quants, one scale per tensor giving the normals' std), the router and "
                     "norms as normals; a model file generated before direct blocks is used as it is")
    reserve = parse_size(a.reserve, allow_percent=False).bytes or 0
    try:
        planned = plan_ram(info, limit, reserve, a.ctx).slots_per_layer
    except HarnessError as e:
        sys.exit(f"bench_tiers: {e}")
    slots = planned
    if a.slots:
        slots = (slots_for_residency(float(a.slots[:-1]) / 100, info.n_expert, info.n_expert_used)
                 if a.slots.endswith("%") else int(a.slots))
        notes.append(f"slots {slots} per layer from --slots (the ram= formula gives {planned})")
    fraction = slots / info.n_expert
    print(f"bench_tiers: {model.name}: {format_bytes(info.file_bytes)}, {info.n_moe_layers} MoE layers x "
          f"{info.n_expert} experts, top-{info.n_expert_used}; {how}; {slots} slots per layer "
          f"({100 * fraction:.1f}% resident)", file=sys.stderr)

    # readahead: the device's own value, and the tuned stock row where it may be set
    ra: ReadAhead | None = None
    try:
        ra = ReadAhead.for_file(model, a.sysfs)
    except HarnessError as e:
        notes.append(f"readahead: {e}")
    stock_configs = [f"stock (read_ahead_kb {ra.original})" if ra else "stock"]
    configs: list[tuple[str, str, str | None, int | None, bool]] = [(stock_configs[0], "stock", None, None, False)]
    if ra is not None and not a.no_readahead and ra.original != a.readahead_low:
        if ra.writable():
            stock_configs.append(f"stock (read_ahead_kb {a.readahead_low})")
            configs.append((stock_configs[1], "stock", None, a.readahead_low, False))
        else:
            notes.append(f"readahead: {ra.file} is not writable here: no stock row at {a.readahead_low} KiB")
    policies = [p for p in a.policies.split(";") if p]
    if ra is not None and ra.original == a.readahead_low:
        notes.append(f"readahead: the device's read_ahead_kb is already {a.readahead_low}: one stock row")
    if a.no_readahead:
        notes.append("readahead: --no-readahead: read_ahead_kb left as it is (one stock row)")
    if a.no_stock:
        configs, stock_configs = [], []
        notes.append("--no-stock: no stock rows (the pack's and prefetch's verdicts compare engine rows only)")

    # --pack: the expert pack next to the model (written when missing or stale), its rows beside the three-read rows
    pack_path: Path | None = None
    pack_layout = None
    if a.pack:
        from harness.domain.pack import default_pack_path
        from harness.orchestration.pack import read_pack_header, write_pack

        pack_path = default_pack_path(model)
        st = model.stat()
        try:
            pack_layout = read_pack_header(pack_path) if pack_path.exists() else None
        except HarnessError as e:
            notes.append(f"pack: {e}: written again")
        if pack_layout is None or (pack_layout.gguf_size, pack_layout.gguf_mtime_ns) != (st.st_size, st.st_mtime_ns):
            print(f"bench_tiers: writing the expert pack {pack_path}", file=sys.stderr)
            try:
                pack_layout = write_pack(model, pack_path).layout
            except HarnessError as e:
                sys.exit(f"bench_tiers: {e}")
        notes.append(f"pack: {pack_path.name}, records of {pack_layout.layers[0].record_bytes} bytes; its rows "
                     "'<policy> (pack)' read each missed expert in one read (pack=PATH: a mismatch fails the run), "
                     "the others three (pack=off)")

    def engine_spec(p: str, pack: Path | None = None) -> str:
        return engine(p, str(slots), str(pack) if pack else "off") + f",readers={a.readers}"

    for p in policies:
        configs.append((p, "patched", engine_spec(p), None, False))
        if pack_path is not None:
            configs.append((p + PACK_ROW, "patched", engine_spec(p, pack_path), None, False))
    replay_traces: list[Path] = []
    if a.replay_trace is not None:
        h = read_trace_header(a.replay_trace)
        if (h.n_expert, h.k) != (info.n_expert, info.n_expert_used):
            sys.exit(f"bench_tiers: the trace {a.replay_trace} routes {h.n_expert} experts, top-{h.k}; the model "
                     f"has {info.n_expert}, top-{info.n_expert_used}: record one on a model of the same shape")
        trace = read_expert_trace(a.replay_trace)
        for r in range(a.rounds):
            replay_traces.append(write_expert_trace(a.work / f"replay-{r}.trace", rotated_trace(trace, r, a.rounds)))
        # prefetch=on predicts from the model's own routers: the engine refuses it with a replayed routing
        replayable = [p for p in policies if "prefetch=on" not in p.split(",")]
        if len(replayable) < len(policies):
            notes.append("replay: no replayed row for " + ", ".join(p for p in policies if p not in replayable) +
                         " (prefetch=on predicts from the model's own routers; the engine refuses it with a replay)")
        for p in replayable:
            configs.append((f"{p} (replay)", "patched", engine_spec(p), None, True))
            if pack_path is not None:  # one read per expert under the trained routing, where misses are many
                configs.append((f"{p} (replay){PACK_ROW}", "patched", engine_spec(p, pack_path), None, True))
    if replay_traces and not a.no_stock:
        # stock's I/O under the trained routing: stock cannot replay, so the patched build in emulate mode with
        # fetch-all (stock's compute path on the mapped experts, every routed expert computed) with the replay, at
        # the better stock readahead (the tuned one where it may be set)
        low = a.readahead_low if len(stock_configs) > 1 else None
        configs.append((MMAP_REPLAY_ROW, "patched", "mode=emulate,policy=fetch-all", low, True))
        notes.append(f"replay: '{MMAP_REPLAY_ROW}' is the patched build in emulate mode with fetch-all (stock's "
                     "compute path, the experts read through the mapping as stock reads them, the routing replayed) at "
                     f"read_ahead_kb {low if low is not None else (ra.original if ra else '?')}: stock's I/O under "
                     "the trained routing, which stock itself cannot replay; its sequences are --stock-sequences")

    # sequences: one distinct slice of the text per round, holding that round's chunks
    # + the tail chunks, never measured: llama.cpp's log worker can lose the last lines at exit (upstream issue
    # 22142; tests/conftest.py), the last chunk's result among them
    per_run = a.warmup + max(a.sequences, a.stock_sequences) + a.tail_chunks
    slices = text_sequences(a.text.read_text(errors="replace"), a.rounds, per_run * a.ctx * 8, a.seed)
    slice_files = []
    for r, s in enumerate(slices):
        f = a.work / f"sequences-{r}.txt"
        f.write_text(s)
        slice_files.append(f)

    def perplexity_args(bin_dir: Path, m: Path, text: Path, chunks: int) -> list[str]:
        return [str(bin_dir / "llama-perplexity"), "-m", str(m), "-f", str(text), "-c", str(a.ctx), "-b", str(a.ctx),
                "-ub", "1", "--chunks", str(chunks), "-t", str(a.threads), "--no-repack"]

    runs_path = a.out / "runs.jsonl"
    runs_path.write_text("")
    records: list[dict[str, Any]] = []

    def record(rec: dict[str, Any]) -> None:
        records.append(rec)
        with runs_path.open("a") as f:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def measured(run: Any, n: int) -> tuple[list[float], list[int], str | None]:
        secs, reads = run.chunk_seconds(), run.chunk_reads()
        err = None
        if run.returncode != 0:
            tail = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""
            err = ("killed (out of memory in the limit?)" if run.returncode in (-9, 137)
                   else f"exit {run.returncode}") + f": {tail}"
        elif len(secs) < a.warmup + n:
            err = (f"{len(secs)} chunks of {a.warmup + n}: the sequence text is too short, or the last lines were "
                   "lost at exit (more --tail-chunks)")
        secs, reads = secs[a.warmup:a.warmup + n], reads[a.warmup:a.warmup + n]
        if err is None and any(s <= 0 for s in secs):
            # two chunks' results read at once (this reader was descheduled for longer than a chunk): not timed
            err = "chunk results arrived together (chunks of a few ms on a loaded machine): not timed"
        return [a.ctx / s for s in secs if s > 0], reads, err

    # compute with every expert in RAM: the shallower models, file cached, no limit
    compute_points: list[tuple[int, float]] = []
    for d, p in compute_models.items():
        subprocess.run(["cat", str(p)], stdout=subprocess.DEVNULL, check=True)
        run = run_chunked_perplexity(perplexity_args(bins["stock"], p, slice_files[0],
                                                     a.warmup + a.sequences + a.tail_chunks),
                                     {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"},
                                     timeout=a.timeout)
        ts, _, err = measured(run, a.sequences)
        record(run_record(config=f"compute in RAM, {d} layers", kind="compute", round_=0, spec=None,
                          readahead_kb=None, replay=None, n_ctx=a.ctx, warmup_chunks=a.warmup, chunk_ts=ts,
                          chunk_read_bytes=[], read_bytes_all=None, tokens_all=a.ctx * len(run.chunk_end),
                          engine=None, disk={}, error=err))
        drop_cache(p)
        if err:
            sys.exit(f"bench_tiers: the in-RAM run of {p.name} failed: {err}")
        compute_points += [(d, 1000.0 / t) for t in ts]
    compute_ms, scaling = depth_scaled_compute_ms(compute_points, info.n_moe_layers)
    print(f"bench_tiers: compute in RAM at {info.n_moe_layers} layers: {compute_ms:.1f} ms/token ({scaling})",
          file=sys.stderr)

    slices_info = [ExpertSlices(t.name, t.offset, t.n_bytes // info.n_expert, info.n_expert)
                   for t in info.expert_tensors]
    disk_samples: list[dict[str, Any]] = []
    interrupted = False
    try:
        with MemoryCgroup(limit, "moe-subst-bench") as cg:
            notes.extend(cg.cleaned)
            for r in range(a.rounds):
                drop_cache(model)
                probe = read_bandwidth(model, expert_read_spans(slices_info, a.probe_reads, a.seed + r), a.readers)
                disk = {"round": r, **probe.as_dict()}
                if pack_path is not None and pack_layout is not None:
                    # the pack's pattern: whole-expert records (as many bytes as the slice probe, about)
                    drop_cache(pack_path)
                    n_rec = max(1, a.probe_reads // len(pack_layout.layers[0].tensors))
                    pp = read_bandwidth(pack_path, record_read_spans(pack_layout, n_rec, a.seed + r), a.readers)
                    disk["pack"] = pp.as_dict()
                    print(f"bench_tiers: round {r + 1}/{a.rounds}: disk {pp.bytes_per_s / 1e6:.0f} MB/s in "
                          "whole-expert reads of the pack", file=sys.stderr)
                disk_samples.append(disk)
                print(f"bench_tiers: round {r + 1}/{a.rounds}: disk {probe.bytes_per_s / 1e6:.0f} MB/s "
                      f"({'O_DIRECT' if probe.direct else 'buffered'}, {a.readers} readers, expert-slice reads)",
                      file=sys.stderr)
                for name, build, sp, kb, replay in (configs if r % 2 == 0 else list(reversed(configs))):
                    n = a.stock_sequences if build == "stock" or name == MMAP_REPLAY_ROW else a.sequences
                    env = {k: v for k, v in os.environ.items()
                           if k not in ("LLAMA_MOE_CACHE", "LLAMA_MOE_CACHE_TEST_REPLAY")}
                    stats = a.work / "stats.json"
                    stats.unlink(missing_ok=True)
                    if sp:
                        env["LLAMA_MOE_CACHE"] = f"{sp},stats={stats}"
                    if replay:
                        env["LLAMA_MOE_CACHE_TEST_REPLAY"] = str(replay_traces[r])
                    drop_cache(model)
                    if pack_path is not None:
                        drop_cache(pack_path)
                    guard = ra.set_for_run(kb) if (ra is not None and kb is not None) else nullcontext()
                    with guard:
                        run = run_chunked_perplexity(perplexity_args(bins[build], model, slice_files[r],
                                                                     a.warmup + n + a.tail_chunks),
                                                     env, timeout=a.timeout, preexec=cg.preexec)
                    ts, reads, err = measured(run, n)
                    if replay and err is None and "routing replayed from the router trace" not in run.stderr:
                        err = "the engine did not say it replays the trace (LLAMA_MOE_CACHE_TEST_REPLAY ignored?)"
                        ts, reads = [], []
                    doc = json.loads(stats.read_text()) if sp and stats.exists() else None
                    pack_used = (doc or {}).get("engine", {}).get("pack")
                    if doc is not None and err is None and name.endswith(PACK_ROW) != bool(pack_used):
                        err = f"the engine's pack is {pack_used!r} in the row {name}"
                        ts, reads = [], []
                    all_reads = (run.end_read_bytes - run.start_read_bytes
                                 if run.end_read_bytes is not None and run.start_read_bytes is not None else None)
                    record(run_record(
                        config=name, kind="decode", round_=r, spec=sp,
                        readahead_kb=kb if kb is not None else (ra.original if ra else None),
                        replay=a.replay_trace.name if replay and a.replay_trace else None, n_ctx=a.ctx,
                        warmup_chunks=a.warmup, chunk_ts=ts, chunk_read_bytes=reads[:len(ts)],
                        read_bytes_all=all_reads, tokens_all=a.ctx * len(run.chunk_end),
                        engine=engine_counters(doc), disk=disk, error=err))
                    mean = f"{sum(ts) / len(ts):.2f} t/s" if ts else err
                    print(f"bench_tiers: round {r + 1}/{a.rounds} {name}: {mean}", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
        print(f"bench_tiers: interrupted; the cgroup is removed, read_ahead_kb restored; records so far in "
              f"{runs_path}", file=sys.stderr)
    finally:
        if ra is not None:
            ra.restore()

    quality: dict[str, Any] = {}
    if a.quality_model != "none" and not interrupted:
        quality = _quality(a, policies, fraction, a.work)
    bws = [float(d["MBps"]) * 1e6 for d in disk_samples]
    summary: dict[str, Any] = {
        "schema": "moe-subst/bench-tiers-summary", "schema_version": 1, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                              time.gmtime()),
        "argv": sys.argv, "machine": _machine(),
        "model": {"name": model.name, "file_bytes": info.file_bytes, "layers": info.n_moe_layers,
                  "n_expert": info.n_expert, "k": info.n_expert_used, "file_type": info.file_type},
        "ram_limit": limit, "reserve": reserve, "slots": slots, "slots_planned": planned, "fraction": fraction,
        "readahead": ({"device": ra.device, "original_kb": ra.original, "low_kb": a.readahead_low,
                       "restored_kb": ra.value()} if ra else None),
        "disk_samples": disk_samples, "disk_bytes_per_s_median": statistics.median(bws) if bws else None,
        "readers": a.readers, "compute_ms_per_token": compute_ms, "compute_scaling": scaling,
        "compute_points": compute_points, "ctx": a.ctx, "sequences": a.sequences,
        "stock_sequences": a.stock_sequences, "warmup": a.warmup, "tail_chunks": a.tail_chunks, "rounds": a.rounds,
        "threads": a.threads, "stock_configs": stock_configs, "quality": quality, "notes": notes,
        "interrupted": interrupted}
    if pack_path is not None and pack_layout is not None:
        pbws = [float(d["pack"]["MBps"]) * 1e6 for d in disk_samples if "pack" in d]
        summary["pack"] = {"path": pack_path.name, "pack_bytes": pack_layout.pack_size,
                           "record_bytes": [la.record_bytes for la in pack_layout.layers][:1],
                           "disk_bytes_per_s_median": statistics.median(pbws) if pbws else None,
                           "configs": [c[0] for c in configs if c[0].endswith(PACK_ROW)]}
    table, summary["headline_stock"] = full_scale_table(records, summary)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (a.out / "table.md").write_text(table)
    print("\n" + "\n".join(notes) + "\n\n" + table)
    print(f"bench_tiers: wrote {runs_path}, {a.out / 'summary.json'}, {a.out / 'table.md'}", file=sys.stderr)
    return 130 if interrupted else 0


def full_scale_table(records: list[dict[str, Any]], summary: dict[str, Any]) -> tuple[str, str | None]:
    """The table of a full-scale run from its raw records and summary.json alone (and the headline's stock)."""
    from harness.domain.tiers import (
        MMAP_REPLAY_ROW,
        PACK_ROW,
        better_stock,
        check_run_record,
        pack_verdict,
        prefetch_counts,
        prefetch_pairs,
        prefetch_verdict,
        summarize_runs,
    )
    from harness.report.tiers import render_pack_verdicts, render_prefetch_verdicts, render_tiers_table
    from harness.stats.intervals import DeltaPPL

    for r in records:
        check_run_record(r)
    stock_configs = list(summary["stock_configs"])
    # the replayed rows are compared with stock's I/O path under the same replayed routing
    refs = stock_configs + ([MMAP_REPLAY_ROW] if any(r.get("config") == MMAP_REPLAY_ROW for r in records) else [])
    bw = summary.get("disk_bytes_per_s_median")
    pack = summary.get("pack") or {}
    pack_bw = pack.get("disk_bytes_per_s_median")
    by_config = {c: float(pack_bw) for c in pack.get("configs", [])} if pack_bw else {}
    rows = summarize_runs(records, float(bw), float(summary["compute_ms_per_token"]), refs,
                          by_config) if bw else []
    best = better_stock(rows, stock_configs)
    quality = summary.get("quality") or {}
    deltas = {p: (DeltaPPL(q["delta_pct"], q["low"], q["high"], 0.0, 0.0, q["n_tokens"] or 0, 0, 0, 0)
                  if q["delta_pct"] is not None else None) for p, q in quality.get("rows", {}).items()}
    label = (f"{quality['model']}, emulate, {quality['slots']}/{quality['n_expert']} slots" if quality else "not run")
    table = render_tiers_table(rows, refs, best, deltas, label)
    samples: dict[str, list[float]] = {}
    configs: list[str] = []
    for r in records:
        if r.get("kind") == "decode":
            if str(r["config"]) not in samples:
                configs.append(str(r["config"]))
            samples.setdefault(str(r["config"]), []).extend(float(x) for x in r["chunk_ts"])
    pairs = prefetch_pairs(configs)
    if pairs:
        pv = [prefetch_verdict(p, q, samples[p], samples[q]) for p, q in pairs]
        table += ("\nPrefetch on the file tier: each policy with and without prefetch=on, same residency and "
                  "sequences (harness.domain.tiers.prefetch_verdict: pays when the ratio's 95% CI is above 1):\n\n"
                  + render_prefetch_verdicts(pv, {q: prefetch_counts(records, q) for _, q in pairs}))
    if pack and bw and pack_bw:
        by_row = {r.config: r for r in rows}
        verdicts = []
        for pc in pack.get("configs", []):
            p = pc.removesuffix(PACK_ROW)
            three = by_row.get(p)
            share = (three.floors.io_ms / three.floors.serial_ms
                     if three is not None and three.floors is not None and three.floors.serial_ms > 0 else None)
            verdicts.append(pack_verdict(p, samples.get(p, []), samples.get(pc, []), float(bw), float(pack_bw), share))
        table += ("\nOne read per expert (the expert pack) against three reads, same policy and residency "
                  "(harness.domain.tiers.pack_verdict):\n\n" + render_pack_verdicts(verdicts))
    return table, best


def full_scale_rerender(out: Path) -> int:
    """--full-scale --rerender: table.md again from runs.jsonl and summary.json (nothing is run)."""
    records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines() if line.strip()]
    table, _ = full_scale_table(records, json.loads((out / "summary.json").read_text()))
    (out / "table.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
