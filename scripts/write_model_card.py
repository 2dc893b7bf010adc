#!/usr/bin/env python3
"""Write a trained model's card, models/<shape>.json and models/<shape>.md, from the run's own records.

tinymoe (the default): inputs in build/tinymoe: config.json, tinymoe-f16.trainlog.jsonl, tinymoe-f16.eval.json,
corpus_stats.json, tokenizer.json; models/tinymoe-export-check.json (scripts/check_export.py).
studymoe (``--shape studymoe --work DIR``): the same records of the run folder that made the model (a decay branch:
its config.json says where the constant phase ended), plus the bits per byte of eval/bpb/studymoe-*, the greedy
generations of eval/gen-studymoe and the routing statistics of eval/routing-studymoe (models/studymoe.md, "Reproduce").
Also copies the tokenizer and the training log next to the model.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build/tinymoe"
MODELS = ROOT / "models"


def routing_rows(routing: list[dict]) -> str:
    return "\n".join(
        f"| {r['layer']} | {r['usage_entropy_nats']:.3f} | {r['usage_entropy_norm']:.3f} | "
        f"{100 * r['share_below_10pct_uniform']:.1f}% | {100 * r['share_dead_below_1pct_uniform']:.1f}% | "
        f"{r['max_load_over_uniform']:.2f} | {r['mean_first_choice_gate']:.3f} |"
        for r in routing)


def logit_rows(chk: dict, labels: dict[str, str]) -> str:
    return "\n".join(
        f"| {labels.get(name, name)} | {v['positions']:,} | {v['max_abs_err']:.2e} | {v['max_abs_logit']:.2f} | "
        f"{v['max_abs_err_over_max_abs_logit']:.2e} | {v['max_row_rel_l2_err']:.2e} | "
        f"{100 * v['argmax_agreement']:.2f}% |"
        for name, v in chk["logits"].items())


def active_params(cfg: dict) -> int:
    d, L, E, k, f, V = (cfg[x] for x in ("d_model", "n_layer", "n_expert", "top_k", "d_expert", "vocab_size"))
    attn = d * cfg["n_head"] * cfg["head_dim"] * 2 + d * cfg["n_kv_head"] * cfg["head_dim"] * 2
    return L * (attn + d * E + k * 3 * d * f) + V * d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tinymoe", choices=("tinymoe", "studymoe"))
    ap.add_argument("--work", default=None, help="the run folder (studymoe: the decay branch's)")
    args = ap.parse_args()
    if args.shape == "studymoe":
        if args.work is None:
            ap.error("--shape studymoe needs --work (the run folder of the finished model)")
        return studymoe_card(Path(args.work))
    return tinymoe_card()


def tinymoe_card() -> int:
    cfg = json.loads((WORK / "config.json").read_text())
    ev = json.loads((WORK / "tinymoe-f16.eval.json").read_text())
    chk = json.loads((MODELS / "tinymoe-export-check.json").read_text())
    corpus = json.loads((WORK / "corpus_stats.json").read_text())
    log = [json.loads(line) for line in (WORK / "tinymoe-f16.trainlog.jsonl").read_text().splitlines()]
    shutil.copy(WORK / "tokenizer.json", MODELS / "tinymoe-tokenizer.json")
    shutil.copy(WORK / "tinymoe-f16.trainlog.jsonl", MODELS / "tinymoe-trainlog.jsonl")
    gguf_path = MODELS / "tinymoe-f16.gguf"

    d, L, E, k, f, V = (cfg[x] for x in ("d_model", "n_layer", "n_expert", "top_k", "d_expert", "vocab_size"))
    attn = d * cfg["n_head"] * cfg["head_dim"] * 2 + d * cfg["n_kv_head"] * cfg["head_dim"] * 2
    expert = 3 * d * f
    active = L * (attn + d * E + k * expert) + V * d
    heldout_evals = [r for r in log if "heldout_loss" in r]
    card = {
        "schema_version": 1,
        "model": "models/tinymoe-f16.gguf",
        "file_bytes": gguf_path.stat().st_size,
        "config": cfg,
        "params_total": ev["n_params"],
        "params_active_per_token": active,
        "corpus": corpus,
        "tokens_seen": ev["tokens_seen"],
        "train_seconds": ev["train_seconds"],
        "final_train_loss": log[-1]["loss"],
        "heldout_loss_curve": [{"step": r["step"], "tokens": r["tokens"], "loss": r["heldout_loss"]}
                               for r in heldout_evals],
        "heldout": {k2: ev[k2] for k2 in ("heldout_tokens", "n_ctx", "n_chunks", "scored_tokens",
                                          "ppl_pytorch_f16_weights", "unigram_ppl")},
        "llama_perplexity_heldout": chk["perplexity"]["llama_perplexity"],
        "routing": ev["routing"],
        "export_check": chk,
        "test_perplexity": {"n_ctx": cfg["n_ctx"], "chunks": 16,
                            "ppl": chk["perplexity"]["llama_perplexity_first16chunks"]},
    }
    (MODELS / "tinymoe.json").write_text(json.dumps(card, indent=1) + "\n")

    pp = chk["perplexity"]
    labels = {"f16_gguf_default_context": "F16 GGUF, default context (F16 KV cache, flash attn auto)",
              "f16_gguf_f32_kv_cache": "F16 GGUF, F32 KV cache",
              "f32_gguf_f32_kv_cache": "F32 GGUF (not committed), F32 KV cache, vs unrounded fp32"}
    logit_rows = "\n".join(
        f"| {labels.get(name, name)} | {v['positions']:,} | {v['max_abs_err']:.2e} | {v['max_abs_logit']:.2f} | "
        f"{v['max_abs_err_over_max_abs_logit']:.2e} | {v['max_row_rel_l2_err']:.2e} | "
        f"{100 * v['argmax_agreement']:.2f}% |"
        for name, v in chk["logits"].items())
    rows = "\n".join(
        f"| {r['layer']} | {r['usage_entropy_nats']:.3f} | {r['usage_entropy_norm']:.3f} | "
        f"{100 * r['share_below_10pct_uniform']:.1f}% | {100 * r['share_dead_below_1pct_uniform']:.1f}% | "
        f"{r['max_load_over_uniform']:.2f} | {r['mean_first_choice_gate']:.3f} |"
        for r in ev["routing"])
    dead = [round(r["share_dead_below_1pct_uniform"] * E) for r in ev["routing"]]
    worst = max(range(L), key=lambda i: dead[i])
    dead_line = (
        f"Dead experts (< 1% of the uniform load): {sum(dead)} of {L * E} overall "
        f"({100 * sum(dead) / (L * E):.1f}%); per layer {', '.join(str(x) for x in dead)} of {E}. "
        + ("Every layer is within the issue's bound of 10%." if max(dead) <= 0.1 * E else
           f"Layer {worst} is **above** the issue's bound of 10% ({dead[worst]} of {E} = "
           f"{100 * dead[worst] / E:.1f}%); the model as a whole is within it."))
    curve = "\n".join(f"| {r['step']} | {r['tokens']:,} | {r['heldout_loss']:.3f} |" for r in heldout_evals)
    corpus_rows = "\n".join(f"| {dom} | {v['documents']:,} | {v['characters']:,} |" for dom, v in corpus.items())
    tok_h = chk["tokenizer_heldout.txt"]
    tok_t = chk["tokenizer_topic-shift.txt"]
    md = f"""# tinymoe — the project's own small MoE language model

