#!/usr/bin/env python3
"""Fuzzing of the project's inputs (issue 15): damaged files must give a clear error, never a crash or a hang.

Input kinds and the targets each case goes through:
- gguf: a small generated MoE model (harness.tools.synth), truncated at every section boundary (header, each
  metadata key, the tensor table, the data start, each tensor's data; and one byte either side) and with bit
  flips in the header, the metadata and the tensor table; through `harness info` (in a forked child) and the
  patched llama-perplexity with the expert cache on (`mode=engine`; a subprocess);
- trace: a router trace (harness.parsers.trace), truncated at the header and record boundaries and inside
  records, with bit flips in the header and damaged record fields (layer, token, expert ids, weights, actions);
  through harness.parsers.trace.read_expert_trace and llama-moe-sim (replay and --info);
- nll: a per-token NLL dump (harness.parsers.nll_dump), truncated and bit-flipped, with non-finite values;
  through read_nll_dump_file and the paired delta of harness.stats (the way compare uses it).

Each case runs with a time limit (--case-timeout) and each target's cases stop at --max-cases or --time-limit.
Outcomes: `accepted` (the input still made sense), `clear` (a non-zero exit with an error message and no crash
trace), and the findings: `crash` (a signal, a GGML_ASSERT/abort, a Python traceback), `hang` (past the time limit),
`unclear` (a non-zero exit without any error line), `control` (the undamaged input, always the first case, was
not accepted: the setup is broken). Exit status 1 when there is a finding; the damaged inputs of
findings are kept under --keep.

    .venv/bin/python scripts/fuzz_inputs.py                    # the full run (a few minutes)
    .venv/bin/python scripts/fuzz_inputs.py --quick            # the bounded CI version (tests/test_fuzz_inputs.py)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from harness.core.errors import HarnessError  # noqa: E402

MEMORY_LIMIT = 8 << 30  # address space of a tool under test: a damaged size must fail, not swap the machine


@dataclass(frozen=True)
class Case:
    kind: str
    name: str
    data: bytes


@dataclass
class Tally:
    cases: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    seconds: float = 0.0


# ---- inputs ---------------------------------------------------------------------------------------------------


def _flip(data: bytes, pos: int, bit: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 1 << bit
    return bytes(b)


def _truncations(name: str, kind: str, data: bytes, bounds: list[int]) -> Iterator[Case]:
    seen: set[int] = set()
    for b in sorted(bounds):
        for at in (b - 1, b, b + 1):
            if 0 <= at < len(data) and at not in seen:
                seen.add(at)
                yield Case(kind, f"{name} truncated at {at} of {len(data)}", data[:at])


def _flips(name: str, kind: str, data: bytes, lo: int, hi: int, n: int, rng: random.Random) -> Iterator[Case]:
    for _ in range(n):
        pos, bit = rng.randrange(lo, hi), rng.randrange(8)
        yield Case(kind, f"{name} bit {bit} of byte {pos} flipped", _flip(data, pos, bit))


def gguf_cases(model: Path, rng: random.Random, n_flips: int) -> list[Case]:
    import gguf

    data = model.read_bytes()
    reader = gguf.GGUFReader(str(model))
    bounds = [4, 8, 16, 24]  # magic, version, tensor count, kv count
    for f in reader.fields.values():
        bounds += [f.offset, f.offset + sum(int(p.nbytes) for p in f.parts)]
    for t in reader.tensors:
        bounds += [t.field.offset, int(t.data_offset), int(t.data_offset) + int(t.n_bytes)]
    table_end = max(t.field.offset + sum(int(p.nbytes) for p in t.field.parts) for t in reader.tensors)
    bounds += [table_end, int(reader.data_offset), len(data)]
    cases = list(_truncations("model", "gguf", data, bounds))
    cases += _flips("model header", "gguf", data, 0, 24, max(4, n_flips // 8), rng)
    cases += _flips("model metadata/tensor table", "gguf", data, 24, table_end, n_flips, rng)
    return cases


def trace_cases(path: Path, rng: random.Random, n_flips: int) -> list[Case]:
    from harness.parsers.trace import TRACE_HEADER_SIZE, read_trace_header

    data = path.read_bytes()
    h = read_trace_header(path)
    rsize = h.record_size
    n_rec = (len(data) - TRACE_HEADER_SIZE) // rsize
    bounds = [8, 12, 16, 20, 24, 28, 32, 36, 40, TRACE_HEADER_SIZE]
    bounds += [TRACE_HEADER_SIZE + i * rsize for i in (1, 2, n_rec // 2, n_rec)]
    bounds += [TRACE_HEADER_SIZE + rsize // 2, TRACE_HEADER_SIZE + (n_rec - 1) * rsize + 8]
    cases = list(_truncations("trace", "trace", data, bounds))
    cases += _flips("trace header", "trace", data, 0, TRACE_HEADER_SIZE, n_flips, rng)
    k, top = h.k, h.top_m
    fields = {"layer": (0, "<I"), "token": (4, "<I"), "id": (8, "<i"), "weight": (8 + 4 * k, "<f"),
              "used": (8 + 8 * k, "<i"), "action": (8 + 12 * k, "<B"), "top_id": (8 + 12 * k + (k + 3) // 4 * 4, "<i"),
              "top_score": (8 + 12 * k + (k + 3) // 4 * 4 + 4 * top, "<f")}
    values: dict[str, list[float]] = {
        "<I": [h.n_layer, 2**31, 2**32 - 1], "<i": [-1, h.n_expert, 2**31 - 1, -(2**31)],
        "<f": [float("nan"), float("inf"), -1.0, 1e30], "<B": [5, 9, 255]}
    for name, (off, fmt) in fields.items():
        if name.startswith("top") and not top:
            continue
        for v in values[fmt]:
            rec = rng.randrange(n_rec)
            b = bytearray(data)
            struct.pack_into(fmt, b, TRACE_HEADER_SIZE + rec * rsize + off, v)
            cases.append(Case("trace", f"trace record {rec}: {name} = {v}", bytes(b)))
    return cases


def nll_bytes(n_ctx: int, first: int, n_chunk: int, rng: random.Random) -> bytes:
    count = n_chunk * (n_ctx - first - 1)
    tokens = struct.pack(f"<{count}i", *(rng.randrange(1000) for _ in range(count)))
    nll = struct.pack(f"<{count}d", *(rng.uniform(0.5, 6.0) for _ in range(count)))
    return b"LLNLLDMP" + struct.pack("<4IQ", 1, n_ctx, first, n_chunk, count) + tokens + nll


def nll_cases(rng: random.Random, n_flips: int) -> list[Case]:
    data = nll_bytes(16, 4, 3, rng)
    count = 3 * 11
    bounds = [8, 12, 16, 20, 24, 32, 32 + 4 * count, 32 + 8 * count, len(data)]
    cases = list(_truncations("nll dump", "nll", data, bounds))
    cases += _flips("nll dump header", "nll", data, 0, 32, n_flips, rng)
    for what, off, fmt, v in (("n_ctx", 12, "<I", 4), ("first", 16, "<I", 16), ("first", 16, "<I", 15),
                              ("n_chunk", 20, "<I", 0), ("count", 24, "<Q", 0), ("count", 24, "<Q", 2**63),
                              ("n_ctx", 12, "<I", 2**32 - 1), ("a value", 32 + 4 * count, "<d", float("nan")),
                              ("a value", 32 + 4 * count + 8, "<d", float("inf"))):
        b = bytearray(data)
        struct.pack_into(fmt, b, off, v)
        cases.append(Case("nll", f"nll dump: {what} = {v}", bytes(b)))
    empty = b"LLNLLDMP" + struct.pack("<4IQ", 1, 4, 4, 0, 0)  # first >= n_ctx with no chunks: consistent but empty
    cases.append(Case("nll", "nll dump: first = n_ctx, no chunks", empty))
    return cases


# ---- targets ---------------------------------------------------------------------------------------------------


def _in_child(fn: Callable[[Path], None], path: Path, timeout: float) -> tuple[str, str]:
    """fn(path) in a forked child with a time limit: (outcome, detail)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def run() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                fn(path)
            child.send(("accepted", ""))
        except HarnessError as e:
            msg = str(e)
            child.send(("clear" if msg and "\n" not in msg else "unclear", msg))
        except SystemExit as e:
            text = out.getvalue()
            if e.code in (0, None):
                child.send(("accepted", ""))
            elif "Traceback" in text:
                child.send(("crash", text[-2000:]))
            else:
                child.send(("clear" if text.strip() else "unclear", text.strip()[-500:]))
        except BaseException:  # noqa: BLE001 - any other exception is the finding
            child.send(("crash", traceback.format_exc()[-2000:]))

    p = ctx.Process(target=run)
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return "hang", f"more than {timeout:.0f} s"
    if parent.poll():
        outcome, detail = parent.recv()
        return str(outcome), str(detail)
    return "crash", f"the child died (exit code {p.exitcode})"


