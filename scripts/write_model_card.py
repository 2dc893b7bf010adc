#!/usr/bin/env python3
"""Write models/tinymoe.json and models/tinymoe.md from the training run's own records.

Inputs (build/tinymoe): config.json, tinymoe-f16.trainlog.jsonl, tinymoe-f16.eval.json,
corpus_stats.json, tokenizer.json; models/tinymoe-export-check.json (scripts/check_export.py).
Also copies the tokenizer and the training log next to the model.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build/tinymoe"
MODELS = ROOT / "models"


def main() -> int:
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


if __name__ == "__main__":
    sys.exit(main())