`models/tinymoe-f16.gguf` ({card['file_bytes'] / 1e6:.1f} MB, F16; norms and router in F32) is a
decoder-only MoE language model in llama.cpp's **qwen3moe** layout, trained on this machine from scratch
by `scripts/train_moe.py`. Stock llama.cpp (the pinned tree in `vendor/llama.cpp`) loads and runs it
unchanged. It is small and trained briefly: a model whose router has learned something, so that expert
substitution has a measurable effect — not a useful assistant.

## Architecture

| | |
|---|---|
| layers | {L} |
| d_model | {d} |
| attention | {cfg['n_head']} query heads, {cfg['n_kv_head']} KV heads (GQA), head dim {cfg['head_dim']}, \
RMSNorm on q and k per head, RoPE NEOX, theta {cfg['rope_theta']:g} |
| MoE FFN | {E} experts per layer, top-{k}, softmax router over all experts, top-k weights renormalised \
to sum to 1 (norm_topk_prob), SwiGLU experts with hidden size {f}; no shared expert |
| norms | RMSNorm, eps {cfg['rms_eps']:g} |
| vocabulary | {V} tokens, byte-level BPE (`tokenizer.ggml.pre = qwen2`), `<\\|endoftext\\|>` = id 0 \
is BOS/EOS/document separator, add_bos = false |
| embeddings | tied (no `output.weight`; llama.cpp uses `token_embd.weight`) |
| context | {cfg['n_ctx']} |
| parameters | {card['params_total']:,} total, {active:,} active per token (incl. embeddings) |

