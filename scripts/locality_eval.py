#!/usr/bin/env python3
"""How a trained stand-in's routing behaves in an expert cache: the screening measurement of issue 36's levers.

For a model (an exported GGUF, or a training checkpoint of scripts/train_moe.py) it computes, in PyTorch:
- the router's choices on held-out text (eval/data/heldout.txt, chunks of n_ctx as llama-perplexity cuts them),
  written as a router trace in the engine's format (harness.parsers.trace), in decode order;
- fetch-all's hit rate at several residencies with each eviction (lfu, lru, classlru), replayed by the patched
  build's llama-moe-sim (the engine's own policy code), from a **warm start**: the initial residency is the profile
  (`profile=`) of calibration text, never the evaluated tokens (the first chunks of the training stream's tail);
- usage entropy and next-token reuse (harness.stats.routing), and the perplexity of the text (PyTorch, the model's
  own weights), from which bits per byte follow for a fixed tokenizer.

One JSON line per model on stdout (and with --out, appended to that file):

    .venv/bin/python scripts/locality_eval.py --gguf models/studymoe-q8_0.gguf --chunks 64
    .venv/bin/python scripts/locality_eval.py --ckpt ~/.cache/moe-subst/lever-x/ckpt.pt --chunks 64 --label x

It measures the model's routing, not a decode's timing: the engine's decode order and counters, no clock.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import train_moe as tm  # noqa: E402

from harness.parsers.trace import TRACE_VERSION, ExpertTrace, trace_dtype, write_expert_trace  # noqa: E402
from harness.stats.routing import routing_stats  # noqa: E402

RESIDENCIES = (5.0, 12.5, 25.0, 37.5, 50.0)
EVICTS = ("lfu", "lru", "classlru")
SIM = ROOT / "vendor/llama.cpp-patched/build-cpu/bin/llama-moe-sim"


def load_model(args):
    import torch

    cfg = tm.Config(**tm.SHAPES["studymoe"])
    if args.ckpt:
        ck = torch.load(args.ckpt, weights_only=False)
        cfg = tm.Config(**ck["config"])
        model = tm.build_model(cfg)
        model.load_state_dict(ck["state_dict"])
        step = ck.get("step")
    else:
        model = tm.build_model(cfg)
        step, _ = tm.load_gguf_weights(cfg, model, Path(args.gguf))
    model.eval()
    return cfg, model, step


def route(cfg, model, ids: np.ndarray, chunks: list[int]):
    """Per layer: top-k ids and normalised weights of every position of the given chunks, in that order; and the
    NLL sum and count of the positions llama-perplexity scores."""
    ids_l = [[] for _ in range(cfg.n_layer)]
    w_l = [[] for _ in range(cfg.n_layer)]
    nll, count = 0.0, 0
    for _, nll_b, count_b, stats in tm.scored_batches(model, ids, chunks, cfg.n_ctx):
        nll += nll_b
        count += count_b
        for li, st in enumerate(stats):
            ids_l[li].append(st["top_i"].numpy().astype(np.int32))
            w_l[li].append(st["gate"].float().numpy())
    return [np.concatenate(a) for a in ids_l], [np.concatenate(a) for a in w_l], nll, count


def make_trace(cfg, ids_l, w_l) -> ExpertTrace:
    n_tok = len(ids_l[0])
    n_layer, k = cfg.n_layer, cfg.top_k
    rec = np.zeros(n_tok * n_layer, dtype=trace_dtype(k, 0))
    rec["pred"] = -1
    for il in range(n_layer):
        idx = np.arange(n_tok) * n_layer + il  # decode order: token by token, layer by layer
        rec["layer"][idx] = il
        rec["token"][idx] = np.arange(n_tok, dtype=np.uint32)
        rec["ids"][idx] = ids_l[il]
        rec["weights"][idx] = w_l[il]
        rec["used"][idx] = ids_l[il]
    return ExpertTrace(TRACE_VERSION, n_layer, cfg.n_expert, k, 0, 0, rec)


def write_profile(path: Path, cfg, ids_l) -> None:
    lines = ["moe-expert-profile 1"]
    for il, a in enumerate(ids_l):
        c = np.bincount(a.reshape(-1), minlength=cfg.n_expert)
        lines.append(f"layer {il} {cfg.n_expert} " + " ".join(str(int(v)) for v in c))
    path.write_text("\n".join(lines) + "\n")


def hit_rate(trace: Path, spec: str) -> float:
    r = subprocess.run([str(SIM), "--trace", str(trace), "--spec", spec, "--quiet"], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        raise SystemExit(f"locality_eval.py: error: llama-moe-sim failed on {spec!r}: {r.stderr.strip()[-400:]}")
    total = json.loads(r.stdout)["total"]
    return total["hits"] / max(1, total["hits"] + total["fetches"] + total.get("substitutions", 0)
                               + total.get("drops", 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="an exported GGUF of the studymoe shape")
    src.add_argument("--ckpt", help="a checkpoint of scripts/train_moe.py (ckpt.pt)")
    ap.add_argument("--work", default=None, help="the shape's work folder (tokenizer, training stream)")
    ap.add_argument("--text", default=str(ROOT / "eval/data/heldout.txt"))
    ap.add_argument("--chunks", type=int, default=64, help="chunks of the text (0: all)")
    ap.add_argument("--calib-chunks", type=int, default=16, help="chunks of calibration text for the warm start")
    ap.add_argument("--label", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="append the JSON line to this file")
    args = ap.parse_args()
    if not SIM.exists():
        raise SystemExit(f"locality_eval.py: error: no {SIM}: run ./build.sh first")
    import torch
    torch.set_num_threads(args.threads)

    cfg, model, step = load_model(args)
    work = Path(args.work) if args.work else tm.default_work("studymoe")
    tok = tm.load_tokenizer(work)
    text = Path(args.text).read_text(encoding="utf-8")
    ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    n_all = len(ids) // cfg.n_ctx
    n_chunk = n_all if args.chunks == 0 else min(args.chunks, n_all)
    # chunks spread evenly over the text (the text's domains in order; its first chunks alone are one kind)
    chunks = sorted({int(i) for i in np.linspace(0, n_all - 1, n_chunk).round()})
    # calibration: the last windows of the training stream (text the model was trained on, never the evaluated)
    stream = np.load(work / "train_tokens.npy").astype(np.int64)
    calib = stream[-(args.calib_chunks * cfg.n_ctx):]

    ids_l, w_l, nll, count = route(cfg, model, ids, chunks)
    cal_l, _, _, _ = route(cfg, model, calib, list(range(args.calib_chunks)))
    n_bytes_scored = None  # bits per byte need the scored tokens' bytes: bpb = nll / ln2 / bytes
    first = cfg.n_ctx // 2
    scored = np.concatenate([ids[i * cfg.n_ctx + first + 1:(i + 1) * cfg.n_ctx] for i in chunks])
    n_bytes_scored = sum(len(tok.decode([int(t)]).encode("utf-8")) for t in scored)

    with tempfile.TemporaryDirectory() as td:
        tr = write_expert_trace(Path(td) / "router.trace", make_trace(cfg, ids_l, w_l))
        prof = Path(td) / "calib.profile"
        write_profile(prof, cfg, cal_l)
        hits = {}
        for res in RESIDENCIES:
            for ev in EVICTS:
                spec = f"policy=fetch-all,evict={ev},slots={res:g}%,profile={prof}"
                hits[f"{ev}@{res:g}"] = round(hit_rate(tr, spec), 4)
    rs = routing_stats(make_trace(cfg, ids_l, w_l).records, cfg.top_k, cfg.n_expert)
    ppl = math.exp(nll / count)
    row = {
        "label": args.label or (args.ckpt or args.gguf), "step": step, "text": Path(args.text).name,
        "chunks": len(chunks), "ppl": round(ppl, 4), "bpb": round(nll / math.log(2) / n_bytes_scored, 4),
        "usage_entropy": round(rs.mean("usage_entropy"), 4), "reuse": round(rs.mean("reuse"), 4),
        "dead": round(rs.mean("dead"), 4),
        "best_fetch_all_hit@25": max(hits[f"{ev}@25"] for ev in ("lfu", "classlru")),
        "hits": hits,
        "config": {k: getattr(cfg, k) for k in ("aux_loss_coef", "aux_scope", "aux_ema", "locality_coef",
                                                 "locality_window", "capacity_factor", "lr")},
    }
    line = json.dumps(row)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
