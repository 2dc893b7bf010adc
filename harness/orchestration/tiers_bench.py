"""`scripts/bench_tiers.py` (issue 11): a MoE model bigger than the RAM its runs may use, decoded by stock llama.cpp
(experts paged in from the SSD through mmap) and by the engine reading missed experts from the model file
(`host=file`), all under the same RAM limit; results, not tests (the script's docstring says how and what).
`--full-scale` is another benchmark: harness.orchestration.tiers_full.

`TiersBench` runs it: the disk probes, the compute with everything in RAM, the load-only reads, the decode rounds
and the prefill rounds inside one memory cgroup of its own, then the table, the cost model's estimates beside the
measurements (`cost_model`) and the JSON record.
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

from harness.core.errors import HarnessError
from harness.core.project import get_build, project_root
from harness.core.sizes import format_bytes, parse_size
from harness.domain.costmodel import TokenWork, cache_work
from harness.domain.plan import slots_for_residency
from harness.domain.tiers import file_tier_spec as engine
from harness.orchestration.simulate import SimulateOptions, run_calibrate, simulate
from harness.parsers.gguf_model import ModelInfo, read_model_info
from harness.stats.intervals import mean_ci, ratio_ci
from harness.tools.cgroup import MemoryCgroup, check_ram_limit, mem_available
from harness.tools.cgroup import drop_page_cache as drop_cache

ROOT = project_root()
Row = tuple[str, str, str | None]  # (name, build, spec)
PromptRow = tuple[str, str, str | None, int | None]  # (name, build, spec, ubatch)


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
        offs = [rng.randrange(0, max(1, size - chunk)) for _ in range(n)]
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
            run_name = next((n for n, (sp, _, _) in runs.items() if sp == engine(row.policy, a.slots)), None)
            if run_name is None:
                continue
            ts = runs[run_name][1]
            meas = sum(ts) / len(ts)
            est = 1000.0 / row.est_ms_per_token
            print(f"{row.policy:<12} {est:14.2f} {meas:13.2f} {est / meas:17.2f}x "
                  f"{'yes' if row.policy == 'fetch-all' else 'no':>11}")
            res[row.policy] = {"estimated_ts": est, "measured_ts": meas}
    except HarnessError as e:
        print(f"bench_tiers: cost model: {e}", file=sys.stderr)
    return res


def tiers_args(argv: list[str], description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_tiers.py", description=description)
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
    return ap.parse_args(argv)


def refit(a: argparse.Namespace) -> int:
    """--refit: only the cost model, from the runs saved in --out."""
    saved = json.loads(a.out.read_text())
    model = Path(saved["model"])
    runs = {n: (r["spec"], r["samples_ts"], r.get("stats")) for n, r in saved["runs"].items() if r.get("spec")
            and r.get("samples_ts")}
    saved["simulate"] = cost_model(a, read_model_info(model), model, saved["compute_ms_in_ram"],
                                   a.out.parent / "bench-tiers.trace", runs)
    a.out.write_text(json.dumps(saved, indent=1) + "\n")
    return 0


def tiers_model(a: argparse.Namespace) -> Path:
    """--model, or the study's expert shape at --layers, generated once into results/."""
    model = a.model or ROOT / "results" / f"tiers-qwen3moe-e512k10-L{a.layers}-q4_0.gguf"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        print(f"bench_tiers: generating {model} (the study's expert shape, {a.layers} layers)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "harness", "synth", "-o", str(model), "--arch", "qwen3moe",
                        "--layers", str(a.layers), "--experts", "512", "--top-k", "10", "--embd", "2048",
                        "--ff", "512", "--heads", "16", "--kv-heads", "2", "--dtype", "q4_0"], check=True, cwd=ROOT)
    return model