## Training

- Data: offline text of this machine (details and licences: `eval/data/README`): CPython 3.11 standard
  library sources, English manual pages and licence texts, reference tables (glibc charmaps and
  locales, tz database, /etc/services, distro-info). Training split:

| domain | documents | characters |
|---|---:|---:|
{corpus_rows}

- Tokens seen: **{card['tokens_seen']:,}** ({cfg['steps']} steps x {cfg['batch_seqs']} sequences x
  {cfg['n_ctx']} tokens, windows drawn uniformly from the ~10.4M-token training stream), in
  {card['train_seconds'] / 60:.1f} minutes of wall time on 2 shared CPU cores (bf16 autocast, fp32 master
  weights; other jobs were compiling in parallel).
- AdamW (beta 0.9/0.95, weight decay {cfg['weight_decay']}), lr {cfg['lr']:g}: {cfg['warmup']} warmup
  steps, constant, linear decay to {cfg['min_lr_frac']}x from step {cfg['decay_start']} to {cfg['steps']};
  grad clip {cfg['grad_clip']}; load-balancing loss coefficient {cfg['aux_loss_coef']} (E x sum over experts
  of assignment fraction x mean router probability), router z-loss {cfg['z_loss_coef']:g}; seed {cfg['seed']}.
- Loss curve: `models/tinymoe-trainlog.jsonl` (every step: training cross-entropy, aux loss, grad norm,
  lr; every {cfg['eval_every']} steps the loss on the first 8 x {cfg['n_ctx']} held-out tokens). Final
  training loss {card['final_train_loss']:.3f}.

| step | tokens | held-out loss (8 windows) |
|---:|---:|---:|
{curve}

## Quality (eval/data/heldout.txt, {ev['heldout_tokens']:,} tokens, never trained on)

Perplexity as llama-perplexity computes it: {ev['n_chunks']} chunks of n_ctx = {ev['n_ctx']}, the second
half of each chunk scored ({ev['scored_tokens']:,} tokens).