def harness_info(path: Path) -> None:
    from harness.cli.app import main

    rc = main(["info", str(path)])
    raise SystemExit(rc)


def read_trace(path: Path) -> None:
    from harness.parsers.trace import decode_order, read_expert_trace, recorded_actions

    t = read_expert_trace(path)
    decode_order(t)
    recorded_actions(t)


def read_nll(path: Path) -> None:
    from harness.parsers.nll_dump import read_nll_dump_file
    from harness.stats.intervals import paired_delta_ppl

    d = read_nll_dump_file(path)
    paired_delta_ppl(d.nll, d.nll + 0.01, d.chunk, n_boot=50)


CRASH_MARKS = ("GGML_ASSERT", "Segmentation fault", "Aborted", "terminate called", "core dumped", "AddressSanitizer",
               "runtime error:")


def _sanitized(tool: str) -> bool:
    """An AddressSanitizer build (./build.sh --sanitize) reserves terabytes of shadow memory: no address-space limit
    for it (ASan bounds its own allocations)."""
    try:
        return b"__asan_init" in Path(tool).read_bytes()
    except OSError:
        return False


def run_tool(argv: list[str], env: dict[str, str], timeout: float) -> tuple[str, str]:
    limit_as = not _sanitized(argv[0])

    def limits() -> None:
        if limit_as:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    try:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, errors="replace", timeout=timeout,
                           preexec_fn=limits)
    except subprocess.TimeoutExpired:
        return "hang", f"more than {timeout:.0f} s"
    out = r.stdout + r.stderr
    tail = "\n".join(out.strip().splitlines()[-6:])
    if r.returncode < 0:
        return "crash", f"{signal.Signals(-r.returncode).name}: {tail}"
    if any(m in out for m in CRASH_MARKS):
        return "crash", tail
    if r.returncode == 0:
        return "accepted", ""
    errors = [ln for ln in out.splitlines() if " E " in ln or "error" in ln.lower() or "LLAMA_MOE_CACHE" in ln]
    return ("clear", errors[0][-300:]) if errors else ("unclear", tail)


