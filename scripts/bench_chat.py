#!/usr/bin/env python3
"""A chat that stays fast (issue 24, item 3): llama-server, stock and patched, under one RAM limit, driven by the
openai client through a multi-turn conversation with the prompt cache; and the prefill of a long prompt at several
ubatch sizes. A benchmark: run it on a quiet machine.

    .venv/bin/python scripts/bench_chat.py --model M.gguf --ram 8G --spec auto --out eval/chat-M
    .venv/bin/python scripts/bench_chat.py --model M.gguf --ram 8G --prefill 2048 --ubatch 32,128,512 --out ...

Per configuration (stock; patched with --spec, default `auto`) and repetition: a fresh server in a memory cgroup of
--ram (checked against MemAvailable less a margin; the model file's page cache dropped first), the conversation of
--turns (JSON list of user messages; default: four turns of code and prose), greedy, --max-tokens per answer
(ignore_eos: every answer the same length, so that turns compare). Recorded per turn: time to first token (client
clock), prompt tokens processed and reused from llama-server's prompt cache, prompt t/s and decode t/s from /metrics
deltas, the expert cache's counters. With --prefill N: one prompt of N tokens of eval/data/heldout.txt per ubatch
size (cut to exactly N tokens of the model by the server), its time to first token and prompt t/s (a ubatch reads
about the whole model once when it does not fit). The chat template adds a few tokens: keep N below the server's
context per slot (llama-server caps it at the model's training context).

Writes --out/results.jsonl (one record per turn or prefill, with the settings) and --out/report.md (means with
t-based 95% CIs over the repetitions). Verdict rule, written before any run: the patched configuration "stays fast"
when its decode t/s on every turn after the first is at least its first turn's (the cache warms, it does not
degrade over the conversation: each turn's mean >= 0.9 x turn 1's lower CI end) and at least stock's at the same
limit (95% CIs of the ratio above 1).
"""

from __future__ import annotations

import argparse
import json
import math
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
from harness.stats.intervals import mean_ci  # noqa: E402
from harness.tools.cgroup import (  # noqa: E402
    RAM_MARGIN,
    MemoryCgroup,
    check_ram_limit,
    drop_page_cache,
    mem_available,
)
from harness.tools.chat import chat  # noqa: E402
from harness.tools.server import llama_server  # noqa: E402

DEFAULT_TURNS = [
    "Write a Python function that reads a text file and returns the ten most common words with their counts.",
    "Now change it so that it ignores case and punctuation, and explain each change.",
    "Write the manual page's DESCRIPTION section for a command-line tool built on that function.",
    "Summarise our conversation in three sentences.",
]


def prefill_text(n_tokens: int) -> str:
    """Held-out text long enough for n_tokens of any of the project's models (at least a byte a token, 8 to spare);
    the server cuts it to exactly n_tokens of its model (Server.truncate)."""
    text = (ROOT / "eval/data/heldout.txt").read_text(encoding="utf-8")
    return text[: n_tokens * 8]