| model | perplexity |
|---|---:|
| tinymoe, llama-perplexity (stock build, F16 GGUF) | **{pp['llama_perplexity']:.3f}** |
| tinymoe, PyTorch (fp32 with the GGUF's F16-rounded weights) | {pp['pytorch']:.3f} |
| unigram model of the same tokenizer (training-stream frequencies, add-one) | {ev['unigram_ppl']:.1f} |

## Expert usage (held-out text, all {ev['n_chunks'] * ev['n_ctx']:,} positions, top-{k} assignments)

Entropy of the per-layer expert load distribution (maximum ln {E} = {__import__('math').log(E):.3f} nats for a
uniform load); share of experts receiving < 10% and < 1% ("dead") of the uniform load; the busiest
expert's load over uniform; the mean renormalised gate weight of the router's first choice (uniform
top-{k} would give {1 / k:.3f}).

| layer | entropy (nats) | entropy / ln E | < 10% of uniform | < 1% (dead) | max load / uniform \
| mean first-choice gate |
|---:|---:|---:|---:|---:|---:|---:|
{rows}

{dead_line}

## Export check (`scripts/check_export.py`, stock build)

- Tokeniser: llama.cpp's tokenisation equals the HF tokenizer's on heldout.txt ({tok_h['hf_tokens']:,}
  tokens: identical = {tok_h['identical']}) and topic-shift.txt ({tok_t['hf_tokens']:,} tokens: identical =
  {tok_t['identical']}); `tests/test_trained_model.py` re-checks it on a tricky string plus 40k characters.
- Logits on the first {next(iter(chk['logits'].values()))['positions'] // cfg['n_ctx']} windows of
  {cfg['n_ctx']} held-out tokens, llama.cpp vs PyTorch fp32 with the F16-rounded weights (relative error
  = max abs error / max |logit|; "row L2" = worst per-position ||llama - torch|| / ||torch||):

| llama.cpp side | positions | max abs err | max abs logit | relative | worst row L2 | argmax agreement |
|---|---:|---:|---:|---:|---:|---:|
{logit_rows}

  The all-F32 export agrees with PyTorch to float rounding, so the export itself is exact; the F16
  rows show the cost of F16 weights, F16 activations in llama.cpp's F16 matmuls and the F16 KV cache.
- Perplexity, all chunks: llama-perplexity {pp['llama_perplexity']:.4f} vs PyTorch {pp['pytorch']:.4f}
  (relative difference {pp['rel_diff']:.1e}); first 16 chunks: {pp['llama_perplexity_first16chunks']:.4f}
  vs {pp['pytorch_first16chunks']:.4f} ({pp['rel_diff_first16chunks']:.1e}).
- `tests/test_trained_model.py` runs llama-perplexity on the **first 16 chunks** (n_ctx 512) of
  heldout.txt and requires {card['test_perplexity']['ppl']:.4f} to 0.1%.

## Reproduce

```
.venv/bin/python -m pip install -e '.[train]'
.venv/bin/python scripts/build_corpus.py
nice -n 10 .venv/bin/python scripts/train_moe.py --stage all --steps {cfg['steps']} --decay-start {cfg['decay_start']}
scripts/build_llama_logits.sh && .venv/bin/python scripts/check_export.py
.venv/bin/python scripts/write_model_card.py
```

The committed run used `--time-budget 2700` (decay starts when 80% of the budget has passed, total
steps = 1.25 x that step); the two numbers it chose are the ones in the command above, which repeats the
run without the clock. The seed fixes the initialisation and the batches; that a rerun gives the
same weights bit for bit (bf16 autocast on 2 threads) was not verified.

## Limits

The 2 CPU cores were shared with other sessions' builds and tests during training (the process ran at
nice 10 and often got a third of one core), so the run saw only {card['tokens_seen']:,} tokens; a first
attempt with 16-sequence batches and 100 warmup steps was stopped after 35 steps for lack of throughput
and is not part of this model. Tiny and under-trained (a tenth of one epoch of a ~10M-token corpus);
perplexities are for this corpus's domains only. Routing statistics are from one held-out text.
The model has no chat template
and is not instruction-tuned.
"""
    (MODELS / "tinymoe.md").write_text(md)
    print("wrote models/tinymoe.json, models/tinymoe.md")
    return 0


def _bpb(name: str) -> dict | None:
    f = ROOT / "eval/bpb" / name / "bpb.json"
    return json.loads(f.read_text()) if f.is_file() else None


def studymoe_card(work: Path) -> int:
    """models/studymoe.json and models/studymoe.md of the finished model, with models/studymoe-notes.md (the run's
    history and commands, kept by hand) appended."""
    sys.path.insert(0, str(ROOT))
    from harness.domain.generation import degeneration
    from harness.tools.datasets import read_prompts

    cfg = json.loads((work / "config.json").read_text())
    ev = json.loads((work / "studymoe-f16.eval.json").read_text())
    chk = json.loads((MODELS / "studymoe-export-check.json").read_text())
    corpus = json.loads((work / "corpus_stats.json").read_text())
    log = [json.loads(line) for line in (work / "studymoe-f16.trainlog.jsonl").read_text().splitlines()]
    shutil.copy(work / "tokenizer.json", MODELS / "studymoe-tokenizer.json")
    shutil.copy(work / "studymoe-f16.trainlog.jsonl", MODELS / "studymoe-trainlog.jsonl")
    gguf = MODELS / "studymoe-q8_0.gguf"
    d, L, E, k, f, V = (cfg[x] for x in ("d_model", "n_layer", "n_expert", "top_k", "d_expert", "vocab_size"))
    active = active_params(cfg)
    heldout_evals = [r for r in log if "heldout_loss" in r]
    steps = log[-1]["step"] + 1

    # bits per byte against the targets (two thirds of tinymoe's)
    bpb_rows, bpb = [], {}
    for text, tag in (("heldout.txt", "heldout"), ("heldout-docs.txt", "heldout-docs")):
        ours, tiny = _bpb(f"studymoe-{tag}"), _bpb(f"tinymoe-{tag}")
        if ours is None or tiny is None:
            raise SystemExit(f"write_model_card.py: eval/bpb/studymoe-{tag} or tinymoe-{tag} is missing: "
                             "run harness bpb")
        target = 2 / 3 * tiny["bits_per_byte"]
        met = ours["bits_per_byte"] <= target
        bpb[text] = {"bits_per_byte": ours["bits_per_byte"], "ci": [ours["ci_low"], ours["ci_high"]],
                     "ppl": ours["ppl"], "bytes_per_token": ours["bytes_per_token"], "chunks": ours["n_chunks"],
                     "tinymoe": tiny["bits_per_byte"], "target": target, "met": met}
        bpb_rows.append(f"| {text} | {ours['n_chunks']} | {ours['bytes_per_token']:.3f} | {ours['ppl']:.2f} | "
                        f"**{ours['bits_per_byte']:.4f}** [{ours['ci_low']:.4f}, {ours['ci_high']:.4f}] | "
                        f"{tiny['bits_per_byte']:.4f} | {target:.4f} | {'met' if met else '**not met**'} |")

    # greedy generations of the full model (harness generate; the degeneration rule of harness.stats.degeneration)
    gen_dir = ROOT / "eval/gen-studymoe"
    prompts = read_prompts(ROOT / "eval/data/gen-prompts-domains.jsonl")
    full = {}
    for line in (gen_dir / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "gen" and r.get("config") == "full":
            full = {str(g["id"]): g for g in r["generations"]}
    if not full:
        raise SystemExit("write_model_card.py: eval/gen-studymoe has no generations of the full model")
    degen = degeneration(prompts, full)
    degen_rows = "\n".join(f"| {x.kind} | {x.share.n} | {x.share.k} "
                           f"({100 * x.share.k / max(x.share.n, 1):.0f}%) "
                           f"[{100 * x.share.low:.0f}%, {100 * x.share.high:.0f}%] | {', '.join(x.ids) or '-'} |"
                           for x in degen)
    examples = []
    for pid in ("heldout-code-02", "heldout-prose-02", "docs-prose-03"):
        p = next((q for q in prompts if q.id == pid), None)
        if p is not None and pid in full:
            tail = p.text[-120:]
            examples.append(f"**{pid}** (prompt ends `...{tail!r}`) continues:\n\n```\n{full[pid]['text']}\n```")

    dead = [round(r["share_dead_below_1pct_uniform"] * E) for r in ev["routing"]]
    card = {
        "schema_version": 1,
        "model": "models/studymoe-q8_0.gguf",
        "file_bytes": gguf.stat().st_size,
        "type": "Q8_0 (from the F16 export by the stock build's llama-quantize; F16 not committed)",
        "config": cfg,
        "params_total": ev["n_params"],
        "params_active_per_token": active,
        "corpus": corpus,
        "tokens_seen": ev["tokens_seen"],
        "steps": steps,
        "train_seconds": ev["train_seconds"],
        "final_train_loss": log[-1]["loss"],
        "heldout_loss_curve": [{"step": r["step"], "tokens": r["tokens"], "loss": r["heldout_loss"]}
                               for r in heldout_evals],
        "heldout": {k2: ev[k2] for k2 in ("heldout_tokens", "n_ctx", "n_chunks", "scored_tokens",
                                          "ppl_pytorch_f16_weights", "unigram_ppl")},
        "bits_per_byte": bpb,
        "generations": {x.kind: {"prompts": x.share.n, "degenerate": x.share.k, "ids": list(x.ids)} for x in degen},
        "routing": ev["routing"],
        "export_check": chk,
    }
    (MODELS / "studymoe.json").write_text(json.dumps(card, indent=1) + "\n")

    pp = chk["perplexity"]
    labels = {"f16_gguf_default_context": "F16 GGUF, default context (F16 KV cache, flash attn auto)",
              "f16_gguf_f32_kv_cache": "F16 GGUF, F32 KV cache",
              "f32_gguf_f32_kv_cache": "F32 GGUF (not committed), F32 KV cache, vs unrounded fp32"}
    curve = "\n".join(f"| {r['step']} | {r['tokens']:,} | {r['heldout_loss']:.3f} |" for r in heldout_evals
                      if r["step"] % 500 == 0 or r is heldout_evals[-1])
    corpus_rows = "\n".join(f"| {dom} | {v['documents']:,} | {v['characters']:,} |" for dom, v in corpus.items())
    tok_h = chk["tokenizer_heldout.txt"]
    tok_t = chk["tokenizer_topic-shift.txt"]
    q8 = pp.get("llama_perplexity_q8_0")
    q8_line = (f"- The committed Q8_0 file: llama-perplexity {q8:.4f} on heldout.txt against the F16 file's "
               f"{pp['llama_perplexity']:.4f} ({100 * (q8 / pp['llama_perplexity'] - 1):+.2f}%).\n" if q8 else "")
    hours = card["train_seconds"] / 3600
    md = f"""# studymoe — a small MoE language model with the study's routing shape (512 experts, top-{k})

`models/studymoe-q8_0.gguf` ({card['file_bytes'] / 1e6:.1f} MB, Q8_0; norms and router in F32) is a decoder-only
MoE language model in llama.cpp's **qwen3moe** layout, trained on this machine from scratch by
`scripts/train_moe.py --shape studymoe`, with the routing shape of the study's model (Qwen3-Next: {E} routed
experts per layer, top-{k}, normalised top-k gate weights). Stock llama.cpp loads and runs it unchanged
(`LLAMA_ARG_REPACK=0` on this VM only, see "Limits"). It is what issue 22 asked for: a model strong enough to carry
the study's quality claims, not a useful assistant. tinymoe (models/tinymoe.md) stays for the fast tests.