def perplexity_target(bin_dir: Path, text: Path) -> Callable[[Path, float], tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    env["LLAMA_MOE_CACHE"] = "mode=engine,policy=quality,slots=50%"

    def run(path: Path, timeout: float) -> tuple[str, str]:
        return run_tool([str(bin_dir / "llama-perplexity"), "-m", str(path), "-f", str(text), "-c", "32", "-b", "32",
                         "--chunks", "1", "-t", "1"], env, timeout)

    return run


COMPARE_TIME_FACTOR = 4  # a compare of an accepted model runs six tools (~3 s): more time than the other targets


def compare_target(text: Path, work: Path) -> Callable[[Path, float], tuple[str, str]]:
    """`harness compare --model` in a subprocess: rejected with one clear error (the harness's GGUF reader, or a
    tool's load error it reports), or accepted; a Python traceback, a tool's crash (a signal, an assert) or a
    message-less exit is the finding."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    runs = itertools.count()

    def run(path: Path, timeout: float) -> tuple[str, str]:
        out_dir = work / f"compare-{next(runs)}"
        argv = [sys.executable, "-c", "import sys; from harness.cli.app import main; sys.exit(main(sys.argv[1:]))",
                "compare", "--model", str(path), "--text", str(text), "--out", str(out_dir), "--policies", "quality",
                "--runs", "1", "--ctx", "32", "--chunks", "1", "--n-prompt", "8", "--n-gen", "4", "--threads", "1"]
        try:
            r = subprocess.run(argv, env=env, capture_output=True, text=True, errors="replace", timeout=timeout)
        except subprocess.TimeoutExpired:
            return "hang", f"more than {timeout:.0f} s"
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        out = r.stdout + r.stderr
        tail = "\n".join(out.strip().splitlines()[-6:])
        if r.returncode < 0 or "Traceback" in out or "killed by signal" in out or any(m in out for m in CRASH_MARKS):
            return "crash", tail
        if r.returncode == 0:
            return "accepted", ""
        first = next((ln for ln in r.stderr.splitlines() if ln.strip()), "")
        return ("clear", first[-300:]) if first else ("unclear", tail)

    return run


def moe_sim_target(bin_dir: Path, info: bool) -> Callable[[Path, float], tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}

    def run(path: Path, timeout: float) -> tuple[str, str]:
        args = ["--info"] if info else ["--spec", "policy=quality,slots=50%", "-o", os.devnull]
        return run_tool([str(bin_dir / "llama-moe-sim"), "--trace", str(path), "-q", "-j", "1", *args], env, timeout)

    return run


# ---- the loop ---------------------------------------------------------------------------------------------------


def fuzz(cases: list[Case], targets: dict[str, Callable[[Path, float], tuple[str, str]]], work: Path, keep: Path | None,
         max_cases: int, time_limit: float, case_timeout: float, log: Callable[[str], None],
         verbose: bool = False, only: tuple[str, ...] = ()) -> dict[str, Tally]:
    tallies: dict[str, Tally] = {}
    for tname, target in targets.items():
        if only and not any(w in tname for w in only):
            continue
        tally = tallies.setdefault(tname, Tally())
        t0 = time.monotonic()
        limit = time_limit * (COMPARE_TIME_FACTOR if tname.startswith("harness compare") else 1)
        for i, case in enumerate(cases[:max_cases]):
            if i > 0 and time.monotonic() - t0 > limit:
                break
            path = work / f"case-{case.kind}-{i}.bin"
            path.write_bytes(case.data)
            outcome, detail = target(path, case_timeout)
            if case.name.endswith("(undamaged)") and outcome != "accepted":
                outcome = "control"  # the undamaged input must pass: otherwise every other outcome means nothing
            tally.cases += 1
            tally.outcomes[outcome] = tally.outcomes.get(outcome, 0) + 1
            if verbose:
                log(f"{tname}: {case.name}: {outcome}: {detail[:200]}")
            if outcome in ("crash", "hang", "unclear", "control"):
                tally.findings.append(f"{tname}: {case.name}: {outcome}: {detail}")
                log(f"FINDING {tname}: {case.name}: {outcome}: {detail}")
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    shutil.copy(path, keep / f"{tname.replace(' ', '_')}-{i}.bin")
            path.unlink()
        tally.seconds = time.monotonic() - t0
    return tallies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the bounded CI version: few cases per target, ~30 s")
    ap.add_argument("--kinds", default="gguf,trace,nll", help="input kinds (default: %(default)s)")
    ap.add_argument("--max-cases", type=int, help="cases per target at most (default: all; --quick: 24)")
    ap.add_argument("--time-limit", type=float, help="seconds per target at most (default: 600; --quick: 5)")
    ap.add_argument("--case-timeout", type=float, default=20.0, help="seconds per case (default: %(default)s)")
    ap.add_argument("--flips", type=int, help="bit flips per region (default: 64; --quick: 8)")
    ap.add_argument("--targets", help="only the targets whose name contains one of these comma-separated words")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", type=Path, help="the patched build's bin folder (default: build/builds.json's)")
    ap.add_argument("--keep", type=Path, help="keep the inputs of findings here")
    ap.add_argument("--json", type=Path, help="write the tallies as JSON here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case's outcome")
    args = ap.parse_args(argv)
    max_cases = args.max_cases or (24 if args.quick else 10**9)
    time_limit = args.time_limit or (5.0 if args.quick else 600.0)
    n_flips = args.flips or (8 if args.quick else 64)
    rng = random.Random(args.seed)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    only = tuple(w.strip() for w in (args.targets or "").split(",") if w.strip())
    bin_dir = args.bin
    if bin_dir is None:
        from harness.core.project import get_build

        try:
            bin_dir = get_build("patched").bin_dir
        except HarnessError as e:
            print(f"fuzz_inputs: no patched build ({e}); only the Python readers are fuzzed", file=sys.stderr)

    def have(tool: str) -> bool:
        return bin_dir is not None and (bin_dir / tool).is_file()

    def have_stock() -> bool:
        from harness.core.project import get_build

        try:
            get_build("stock")
        except HarnessError:
            print("fuzz_inputs: no stock build: `harness compare --model` is not fuzzed", file=sys.stderr)
            return False
        return True

    # imported once here, so that every forked case starts warm
    import gguf  # noqa: F401

    import harness.cli.app  # noqa: F401
    import harness.parsers.nll_dump  # noqa: F401
    import harness.parsers.trace  # noqa: F401
    import harness.stats.intervals  # noqa: F401

    results: dict[str, dict[str, Tally]] = {}
    with tempfile.TemporaryDirectory(prefix="moe-fuzz-") as tmp:
        work = Path(tmp)
        if "gguf" in kinds:
            from harness.tools.synth import SynthSpec, synth_text, write_synth_model

            model = write_synth_model(SynthSpec(arch="qwen3moe", n_expert=8, n_expert_used=2, n_layer=2, seed=3),
                                      work / "model.gguf")
            text = work / "text.txt"
            text.write_text(synth_text(2000, seed=1))
            targets: dict[str, Callable[[Path, float], tuple[str, str]]] = {
                "harness info": lambda p, t: _in_child(harness_info, p, t)}
            if have("llama-perplexity"):
                assert bin_dir is not None
                targets["llama-perplexity (cache on)"] = perplexity_target(bin_dir, text)
                if have_stock():
                    targets["harness compare --model"] = compare_target(text, work)
            cases = gguf_cases(model, rng, n_flips)
            rng.shuffle(cases)  # a bounded run samples every kind of damage
            cases.insert(0, Case("gguf", "model (undamaged)", model.read_bytes()))
            results["gguf"] = fuzz(cases, targets, work, args.keep, max_cases, time_limit, args.case_timeout, print,
                                     args.verbose, only)
        if "trace" in kinds:
            from harness.parsers.trace import synthetic_trace, write_expert_trace

            trace = write_expert_trace(work / "trace.bin", synthetic_trace(n_layer=2, n_expert=8, k=2, n_tokens=48,
                                                                             top_m=8, n_slots=4, seed=2))
            targets = {"read_expert_trace": lambda p, t: _in_child(read_trace, p, t)}
            if have("llama-moe-sim"):
                assert bin_dir is not None
                targets["llama-moe-sim"] = moe_sim_target(bin_dir, info=False)
                targets["llama-moe-sim --info"] = moe_sim_target(bin_dir, info=True)
            cases = trace_cases(trace, rng, n_flips)
            rng.shuffle(cases)
            cases.insert(0, Case("trace", "trace (undamaged)", trace.read_bytes()))
            results["trace"] = fuzz(cases, targets, work, args.keep, max_cases, time_limit, args.case_timeout, print,
                                     args.verbose, only)
        if "nll" in kinds:
            cases = nll_cases(rng, n_flips)
            rng.shuffle(cases)
            cases.insert(0, Case("nll", "nll dump (undamaged)", nll_bytes(16, 4, 3, rng)))
            results["nll"] = fuzz(cases, {"read_nll_dump_file + paired delta": lambda p, t: _in_child(read_nll, p, t)},
                                  work, args.keep, max_cases, time_limit, args.case_timeout, print,
                                     args.verbose, only)

    n_findings = 0
    print(f"{'input':6} {'target':36} {'cases':>5}  outcomes")
    for kind, tallies in results.items():
        for tname, t in tallies.items():
            outs = ", ".join(f"{k} {v}" for k, v in sorted(t.outcomes.items()))
            print(f"{kind:6} {tname:36} {t.cases:5}  {outs} ({t.seconds:.1f} s)")
            n_findings += len(t.findings)
    if args.json:
        args.json.write_text(json.dumps({kind: {tn: {"cases": t.cases, "outcomes": t.outcomes, "findings": t.findings,
                                                     "seconds": round(t.seconds, 2)} for tn, t in tallies.items()}
                                         for kind, tallies in results.items()}, indent=2) + "\n")
    print(f"{n_findings} finding{'s' if n_findings != 1 else ''}")
    return 1 if n_findings else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