def ci(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    if len(xs) < 2:
        return f"{xs[0]:.2f}"
    iv = mean_ci(xs)
    return f"{iv.mean:.2f} [{iv.low:.2f}, {iv.high:.2f}]"


def main() -> int:
    try:
        return run()
    except HarnessError as e:  # a server that did not start (auto's refusal, a bad spec): its one line, no traceback
        sys.exit(f"bench_chat: {e}")


def run() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--ram", required=True, help="the memory limit both servers run under, e.g. 8G")
    ap.add_argument("--spec", default="auto", help="the patched server's --moe-cache (default: auto)")
    ap.add_argument("--turns", type=Path, default=None, help="a JSON list of user messages")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=0, help="also time a prompt of this many tokens")
    ap.add_argument("--ubatch", default="512", help="ubatch sizes for --prefill, comma-separated")
    ap.add_argument("--no-stock", action="store_true", help="only the patched server")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    try:
        limit = parse_size(a.ram, allow_percent=False).resolve(0)
        check_ram_limit(limit, mem_available(), RAM_MARGIN)
        if not a.model.is_file():
            raise HarnessError(f"no model at {a.model}")
        turns = json.loads(a.turns.read_text()) if a.turns else DEFAULT_TURNS
        b = read_builds()
    except (HarnessError, OSError, ValueError) as e:
        sys.exit(f"bench_chat: {e}")
    a.out.mkdir(parents=True, exist_ok=True)
    results = a.out / "results.jsonl"
    configs = ([] if a.no_stock else [("stock", b["stock"], None)]) + [("patched", b["patched"], a.spec)]
    extra_nr = ["--no-repack"]  # quantized experts: the cache refuses repacked ones; stock runs the same way
    rows: list[dict] = []  # type: ignore[type-arg]
    with MemoryCgroup(limit, "moe-subst-chat") as cg, results.open("a") as out:
        def record(d: dict) -> None:  # type: ignore[type-arg]
            d.update({"model": a.model.name, "ram": a.ram, "threads": a.threads, "time": time.time()})
            out.write(json.dumps(d) + "\n")
            out.flush()
            rows.append(d)

        for rep in range(a.reps):
            for name, build, spec in configs:
                drop_page_cache(a.model)
                log = a.out / "logs" / f"{name}-{rep}.log"
                with llama_server(build.tool("llama-server"), a.model, log, spec=spec, ctx=a.ctx, threads=a.threads,
                                  extra=extra_nr, preexec=cg.preexec) as s:
                    for t in chat(s, turns, max_tokens=a.max_tokens, ignore_eos=True):
                        record({"kind": "turn", "config": name, "spec": spec, "rep": rep, "turn": t.index,
                                "ttft_s": t.ttft_s, "wall_s": t.wall_s, "prompt_tokens": t.prompt_tokens,
                                "prompt_cached": t.prompt_cached, "prompt_tps": t.prompt_tps,
                                "decode_tps": t.decode_tps, "predicted": t.predicted, "cache": t.cache})
                        print(f"bench_chat: {name} rep {rep} turn {t.index}: ttft {t.ttft_s:.2f} s, decode "
                              f"{t.decode_tps:.2f} t/s, prompt {t.prompt_tokens} new + {t.prompt_cached} cached",
                              flush=True)
                for ub in ([int(x) for x in a.ubatch.split(",")] if a.prefill else []):
                    drop_page_cache(a.model)
                    log = a.out / "logs" / f"{name}-{rep}-prefill-ub{ub}.log"
                    with llama_server(build.tool("llama-server"), a.model, log, spec=spec, ctx=a.ctx,
                                      threads=a.threads, extra=[*extra_nr, "-ub", str(ub), "-b", str(max(ub, 2048))],
                                      preexec=cg.preexec) as s:
                        prompt = s.truncate(prefill_text(a.prefill), a.prefill)
                        t = chat(s, [prompt + "\n\nSummarise the text above."], max_tokens=1)[0]
                        record({"kind": "prefill", "config": name, "spec": spec, "rep": rep, "ubatch": ub,
                                "ttft_s": t.ttft_s, "prompt_tokens": t.prompt_tokens, "prompt_tps": t.prompt_tps})
                        print(f"bench_chat: {name} rep {rep} prefill ub {ub}: {t.prompt_tokens} tokens, ttft "
                              f"{t.ttft_s:.2f} s ({t.prompt_tps:.1f} t/s)", flush=True)

    lines = [f"# Chat with llama-server: {a.model.name} in {a.ram}", "",
             f"{len(turns)} turns, {a.max_tokens} tokens an answer (greedy, ignore_eos), {a.reps} repetitions, "
             f"{a.threads} threads, a fresh server per repetition with the page cache dropped; patched spec `{a.spec}`."
             " Means with t-based 95% CIs over repetitions. Raw: results.jsonl.", "",
             "| config | turn | time to first token (s) | prompt tokens new / cached | prompt t/s | decode t/s |",
             "|---|---:|---|---|---|---|"]
    for name, _, _ in configs:
        for i in range(1, len(turns) + 1):
            rs = [r for r in rows if r["kind"] == "turn" and r["config"] == name and r["turn"] == i]
            if rs:
                lines.append(f"| {name} | {i} | {ci([r['ttft_s'] for r in rs])} | "
                             f"{statistics.mean(r['prompt_tokens'] for r in rs):.0f} / "
                             f"{statistics.mean(r['prompt_cached'] for r in rs):.0f} | "
                             f"{ci([r['prompt_tps'] for r in rs])} | {ci([r['decode_tps'] for r in rs])} |")
    pre = [r for r in rows if r["kind"] == "prefill"]
    if pre:
        lines += ["", "| config | ubatch | prompt tokens | time to first token (s) | prompt t/s |",
                  "|---|---:|---:|---|---|"]
        for name, _, _ in configs:
            for ub in sorted({r["ubatch"] for r in pre}):
                rs = [r for r in pre if r["config"] == name and r["ubatch"] == ub]
                if rs:
                    lines.append(f"| {name} | {ub} | {rs[0]['prompt_tokens']} | {ci([r['ttft_s'] for r in rs])} | "
                                 f"{ci([r['prompt_tps'] for r in rs])} |")
    (a.out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"bench_chat: wrote {a.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