## Architecture

| | |
|---|---|
| layers | {L} |
| d_model | {d} |
| attention | {cfg['n_head']} query heads, {cfg['n_kv_head']} KV heads (GQA), head dim {cfg['head_dim']}, \
RMSNorm on q and k per head, RoPE NEOX, theta {cfg['rope_theta']:g} |
| MoE FFN | **{E} experts per layer, top-{k}**, softmax router over all experts, top-k weights renormalised \
to sum to 1 (norm_topk_prob), SwiGLU experts with hidden size {f}; no shared expert |
| norms | RMSNorm, eps {cfg['rms_eps']:g} |
| vocabulary | {V} tokens, byte-level BPE (`tokenizer.ggml.pre = qwen2`), `<\\|endoftext\\|>` = id 0 \
is BOS/EOS/document separator, add_bos = false |
| embeddings | tied (no `output.weight`; llama.cpp uses `token_embd.weight`) |
| context | {cfg['n_ctx']} |
| parameters | {card['params_total']:,} total ({L * E * 3 * d * f:,} in experts), {active:,} active per token \
(incl. embeddings) |

## Training

- Data: `scripts/build_corpus.py --corpus study`, offline text of this machine (eval/data/README): CPython 3.11
  standard library and Python dist-packages sources, Perl modules; manual pages, licences, Python/Perl/Git/PostgreSQL
  documentation; reference tables. heldout.txt, topic-shift.txt and every bucket-0/1 document stay out of training.