class TiersBench:
    """One run of the issue-11 benchmark: stock and each policy decoded (and prefilled) in one RAM limit."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.bins = {"stock": get_build("stock").bin_dir, "patched": get_build("patched").bin_dir}
        self.model = tiers_model(a)
        self.info = read_model_info(self.model)
        self.limit = parse_size(a.ram, allow_percent=False).bytes or 0
        check_ram_limit(self.limit, mem_available())
        self.file_bytes = self.model.stat().st_size
        print(f"bench_tiers: model {self.model.name}: {format_bytes(self.file_bytes)} "
              f"({self.file_bytes / self.limit:.2f}x the RAM limit {format_bytes(self.limit)}), "
              f"{self.info.n_moe_layers} MoE layers x {self.info.n_expert} experts, top-{self.info.n_expert_used}",
              file=sys.stderr)
        if self.file_bytes < 2.5 * self.limit:
            print("bench_tiers: warning: the model is less than 2.5x the RAM limit", file=sys.stderr)
        self.chunk = max(t.n_bytes // self.info.n_expert for t in self.info.expert_tensors)
        self.disk: list[tuple[float, float]] = []
        self.runs: list[Row] = [("stock (mmap)", "stock", None)]
        self.runs += [(f"engine {p} {a.slots} host=file", "patched", engine(p, a.slots)) for p in a.policies.split(";")]
        self.trace = a.out.parent / "bench-tiers.trace"
        self.samples: dict[str, list[float]] = {name: [] for name, _, _ in self.runs}
        self.reads: dict[str, list[float]] = {name: [] for name, _, _ in self.runs}
        self.stats_doc: dict[str, dict] = {}  # type: ignore[type-arg]
        self.errors: dict[str, str] = {}
        self.prompt_runs: list[PromptRow] = self._prompt_rows()

    def _prompt_rows(self) -> list[PromptRow]:
        """Prefill (issue 11 item 5): a cold prompt, stock through mmap; the engine with the default ubatch (above
        `group`: the full expert tensors through mmap, as stock) and with ubatches of `group` tokens (through the
        banks, from the file)."""
        a, info = self.a, self.info
        if not a.prompt:
            return []
        n_slots = (slots_for_residency(float(a.slots[:-1]) / 100, info.n_expert) if a.slots.endswith("%")
                   else int(a.slots))
        group = max(1, n_slots // info.n_expert_used)  # the engine's group=auto
        fa = engine("fetch-all", a.slots)
        return [("stock (mmap), ubatch 512", "stock", None, None),
                ("engine fetch-all, ubatch 512 (mmap)", "patched", fa, None),
                (f"engine fetch-all, ubatch {group} (banks)", "patched", fa, group),
                (f"engine quality, ubatch {group} (banks)", "patched", engine("quality", a.slots), group)]

    def measure_disk(self) -> None:
        seq, rand = disk_bandwidth(self.model, self.chunk, seed=len(self.disk))
        self.disk.append((seq, rand))
        print(f"bench_tiers: disk: {seq:.0f} MB/s sequential (16 MiB reads), {rand:.0f} MB/s in reads of one expert "
              f"tensor slice ({format_bytes(self.chunk)}) at random offsets", file=sys.stderr)

    def compute_in_ram(self) -> float:
        """Stock with the file cached and no limit: ms a token of compute alone."""
        subprocess.run(["cat", str(self.model)], stdout=subprocess.DEVNULL, check=True)
        ram_ts, _, err = bench(None, self.bins["stock"], self.model, None, self.a.tokens, self.a.threads, None)
        if err:
            raise HarnessError(f"the in-RAM stock run failed: {err}")
        ms = 1000.0 / (sum(ram_ts) / len(ram_ts))
        print(f"bench_tiers: in RAM (no limit, file cached): stock {sum(ram_ts) / len(ram_ts):.2f} t/s "
              f"= {ms:.1f} ms/token of compute", file=sys.stderr)
        return ms

    def decode_rounds(self, cg: MemoryCgroup, tmp: Path) -> None:
        """The load-only reads (1 token) of each row, then the rounds, interleaved; the first fetch-all run records
        the router trace that the simulator replays."""
        a = self.a
        traced = next((n for n, _, sp in self.runs if sp and "policy=fetch-all" in sp), None)
        load_reads: dict[str, int] = {}
        for name, build, spec in self.runs:
            drop_cache(self.model)
            _, load_reads[name], err = bench(cg, self.bins[build], self.model, spec, 1, a.threads, None)
            if err:
                self.errors[name] = err
        for r in range(a.rounds):
            if r > 0:
                self.measure_disk()  # the disk of a shared machine varies: measured every round, the median is used
            for name, build, spec in self.runs:
                if name in self.errors:
                    continue
                drop_cache(self.model)
                st = tmp / f"{r}-{len(self.samples[name])}.json" if spec else None
                sp = (f"{spec},trace={self.trace},trace_top={self.info.n_expert}" if spec and r == 0 and name == traced
                      else spec)
                ts, read, err = bench(cg, self.bins[build], self.model, sp, a.tokens, a.threads, st)
                if err:
                    self.errors[name] = err
                    continue
                self.samples[name] += ts
                self.reads[name].append(max(0, read - load_reads[name]) / (a.tokens - 1))
                if st and st.exists():
                    self.stats_doc[name] = json.loads(st.read_text())
                print(f"bench_tiers: round {r + 1}/{a.rounds} {name}: {sum(ts) / len(ts):.2f} t/s", file=sys.stderr)

    def prefill_rounds(self, cg: MemoryCgroup) -> None:
        a = self.a
        for r in range(a.prompt_rounds if a.prompt else 0):
            for name, build, spec, ub in self.prompt_runs:
                if name in self.errors:
                    continue
                drop_cache(self.model)
                ts, read, err = bench(cg, self.bins[build], self.model, spec, 0, a.threads, None, n_prompt=a.prompt,
                                      ubatch=ub)
                if err:
                    self.errors[name] = err
                    continue
                self.samples.setdefault(name, []).extend(ts)
                self.reads.setdefault(name, []).append(read)
                print(f"bench_tiers: prefill round {r + 1}/{a.prompt_rounds} {name}: {sum(ts) / len(ts):.2f} t/s",
                      file=sys.stderr)

    def decode_table(self, out: dict[str, object], compute_ms: float, rand: float) -> None:
        stock = self.samples[self.runs[0][0]]
        print(f"\n{'run':<34} {'tokens/s':>9} {'95% CI':>8} {'vs stock':>9} {'MB read/token':>14} {'floor t/s':>10} "
              f"{'floor/run':>9}")
        for name, _, spec in self.runs:
            if name in self.errors or not self.samples[name]:
                print(f"{name:<34} {self.errors.get(name, 'no samples')}")
                out["runs"][name] = {"spec": spec, "error": self.errors.get(name)}  # type: ignore[index]
                continue
            ci = mean_ci(self.samples[name])
            rc = ratio_ci(self.samples[name], stock) if stock else None
            mb = sum(self.reads[name]) / len(self.reads[name]) / 1e6
            floor_ms = mb / rand * 1000.0 + compute_ms
            vs = f"{rc.ratio:8.2f}x" if rc else "       -"
            print(f"{name:<34} {ci.mean:9.2f} {ci.half_width:8.2f} {vs} {mb:14.1f} {1000.0 / floor_ms:10.2f} "
                  f"{(1000.0 / floor_ms) / ci.mean:8.2f}x")
            out["runs"][name] = {  # type: ignore[index]
                "spec": spec, "samples_ts": self.samples[name], "mean": ci.mean, "ci95": ci.half_width,
                "vs_stock": rc.ratio if rc else None, "vs_stock_ci": [rc.low, rc.high] if rc else None,
                "read_bytes_per_token": mb * 1e6, "floor_ts": 1000.0 / floor_ms, "stats": self.stats_doc.get(name)}

    def prefill_table(self, out: dict[str, object]) -> None:
        a = self.a
        print(f"\nprefill, a cold prompt of {a.prompt} tokens (pp{a.prompt}, no warmup), under the same limit")
        print(f"{'run':<40} {'tokens/s':>9} {'95% CI':>8} {'vs stock':>9} {'GB read':>8}")
        pstock = self.samples.get(self.prompt_runs[0][0], [])
        out["prefill"] = {}
        for name, _, spec, ub in self.prompt_runs:
            if name in self.errors or not self.samples.get(name):
                print(f"{name:<40} {self.errors.get(name, 'no samples')}")
                continue
            ci = mean_ci(self.samples[name])
            rc = ratio_ci(self.samples[name], pstock) if pstock else None
            gb = sum(self.reads[name]) / len(self.reads[name]) / 1e9
            print(f"{name:<40} {ci.mean:9.2f} {ci.half_width:8.2f} {f'{rc.ratio:8.2f}x' if rc else '       -'} "
                  f"{gb:8.2f}")
            out["prefill"][name] = {  # type: ignore[index]
                "spec": spec, "ubatch": ub, "samples_ts": self.samples[name], "mean": ci.mean, "ci95": ci.half_width,
                "vs_stock": rc.ratio if rc else None, "read_bytes": gb * 1e9}

    def run(self) -> int:
        a = self.a
        self.measure_disk()
        compute_ms = self.compute_in_ram()
        cg = MemoryCgroup(self.limit, "moe-subst-bench")
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
            self.decode_rounds(cg, tmp)
            self.prefill_rounds(cg)
        finally:
            cg.close()
        seq = sorted(d[0] for d in self.disk)[len(self.disk) // 2]
        rand = sorted(d[1] for d in self.disk)[len(self.disk) // 2]
        print(f"bench_tiers: disk, median of {len(self.disk)} measurements: {seq:.0f} MB/s sequential, {rand:.0f} "
              "MB/s in expert-slice reads", file=sys.stderr)
        out: dict[str, object] = {"model": str(self.model), "disk_samples_MBps": self.disk,
                                  "file_bytes": self.file_bytes, "ram_limit": self.limit, "disk_seq_MBps": seq,
                                  "disk_chunk_MBps": rand, "chunk_bytes": self.chunk, "compute_ms_in_ram": compute_ms,
                                  "tokens": a.tokens, "threads": a.threads, "rounds": a.rounds, "runs": {}}
        self.decode_table(out, compute_ms, rand)
        if a.prompt:
            self.prefill_table(out)
        out["simulate"] = cost_model(a, self.info, self.model, compute_ms, self.trace, {
            n: (sp, self.samples[n], self.stats_doc.get(n)) for n, _, sp in self.runs if sp and self.samples.get(n)})
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"bench_tiers: wrote {a.out}", file=sys.stderr)
        return 0


def main(argv: list[str], description: str) -> int:
    """The script's entry: --full-scale (harness.orchestration.tiers_full), --refit, or the issue-11 benchmark; an
    error is one line."""
    try:
        if "--full-scale" in argv:
            from harness.orchestration.tiers_full import full_scale

            return full_scale(argv)
        a = tiers_args(argv, description)
        return refit(a) if a.refit else TiersBench(a).run()
    except HarnessError as e:
        sys.exit(f"bench_tiers: {e}")