| domain | documents | characters |
|---|---:|---:|
{corpus_rows}

- Tokens seen: **{card['tokens_seen']:,}** ({steps:,} steps x {cfg['batch_seqs']} sequences x {cfg['n_ctx']}
  tokens, windows drawn uniformly from the training stream of 28.35 M tokens), {hours:.1f} hours of wall time over
  several sessions on 2 CPU cores, most of it shared with builds and tests (2.2 s a step on idle cores).
- AdamW (beta 0.9/0.95, weight decay {cfg['weight_decay']}), lr {cfg['lr']:g}: {cfg['warmup']} warmup steps,
  constant to step {cfg['decay_start']:,}, then linear decay to {cfg['min_lr_frac']}x by step {cfg['steps']:,} (a
  *decay branch*: the constant-lr run's checkpoint at step {cfg['decay_start']:,}, resumed in its own folder with
  `--stable-steps {cfg['decay_start']} --decay-steps {cfg['steps'] - cfg['decay_start']}`; the constant-lr run can
  go on from the same checkpoint); grad clip {cfg['grad_clip']}; load-balancing loss {cfg['aux_loss_coef']}, router
  z-loss {cfg['z_loss_coef']:g}; capacity factor {cfg['capacity_factor']} (training only: one batched matmul per
  projection over all experts); bf16 autocast with fp32 master weights; seed {cfg['seed']}.
- Loss curve: `models/studymoe-trainlog.jsonl` (every step: training cross-entropy, aux loss, router z, grad norm,
  lr; every {cfg['eval_every']} steps the loss on the first 8 x {cfg['n_ctx']} held-out tokens, which are Python
  code). Final training loss {card['final_train_loss']:.3f}.

| step | tokens | held-out loss (8 windows) |
|---:|---:|---:|
{curve}

## Quality: bits per byte (`harness bpb`, eval/bpb)

Cross-entropy per byte of held-out text (total NLL / ln 2 / bytes; tokenizer-independent), all chunks of n_ctx
{cfg['n_ctx']}, 95% block-bootstrap CI over chunks. Issue 22's target: at most two thirds of tinymoe's.

| text | chunks | bytes/token | PPL/token | **bits per byte** [95% CI] | tinymoe | target | |
|---|---:|---:|---:|---|---:|---:|---|
{chr(10).join(bpb_rows)}

PyTorch's perplexity of heldout.txt with the F16-rounded weights (the eval stage): {ev['ppl_pytorch_f16_weights']:.3f};
a unigram model of the same tokenizer: {ev['unigram_ppl']:.1f}.

## Greedy generations (`harness generate`, eval/gen-studymoe)

{len(prompts)} prompts (`eval/data/gen-prompts-domains.jsonl`: beginnings of held-out code files and prose
documents, by the fixed rule of `scripts/make_domain_prompts.py`), 48 tokens each, greedy, the full model (cache
off). A generation *degenerates* when it ends in a loop (a suffix repeating with a period of at most 16 tokens over
at least max(16, 3 periods) tokens; `harness.stats.degeneration`, fixed before the run). Wilson 95% CI.

| kind | prompts | degenerate [95% CI] | which |
|---|---:|---|---|
{degen_rows}

{chr(10).join(examples)}

## Expert usage (held-out text, all {ev['n_chunks'] * ev['n_ctx']:,} positions, top-{k} assignments)

Entropy of the per-layer expert load (maximum ln {E} = {math.log(E):.3f} nats); share of experts receiving < 10% and
< 1% ("dead") of the uniform load; the busiest expert's load over uniform; the mean normalised gate weight of the
first choice (uniform top-{k} would give {1 / k:.3f}). Gate weight by rank, heavy calls and temporal reuse beside
published models' figures: eval/routing-studymoe/report.md (`harness routing`).

| layer | entropy (nats) | entropy / ln E | < 10% of uniform | < 1% (dead) | max load / uniform \
| mean first-choice gate |
|---:|---:|---:|---:|---:|---:|---:|
{routing_rows(ev['routing'])}

Dead experts (< 1% of the uniform load): {sum(dead)} of {L * E} ({100 * sum(dead) / (L * E):.1f}%); per layer
{', '.join(str(x) for x in dead)} of {E}.

## Export check (`scripts/check_export.py`, stock build)

- Tokeniser: llama.cpp's tokenisation equals the HF tokenizer's on heldout.txt ({tok_h['hf_tokens']:,} tokens:
  identical = {tok_h['identical']}) and topic-shift.txt ({tok_t['hf_tokens']:,} tokens: identical = \
{tok_t['identical']}).
- Logits on the first {next(iter(chk['logits'].values()))['positions'] // cfg['n_ctx']} windows of {cfg['n_ctx']}
  held-out tokens, llama.cpp vs PyTorch fp32 with the F16-rounded weights:

| llama.cpp side | positions | max abs err | max abs logit | relative | worst row L2 | argmax agreement |
|---|---:|---:|---:|---:|---:|---:|
{logit_rows(chk, labels)}

- Perplexity, all chunks: llama-perplexity {pp['llama_perplexity']:.4f} (F16 file) vs PyTorch {pp['pytorch']:.4f}
  (relative difference {pp['rel_diff']:.1e}); first 16 chunks: {pp['llama_perplexity_first16chunks']:.4f} vs
  {pp['pytorch_first16chunks']:.4f} ({pp['rel_diff_first16chunks']:.1e}).
{q8_line}
## Reproduce

See "Reproduce" in the sections below (kept by hand): the corpus, the tokenizer, the constant-lr run, the decay
branch, export, checks and measurements, with the commands that made every file named here.
"""
    hand = MODELS / "studymoe-notes.md"
    if hand.is_file():
        md += "\n" + hand.read_text()
    (MODELS / "studymoe.md").write_text(md)
    print("wrote models/studymoe.json, models/studymoe.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
