#!/usr/bin/env python3
"""Train the project's tiny MoE language model and export it to GGUF (qwen3moe layout).

Stages (``--stage``, default ``all``):
  tokenizer  train a byte-level BPE on the training corpus (build/tinymoe/train.jsonl, made by
             scripts/build_corpus.py) and encode the corpus to a token stream
  train      train the model (PyTorch, CPU, fp32 master weights; bf16 autocast where the CPU has native bf16,
             fp32 elsewhere: on an AVX2-only CPU bf16 is emulated and a studymoe step took 55 s instead of 6)
  export     write the F16 GGUF that stock llama.cpp loads as architecture ``qwen3moe``
  eval       PyTorch perplexity on eval/data/heldout.txt computed the way llama-perplexity does it,
             unigram perplexity, and routing statistics; written to <out>.eval.json

The model is the qwen3moe computation: RMSNorm; grouped-query attention with per-head RMSNorm on q and
k and NEOX-style RoPE; an MoE FFN whose router takes a softmax over all experts, keeps the top k and
renormalises their weights to sum to one; SwiGLU experts; tied input/output embeddings. Training adds a
load-balancing loss (fraction of assignments x mean router probability, summed over experts, times E).

Deterministic for a given seed and thread count. Re-run the committed model with:

    .venv/bin/python scripts/build_corpus.py
    nice -n 10 .venv/bin/python scripts/train_moe.py --stage all

Shapes (``--shape``): ``tinymoe`` (4 layers, 64 experts, top-8: models/tinymoe-f16.gguf) and ``studymoe``
(the study's routing shape: 512 experts per layer, top-10, normalised top-k weights; 6 layers, experts of
hidden size 32; trained on ``build_corpus.py --corpus study``; work folder build/studymoe).

Long runs (hours, over several sessions) checkpoint and resume. The schedule is warmup, constant lr until
``--stable-steps``, then a linear decay over ``--decay-steps``; ``--stop-after SECONDS`` ends a run early at a
step boundary with a checkpoint (also on SIGINT/SIGTERM), and ``--resume`` goes on from the newest checkpoint
with the same result as an uninterrupted run (model, optimiser, data-sampler and torch random states are all
saved). The checkpoint at the end of the constant phase is kept (``ckpt-stable-<step>.pt``), so that a later
session can extend the constant phase (resume from it with a larger ``--stable-steps``) and decay again:

    nice -n 10 .venv/bin/python scripts/train_moe.py --shape studymoe --stage train \
        --stable-steps 6000 --decay-steps 600 --stop-after 7200      # hours of it; then again with --resume

The checkpoints live in the cache folder and are lost with the machine; the committed model is not. To go on from
it (fresh optimiser, warmup from its step; models/studymoe-notes.md):

    .venv/bin/python scripts/train_moe.py --shape studymoe --stage tokenizer --tokenizer models/studymoe-tokenizer.json
    .venv/bin/python scripts/train_moe.py --shape studymoe --stage train --init-gguf models/studymoe-q8_0.gguf \
        --init-log models/studymoe-trainlog.jsonl --resume --lr 3e-4 --warmup 50 --time-budget 3000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# the pre-tokenizer regex of llama.cpp's "qwen2" pre type (src/llama-vocab.cpp), in the form the
# HF tokenizer.json of Qwen2 writes it; llama.cpp's copy is the same pattern with the case-insensitive
# group spelled out
QWEN2_PRETOKENIZER_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
EOT = "<|endoftext|>"


@dataclasses.dataclass
class Config:
    vocab_size: int = 8192
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 64
    n_expert: int = 64
    top_k: int = 8
    d_expert: int = 96
    n_ctx: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    # training
    seed: int = 1234
    batch_seqs: int = 8
    # learning-rate schedule: linear warmup, constant, then linear decay to min_lr_frac * lr over the
    # steps from decay_start to steps. With --time-budget the run picks decay_start when 80% of the
    # budget has passed and sets steps = 1.25 * decay_start; both are saved, and passing them back
    # (--decay-start N --steps M) reproduces the run without the clock.
    steps: int = 0
    decay_start: int = 0
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    aux_loss_coef: float = 0.01
    capacity_factor: float = 0.0  # training only; 0: no pair dropped (tinymoe)
    z_loss_coef: float = 1e-4
    grad_clip: float = 1.0
    threads: int = 2
    eval_every: int = 50
    name: str = "tinymoe"
    # a run that starts from an exported model (--init-gguf): the GGUF and the step it had reached; the warmup
    # and the --time-budget decay count from that step, with a fresh optimiser
    init_from: str = ""
    init_step: int = 0
    # "bf16": autocast (fp32 master weights); "fp32": no autocast. main() sets it from --precision (auto: bf16 where
    # oneDNN has native bf16 kernels, i.e. AVX-512 BF16 or AMX; fp32 elsewhere)
    precision: str = "bf16"
    # DITTO (Xu et al., NeurIPS 2022, "Learning to Break the Loop", implemented from its description): this share of
    # each batch's sequences are pseudo-repetitions, a span of the training stream of ditto_min..ditto_max tokens
    # repeated to fill the window; on every repetition after the first, the probability of each token is pushed to
    # ditto_lambda times the (stop-gradient) probability of the same token one repetition earlier, by the loss
    # -log(1 - |p_n - lambda * p_(n-1)|), instead of growing with each repetition. The rest of the batch is the
    # ordinary next-token loss. 0: plain language-model training.
    ditto_frac: float = 0.0
    ditto_lambda: float = 0.5
    ditto_min: int = 1
    ditto_max: int = 32
    # routing locality (issue 36's levers; results in eval/locality-levers). aux_scope "batch": the load-balancing
    # loss of each micro-batch (Switch); "global": the batch's router probabilities against the expert load averaged
    # over steps (an exponential moving average with decay aux_ema, detached), which balances the model over many
    # batches and lets one batch, and one document, use few experts (global-batch balancing).
    aux_scope: str = "batch"
    aux_ema: float = 0.99
    # locality_coef x the entropy (over ln E) of the mean router distribution of each window of locality_window
    # consecutive tokens of a sequence: with the balancing loss over the batch, a mutual-information objective between
    # the place in a text and its experts (few experts per window, all experts over the corpus). 0: off
    locality_coef: float = 0.0
    locality_window: int = 64


SHAPES = {
    "tinymoe": {},
    # the study's routing shape (Qwen3-Next: 512 routed experts, top-10, normalised top-k weights) with
    # experts small enough to train on 2 CPU cores and a Q8_0 GGUF under 100 MB
    "studymoe": {"name": "studymoe", "n_layer": 6, "n_expert": 512, "top_k": 10, "d_expert": 32,
                 "batch_seqs": 8, "lr": 2e-3, "warmup": 200, "eval_every": 100, "capacity_factor": 2.0},
}
# the second stand-in of issue 36: studymoe's shape and weights (it starts from models/studymoe-q8_0.gguf) trained on
# with the routing-locality levers that eval/locality-levers chose: the per-window router entropy over windows of 32
# tokens, balancing over many batches (global) at 3x studymoe's coefficient, capacity factor 4 (fewer dropped pairs)
SHAPES["localmoe"] = {**SHAPES["studymoe"], "name": "localmoe", "lr": 1e-3, "warmup": 30, "capacity_factor": 4.0,
                      "aux_scope": "global", "aux_loss_coef": 0.03, "locality_coef": 1.0, "locality_window": 32}


# --- tokenizer ----------------------------------------------------------------------------------

def corpus_texts(work: Path):
    """The documents of <work>/train.jsonl (scripts/build_corpus.py), in order."""
    with open(work / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_tokenizer(cfg: Config, work: Path, reuse: Path | None = None) -> None:
    """Train the BPE on <work>/train.jsonl and encode the corpus to <work>/train_tokens.npy; with ``reuse`` (a
    tokenizer.json, e.g. a committed model's models/<name>-tokenizer.json) encode with that one instead, so that a
    run going on from that model (--init-gguf) reads the same token ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if reuse is not None:
        tok = Tokenizer.from_file(str(reuse))
        if tok.get_vocab_size() != cfg.vocab_size or tok.token_to_id(EOT) is None:
            raise SystemExit(f"train_moe.py: error: --tokenizer {reuse}: not a {cfg.vocab_size}-token tokenizer "
                             f"with {EOT}")
        work.mkdir(parents=True, exist_ok=True)
        tok.save(str(work / "tokenizer.json"))
        encode_corpus(tok, work)
        return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZER_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=2, special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)


    tok.train_from_iterator(corpus_texts(work), trainer=trainer)
    assert tok.get_vocab_size() == cfg.vocab_size, tok.get_vocab_size()
    tok.save(str(work / "tokenizer.json"))
    encode_corpus(tok, work)


def encode_corpus(tok, work: Path) -> None:
    """<work>/train.jsonl to the training stream <work>/train_tokens.npy (documents separated by EOT)."""

    eot = tok.token_to_id(EOT)
    ids: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            ids.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
        batch.clear()

    for t in corpus_texts(work):
        batch.append(t)
        if len(batch) == 256:
            flush()
    flush()
    stream = np.concatenate(ids)
    np.save(work / "train_tokens.npy", stream)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, training stream {len(stream)} tokens")


def load_tokenizer(work: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(work / "tokenizer.json"))


# --- model --------------------------------------------------------------------------------------

def build_model(cfg: Config):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def rms_norm(x, w, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            E, d, f = cfg.n_expert, cfg.d_model, cfg.d_expert
            self.router = nn.Parameter(torch.empty(E, d))
            self.w_gate = nn.Parameter(torch.empty(E, f, d))
            self.w_up = nn.Parameter(torch.empty(E, f, d))
            self.w_down = nn.Parameter(torch.empty(E, d, f))
            # aux_scope "global": the expert load averaged over steps (uniform at the start)
            # (saved with the checkpoint only then: the resumed run continues the same average)
            self.register_buffer("load_ema", torch.full((E,), 1.0 / E), persistent=cfg.aux_scope == "global")

        def forward(self, x):  # x: [T, d]
            T, d = x.shape
            if torch.is_autocast_enabled("cpu"):
                x = x.to(torch.get_autocast_dtype("cpu"))  # gather/scatter in bf16: half the traffic
            E, k = cfg.n_expert, cfg.top_k
            logits = F.linear(x.float(), self.router.float())   # router in fp32
            probs = torch.softmax(logits, dim=-1)
            top_p, top_i = probs.topk(k, dim=-1)                # [T, k]
            gate = top_p / top_p.sum(-1, keepdim=True)
            flat_e = top_i.reshape(-1)
            order = torch.argsort(flat_e, stable=True)
            e_sorted = flat_e[order]
            tok_sorted = order // k
            counts = torch.bincount(flat_e, minlength=E)
            starts = torch.cumsum(counts, 0) - counts
            cap = int(counts.max())
            slot = torch.arange(T * k) - starts[e_sorted]
            gate_sorted = gate.reshape(-1)[order]
            if self.training and cfg.capacity_factor > 0:
                # capacity: an expert takes at most capacity_factor x its fair share of a batch's (token, expert)
                # pairs; the rest are dropped for this step (their tokens keep their other experts). Without it
                # the padded batch is as long as the busiest expert's load: with 512 experts and an unbalanced
                # early router, most of the bmm is padding (10 GB and minutes a step).
                cap = min(cap, max(1, math.ceil(cfg.capacity_factor * T * k / E)))
                keep = slot < cap
                e_sorted, slot, tok_sorted, gate_sorted = (t[keep] for t in (e_sorted, slot, tok_sorted, gate_sorted))
            dest = e_sorted * cap + slot
            # scatter the (token, expert) pairs into a zero-padded [E, cap, d] batch
            buf = x.new_zeros(E * cap, d).index_copy(0, dest, x[tok_sorted]).view(E, cap, d)
            wg = self.w_gate.to(x.dtype).transpose(1, 2)
            wu = self.w_up.to(x.dtype).transpose(1, 2)
            wd = self.w_down.to(x.dtype).transpose(1, 2)
            h = F.silu(torch.bmm(buf, wg)) * torch.bmm(buf, wu)
            y = torch.bmm(h, wd).reshape(E * cap, d)
            y = y[dest] * gate_sorted.unsqueeze(1).to(y.dtype)
            out = torch.zeros(T, d, dtype=y.dtype).index_add(0, tok_sorted, y)
            # load-balancing loss (Switch style, over all k choices) and router z-loss
            frac = counts.float() / (T * k)
            if cfg.aux_scope == "global" and self.training:
                with torch.no_grad():
                    self.load_ema.mul_(cfg.aux_ema).add_(frac, alpha=1.0 - cfg.aux_ema)
                frac = self.load_ema
            aux = E * (frac * probs.mean(0)).sum()
            z = torch.logsumexp(logits, -1).pow(2).mean()
            stats = {"top_i": top_i.detach(), "gate": gate.detach()}
            W = cfg.locality_window
            if self.training and cfg.locality_coef > 0 and T % W == 0:
                pm = probs.view(T // W, W, E).mean(1)
                stats["locality"] = -(pm * torch.log(pm + 1e-9)).sum(-1).mean() / math.log(E)
            return out, aux, z, stats

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d, hd = cfg.d_model, cfg.head_dim
            self.attn_norm = nn.Parameter(torch.ones(d))
            self.wq = nn.Linear(d, cfg.n_head * hd, bias=False)
            self.wk = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
            self.wv = nn.Linear(d, cfg.n_kv_head * hd, bias=False)
            self.wo = nn.Linear(cfg.n_head * hd, d, bias=False)
            self.q_norm = nn.Parameter(torch.ones(hd))
            self.k_norm = nn.Parameter(torch.ones(hd))
            self.ffn_norm = nn.Parameter(torch.ones(d))
            self.moe = MoE()

        def forward(self, x, cos, sin):
            B, S, d = x.shape
            hd = cfg.head_dim
            h = rms_norm(x, self.attn_norm, cfg.rms_eps)
            q = rms_norm(self.wq(h).view(B, S, cfg.n_head, hd), self.q_norm, cfg.rms_eps)
            k = rms_norm(self.wk(h).view(B, S, cfg.n_kv_head, hd), self.k_norm, cfg.rms_eps)
            v = self.wv(h).view(B, S, cfg.n_kv_head, hd)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(a.transpose(1, 2).reshape(B, S, -1))
            h = rms_norm(x, self.ffn_norm, cfg.rms_eps)
            m, aux, z, stats = self.moe(h.reshape(B * S, d))
            return x + m.view(B, S, d).to(x.dtype), aux, z, stats

    def rope(x, cos, sin):  # NEOX style: rotate the two halves of each head
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.out_norm = nn.Parameter(torch.ones(cfg.d_model))
            hd = cfg.head_dim
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
            ang = torch.arange(cfg.n_ctx, dtype=torch.float64)[:, None] * inv[None, :]
            self.register_buffer("cos", ang.cos().float()[None, :, None, :], persistent=False)
            self.register_buffer("sin", ang.sin().float()[None, :, None, :], persistent=False)

        def forward(self, ids):
            B, S = ids.shape
            x = self.embed[ids]
            cos, sin = self.cos[:, :S], self.sin[:, :S]
            auxs, zs, stats = [], [], []
            for blk in self.blocks:
                x, aux, z, st = blk(x, cos, sin)
                auxs.append(aux)
                zs.append(z)
                stats.append(st)
            x = rms_norm(x, self.out_norm, cfg.rms_eps)
            logits = F.linear(x, self.embed.to(x.dtype))
            return logits, torch.stack(auxs).mean(), torch.stack(zs).mean(), stats

    model = Model()
    g = torch.Generator().manual_seed(cfg.seed)
    std = 0.02
    out_std = std / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                continue
            s = out_std if (name.endswith("wo.weight") or name.endswith("w_down")) else std
            p.copy_(torch.randn(p.shape, generator=g) * s)
    return model


# --- training -----------------------------------------------------------------------------------

def heldout_tokens(work: Path) -> np.ndarray:
    tok = load_tokenizer(work)
    text = (ROOT / "eval/data/heldout.txt").read_text(encoding="utf-8")
    return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def lr_schedule(cfg: Config, step: int) -> float:
    """Warmup (from init_step), constant, then linear decay to min_lr_frac * lr from decay_start to steps."""
    if step - cfg.init_step < cfg.warmup:
        return cfg.lr * (step - cfg.init_step + 1) / cfg.warmup
    if cfg.decay_start <= 0 or step < cfg.decay_start:
        return cfg.lr
    t = (step - cfg.decay_start) / max(1, cfg.steps - cfg.decay_start)
    return cfg.lr * (1 - (1 - cfg.min_lr_frac) * min(1.0, t))


def save_atomic(obj, path: Path) -> None:
    import torch
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def ditto_loss(logits, y, periods: list[int], lam: float):
    """DITTO's sentence-level repetition penalty (Config.ditto_frac) on pseudo-repetitive rows: row r is a span of
    periods[r] tokens repeated; at every target j >= period + 1 (the second repetition on, less its first target),
    the model's probability of y[j] is pushed toward lam x its probability of the same token one period earlier
    (not differentiated): mean of -log(1 - |p_j - lam * p_(j-period)|)."""
    import torch

    terms = []
    for r, period in enumerate(periods):
        p = torch.softmax(logits[r].float(), -1).gather(-1, y[r].unsqueeze(-1)).squeeze(-1)  # [S]
        if p.shape[0] <= period + 1:
            continue
        cur, prev = p[period + 1:], p[1:-period].detach()
        terms.append(-torch.log((1.0 - (cur - lam * prev).abs()).clamp_min(1e-6)))
    return torch.cat(terms).mean() if terms else logits.new_zeros(())


def train(cfg: Config, work: Path, out: Path, time_budget: float | None, *, resume: bool = False,
          stop_after: float | None = None, stop_after_steps: int | None = None, ckpt_every: float = 600.0,
          init_gguf: Path | None = None, init_log: Path | None = None) -> bool:
    """Train; returns True when the schedule is complete (False: stopped early, a checkpoint holds the state).
    ``init_gguf``: start from that exported model's weights and step, with a fresh optimiser (ignored when
    ``resume`` finds a checkpoint); its trainlog (``init_log``) opens this run's log."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    def autocast():
        import contextlib
        return torch.autocast("cpu", dtype=torch.bfloat16) if cfg.precision == "bf16" else contextlib.nullcontext()

    print(f"precision {cfg.precision}" + (f"; DITTO on {cfg.ditto_frac:.0%} of each batch" if cfg.ditto_frac else ""),
          flush=True)
    for need in ("train_tokens.npy", "tokenizer.json"):
        if not (work / need).exists():
            raise SystemExit(f"train_moe.py: error: no {work / need}: run the tokenizer stage first (--stage tokenizer"
                             f", with --tokenizer models/<shape>-tokenizer.json to go on from a committed model)")
    stream = np.load(work / "train_tokens.npy").astype(np.int64)
    held = heldout_tokens(work)
    rng = np.random.default_rng(cfg.seed)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters; training stream {len(stream)} tokens", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    # a fixed slice of held-out text for the periodic eval (8 windows of n_ctx)
    n_ev = 8
    ev = torch.from_numpy(held[: n_ev * cfg.n_ctx + 1].copy())
    ev_x = ev[:-1].view(n_ev, cfg.n_ctx)
    ev_y = ev[1:].view(n_ev, cfg.n_ctx)

    ckpt_path = work / "ckpt.pt"
    log_path = out.with_suffix(".trainlog.jsonl")
    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if resume and not ckpt_path.exists() and init_gguf is not None:
        resume = False  # the first run from the GGUF; later ones resume from its checkpoints
    if resume:
        if not ckpt_path.exists():
            raise SystemExit(f"train_moe.py: error: --resume: no checkpoint at {ckpt_path}")
        ck = torch.load(ckpt_path, weights_only=False)
        saved = Config(**ck["config"])
        for key in ("n_layer", "n_expert", "top_k", "d_expert", "d_model", "vocab_size", "seed", "batch_seqs",
                    "n_ctx"):
            if getattr(saved, key) != getattr(cfg, key):
                raise SystemExit(f"train_moe.py: error: --resume: the checkpoint has {key}={getattr(saved, key)},"
                                 f" this run {getattr(cfg, key)}")
        model.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer"])
        cfg.init_from, cfg.init_step = saved.init_from, saved.init_step
        rng.bit_generator.state = ck["numpy_rng"]
        torch.set_rng_state(ck["torch_rng"])
        step, tokens_seen, elapsed_before = ck["step"], ck["tokens_seen"], ck["train_seconds"]
        # the log keeps the steps up to the checkpoint (a run killed after it wrote more lines)
        if log_path.exists():
            kept = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            log_path.write_text("".join(ln + "\n" for ln in kept))
        print(f"resumed at step {step} ({tokens_seen} tokens, {elapsed_before:.0f} s trained)", flush=True)
    elif init_gguf is not None:
        step, tokens_seen = load_gguf_weights(cfg, model, init_gguf)
        cfg.init_from, cfg.init_step = str(init_gguf), step
        # the data sampler starts from a seed of its own: the earlier run's batches are not replayed
        rng = np.random.default_rng([cfg.seed, step])
        kept = []
        if init_log is not None and init_log.exists():
            kept = [ln for ln in init_log.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            if kept:
                elapsed_before = float(json.loads(kept[-1]).get("elapsed_s", 0.0))
        log_path.write_text("".join(ln + "\n" for ln in kept))
        print(f"from {init_gguf}: step {step}, {tokens_seen} tokens ({len(kept)} log lines kept); fresh optimiser,"
              f" warmup {cfg.warmup} steps to lr {cfg.lr}", flush=True)
    elif log_path.exists():
        log_path.unlink()

    stopping = {"signal": None}

    def on_signal(signum, frame):  # finish the step, checkpoint, exit
        stopping["signal"] = signum

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def checkpoint(path: Path) -> None:
        save_atomic({"config": dataclasses.asdict(cfg), "state_dict": model.state_dict(),
                     "optimizer": opt.state_dict(), "numpy_rng": rng.bit_generator.state,
                     "torch_rng": torch.get_rng_state(), "step": step, "tokens_seen": tokens_seen,
                     "train_seconds": round(elapsed_before + time.time() - t0, 1)}, path)

    log = open(log_path, "a")
    first_step = step
    t0 = time.time()
    last_ckpt = t0
    if time_budget is None:
        assert cfg.steps > 0 and 0 < cfg.decay_start <= cfg.steps, "give --steps and --decay-start"
    else:
        cfg.steps, cfg.decay_start = 10**9, 0
    complete = True
    while step < cfg.steps:
        if time_budget is not None and cfg.decay_start == 0 and time.time() - t0 >= 0.8 * time_budget:
            cfg.decay_start = max(step, first_step + cfg.warmup)
            cfg.steps = cfg.decay_start + int(round(0.25 * (cfg.decay_start - first_step)))
            print(f"decay starts at step {cfg.decay_start}; total steps {cfg.steps}", flush=True)
        if step == cfg.decay_start and step > 0 and not (work / f"ckpt-stable-{step}.pt").exists():
            checkpoint(work / f"ckpt-stable-{step}.pt")
        if (stopping["signal"] is not None or (stop_after is not None and time.time() - t0 >= stop_after)
                or (stop_after_steps is not None and step >= first_step + stop_after_steps)):
            complete = False
            break
        n_rep = int(round(cfg.ditto_frac * cfg.batch_seqs))
        starts = rng.integers(0, len(stream) - cfg.n_ctx - 1, size=cfg.batch_seqs - n_rep)
        rows = [stream[s: s + cfg.n_ctx + 1] for s in starts]
        periods = []
        for _ in range(n_rep):
            period = int(rng.integers(cfg.ditto_min, cfg.ditto_max + 1))
            s = int(rng.integers(0, len(stream) - period))
            rows.append(np.resize(stream[s: s + period], cfg.n_ctx + 1))  # the span again and again
            periods.append(period)
        batch = np.stack(rows)
        x = torch.from_numpy(batch[:, :-1])
        y = torch.from_numpy(batch[:, 1:])
        for gr in opt.param_groups:
            gr["lr"] = lr_schedule(cfg, step)
        with autocast():
            logits, aux, z, mstats = model(x)
        n_lm = cfg.batch_seqs - n_rep
        ce = F.cross_entropy(logits[:n_lm].float().reshape(-1, cfg.vocab_size), y[:n_lm].reshape(-1))
        loss = ce + cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
        loc = None
        if cfg.locality_coef > 0:
            loc = torch.stack([st["locality"] for st in mstats]).mean()
            loss = loss + cfg.locality_coef * loc
        ditto = None
        if n_rep:
            ditto = ditto_loss(logits[n_lm:], y[n_lm:], periods, cfg.ditto_lambda)
            loss = loss + ditto
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        tokens_seen += x.numel()
        rec = {"step": step + 1, "tokens": tokens_seen, "loss": round(ce.item(), 5),
               **({} if ditto is None else {"ditto": round(ditto.item(), 5)}),
               **({} if loc is None else {"locality": round(loc.item(), 5)}),
               "aux": round(aux.item(), 5), "z": round(z.item(), 4), "grad_norm": round(gn.item(), 4),
               "lr": lr_schedule(cfg, step), "elapsed_s": round(elapsed_before + time.time() - t0, 1)}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            model.eval()
            with torch.no_grad(), autocast():
                el, _, _, _ = model(ev_x)
                rec["heldout_loss"] = round(F.cross_entropy(el.float().view(-1, cfg.vocab_size),
                                                            ev_y.reshape(-1)).item(), 5)
            model.train()
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if (step + 1) % 25 == 0 or "heldout_loss" in rec:
            print(json.dumps(rec), flush=True)
        step += 1
        if time.time() - last_ckpt >= ckpt_every:
            checkpoint(ckpt_path)
            last_ckpt = time.time()
    log.close()
    for s_, h in old_handlers.items():
        signal.signal(s_, h)
    checkpoint(ckpt_path)
    if not complete:
        if stopping["signal"] is not None:
            why = f"signal {stopping['signal']}"
        else:
            why = f"--stop-after-steps {stop_after_steps}" if stop_after is None else f"--stop-after {stop_after:.0f} s"
        print(f"stopped at step {step} of {cfg.steps} ({why}); checkpoint {ckpt_path}; go on with --resume",
              flush=True)
        return False
    save_atomic({"config": dataclasses.asdict(cfg), "state_dict": model.state_dict(),
                 "tokens_seen": tokens_seen, "train_seconds": round(elapsed_before + time.time() - t0, 1)},
                out.with_suffix(".pt"))
    print(f"trained {cfg.steps} steps, {tokens_seen} tokens in {elapsed_before + time.time() - t0:.0f} s")
    return True


def load_trained(out: Path, checkpoint: Path | None = None):
    """The finished model (<work>/<name>.pt), or with ``checkpoint`` the weights of a run in progress (its
    ckpt.pt: an interim model, to measure where a long run stands without stopping it)."""
    import torch
    ck = torch.load(checkpoint if checkpoint is not None else out.with_suffix(".pt"), weights_only=False)
    cfg = Config(**ck["config"])
    model = build_model(cfg)
    model.load_state_dict(ck["state_dict"])
    model.eval()
    return cfg, model, ck


# --- export -------------------------------------------------------------------------------------

def gguf_names(cfg: Config):
    """(gguf tensor name, state_dict key, stored as F32) in the qwen3moe layout of llama.cpp's tensor names."""
    yield "token_embd.weight", "embed", False
    yield "output_norm.weight", "out_norm", True
    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        b = f"blk.{i}."
        yield b + "attn_norm.weight", p + "attn_norm", True
        yield b + "attn_q.weight", p + "wq.weight", False
        yield b + "attn_k.weight", p + "wk.weight", False
        yield b + "attn_v.weight", p + "wv.weight", False
        yield b + "attn_output.weight", p + "wo.weight", False
        yield b + "attn_q_norm.weight", p + "q_norm", True
        yield b + "attn_k_norm.weight", p + "k_norm", True
        yield b + "ffn_norm.weight", p + "ffn_norm", True
        yield b + "ffn_gate_inp.weight", p + "moe.router", True
        yield b + "ffn_gate_exps.weight", p + "moe.w_gate", False
        yield b + "ffn_up_exps.weight", p + "moe.w_up", False
        yield b + "ffn_down_exps.weight", p + "moe.w_down", False


def gguf_tensors(cfg: Config, model):
    """(name, numpy array, is_f32) in the qwen3moe layout of llama.cpp's gguf tensor names."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for name, key, is_f32 in gguf_names(cfg):
        yield name, sd[key], is_f32


def load_gguf_weights(cfg: Config, model, path: Path) -> tuple[int, int]:
    """Set the model's weights from a GGUF this script exported (F32, F16 or a type gguf-py dequantizes, such as
    the committed Q8_0): a later session goes on from the committed model when the trainer's checkpoints are gone.
    Returns (step, tokens seen) of that model, read from its description ("trained on N tokens"; N / tokens per
    step). The quantized weights are the starting point as they are (Q8_0: about 0.4% relative rounding)."""
    import re

    import gguf
    import torch

    try:
        r = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad input
        raise SystemExit(f"train_moe.py: error: --init-gguf {path}: not a readable GGUF ({e})") from None

    def field(key: str):
        f = r.get_field(key)
        return None if f is None else f.contents()

    want = {"qwen3moe.block_count": cfg.n_layer, "qwen3moe.embedding_length": cfg.d_model,
            "qwen3moe.expert_count": cfg.n_expert, "qwen3moe.expert_used_count": cfg.top_k,
            "qwen3moe.expert_feed_forward_length": cfg.d_expert}
    for key, v in want.items():
        if field(key) != v:
            raise SystemExit(f"train_moe.py: error: --init-gguf {path}: {key} is {field(key)}, this shape has {v}")
    m = re.search(r"trained on (\d+) tokens", str(field("general.description") or ""))
    per_step = cfg.batch_seqs * cfg.n_ctx
    if not m or int(m.group(1)) % per_step:
        raise SystemExit(f"train_moe.py: error: --init-gguf {path}: its description does not say how many tokens "
                         f"it was trained on (a whole number of {per_step}-token steps)")
    tokens = int(m.group(1))
    tensors = {t.name: t for t in r.tensors}
    sd = model.state_dict()
    with torch.no_grad():
        for name, key, _ in gguf_names(cfg):
            if name not in tensors:
                raise SystemExit(f"train_moe.py: error: --init-gguf {path}: no tensor {name}")
            t = tensors[name]
            arr = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
            if arr.size != sd[key].numel():
                raise SystemExit(f"train_moe.py: error: --init-gguf {path}: {name} has {arr.size} values, "
                                 f"{key} {sd[key].numel()}")
            sd[key].copy_(torch.from_numpy(arr.reshape(tuple(sd[key].shape))))
    return tokens // per_step, tokens


def export(cfg: Config, model, work: Path, path: Path, tokens_seen: int, f32: bool = False,
           step: int | None = None) -> None:
    """Write the GGUF: matrices in F16 (or everything in F32 with f32=True, for the exact check). ``step``: an
    interim model from a checkpoint, said so in its description."""
    import gguf

    tok = load_tokenizer(work)
    vocab = tok.get_vocab()
    id_to_tok = {i: t for t, i in vocab.items()}
    tokens = [id_to_tok[i] for i in range(cfg.vocab_size)]
    special = {tok.token_to_id(EOT)}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
             for i in range(cfg.vocab_size)]
    tj = json.loads((work / "tokenizer.json").read_text())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    eot = tok.token_to_id(EOT)

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(cfg.name)
    interim = "" if step is None else f" (interim: checkpoint at step {step} of {cfg.steps})"
    w.add_description(f"moe-subst {cfg.name}, trained on {tokens_seen} tokens of offline Debian text{interim}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(cfg.n_ctx)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.d_expert * cfg.top_k)
    w.add_expert_feed_forward_length(cfg.d_expert)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.top_k)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for name, arr, is_f32 in gguf_tensors(cfg, model):
        w.add_tensor(name, arr.astype(np.float32 if (is_f32 or f32) else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"exported {path} ({path.stat().st_size / 1e6:.1f} MB)")


def quantize(src: Path, qtype: str) -> Path:
    """<src> (an F16 GGUF, ``-f16`` in its name) quantized to ``qtype`` with the stock build's llama-quantize, next
    to it as <name>-<qtype>.gguf."""
    import subprocess
    tool = ROOT / "vendor/llama.cpp/build-cpu/bin/llama-quantize"
    if not tool.exists():
        raise SystemExit(f"train_moe.py: error: --quantize needs the stock build ({tool}): run ./build.sh")
    dst = src.with_name(src.name.replace("-f16", f"-{qtype.lower()}"))
    if dst == src:
        raise SystemExit(f"train_moe.py: error: --quantize: {src.name} has no '-f16' in its name to replace")
    res = subprocess.run([str(tool), str(src), str(dst), qtype.upper()], capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"train_moe.py: error: llama-quantize {qtype} failed: {' '.join(tail)}")
    print(f"quantized {dst} ({dst.stat().st_size / 1e6:.1f} MB, {qtype.upper()})")
    return dst


def f16_rounded(cfg: Config, model):
    """A copy of the model whose matrices are rounded to F16 the way the GGUF stores them."""
    import copy

    import torch
    m = copy.deepcopy(model)
    f32_names = {"out_norm", "attn_norm", "q_norm", "k_norm", "ffn_norm", "moe.router"}
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not any(name.endswith(s) for s in f32_names):
                p.copy_(p.half().float())
    return m


# --- evaluation ---------------------------------------------------------------------------------

def scored_batches(model, ids: np.ndarray, chunks, n_ctx: int, batch: int = 4):
    """llama-perplexity's scoring of the given n_ctx chunks of ``ids``, ``batch`` chunks a forward pass: in each
    chunk the logits at positions n_ctx/2 .. n_ctx-2 score the next token. Yields (tokens, NLL sum, scored count,
    the model's per-layer router stats) per pass."""
    import torch
    import torch.nn.functional as F

    chunks = list(chunks)
    first = n_ctx // 2
    with torch.no_grad():
        for c in range(0, len(chunks), batch):
            x = torch.from_numpy(np.stack([ids[i * n_ctx:(i + 1) * n_ctx] for i in chunks[c:c + batch]]))
            logits, _, _, stats = model(x)
            lp = F.log_softmax(logits[:, first:n_ctx - 1].double(), -1)
            tgt = x[:, first + 1:]
            yield x, -lp.gather(-1, tgt.unsqueeze(-1)).sum().item(), tgt.numel(), stats


def perplexity_like_llama(cfg: Config, model, ids: np.ndarray, n_ctx: int, n_chunks: int | None = None):
    """llama-perplexity's number: the text is cut into n_ctx chunks; in each chunk the logits at
    positions n_ctx/2 .. n_ctx-2 score the next token; PPL = exp(mean NLL over all scored tokens).
    (No BOS: the GGUF says add_bos_token = false.) Returns (ppl, nll_sum, count, stats)."""
    n_chunk = len(ids) // n_ctx
    if n_chunks is not None:
        n_chunk = min(n_chunk, n_chunks)
    nll, count = 0.0, 0
    usage = np.zeros((cfg.n_layer, cfg.n_expert), dtype=np.int64)
    first_gate = np.zeros(cfg.n_layer)
    n_tok = 0
    for x, nll_b, count_b, stats in scored_batches(model, ids, range(n_chunk), n_ctx):
        nll += nll_b
        count += count_b
        for li, st in enumerate(stats):
            usage[li] += np.bincount(st["top_i"].reshape(-1).numpy(), minlength=cfg.n_expert)
            first_gate[li] += st["gate"][:, 0].sum().item()
        n_tok += x.numel()
    return math.exp(nll / count), nll, count, {"usage": usage, "first_gate_sum": first_gate,
                                              "tokens": n_tok}


def routing_report(cfg: Config, st) -> list[dict]:
    rows = []
    for li in range(cfg.n_layer):
        u = st["usage"][li].astype(np.float64)
        p = u / u.sum()
        uniform = 1.0 / cfg.n_expert
        ent = -(p[p > 0] * np.log(p[p > 0])).sum()
        rows.append({
            "layer": li,
            "usage_entropy_nats": round(float(ent), 4),
            "usage_entropy_norm": round(float(ent / math.log(cfg.n_expert)), 4),
            "share_below_10pct_uniform": round(float((p < 0.1 * uniform).mean()), 4),
            "share_dead_below_1pct_uniform": round(float((p < 0.01 * uniform).mean()), 4),
            "max_load_over_uniform": round(float(p.max() / uniform), 3),
            "mean_first_choice_gate": round(float(st["first_gate_sum"][li] / st["tokens"]), 4),
        })
    return rows


def evaluate(cfg: Config, model, work: Path, out: Path, ck) -> dict:
    import torch
    torch.set_num_threads(cfg.threads)
    ids = heldout_tokens(work)
    m16 = f16_rounded(cfg, model)
    ppl, nll, count, st = perplexity_like_llama(cfg, m16, ids, cfg.n_ctx)
    ppl_prefix, _, count_prefix, _ = perplexity_like_llama(cfg, m16, ids, cfg.n_ctx, n_chunks=16)
    # unigram model of the same tokenizer, fitted on the training stream (add-one smoothing),
    # scored on exactly the tokens llama-perplexity scores
    stream = np.load(work / "train_tokens.npy")
    freq = np.bincount(stream, minlength=cfg.vocab_size).astype(np.float64) + 1.0
    logp = np.log(freq / freq.sum())
    first = cfg.n_ctx // 2
    n_chunk = len(ids) // cfg.n_ctx
    scored = np.concatenate([ids[i * cfg.n_ctx + first + 1:(i + 1) * cfg.n_ctx] for i in range(n_chunk)])
    uni_ppl = math.exp(-logp[scored].mean())
    res = {
        "heldout_tokens": int(len(ids)),
        "n_ctx": cfg.n_ctx,
        "n_chunks": int(n_chunk),
        "scored_tokens": int(count),
        "ppl_pytorch_f16_weights": ppl,
        "ppl_pytorch_f16_weights_first16chunks": ppl_prefix,
        "scored_tokens_first16chunks": int(count_prefix),
        "unigram_ppl": uni_ppl,
        "routing": routing_report(cfg, st),
        "tokens_seen": ck["tokens_seen"],
        "train_seconds": ck["train_seconds"],
        "n_params": int(sum(p.numel() for p in model.parameters())),
    }
    out.with_suffix(".eval.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return res


def default_work(shape: str) -> Path:
    """Where a shape's corpus, tokenizer, token stream and checkpoints live: tinymoe's in build/ (45 minutes of
    training); studymoe's in the user's cache folder, so that a run of many hours survives a fresh checkout."""
    if shape == "tinymoe":
        return ROOT / "build" / shape
    cache = os.environ.get("MOE_SUBST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moe-subst")
    return Path(cache) / shape


def config_from_args(args: argparse.Namespace, error) -> Config:
    """The run's Config: the shape's, with each option the user gave over it (an option left out keeps the
    shape's value)."""
    cfg = Config(**SHAPES[args.shape])
    if args.threads is not None:
        cfg.threads = args.threads
    if args.lr is not None:
        cfg.lr = args.lr
    if args.warmup is not None:
        cfg.warmup = args.warmup
    if args.ditto is not None:
        if not 0 <= args.ditto < 1:
            error("--ditto: a share in [0, 1)")
        cfg.ditto_frac = args.ditto
    if args.capacity_factor is not None:
        cfg.capacity_factor = args.capacity_factor
    if args.aux_coef is not None:
        cfg.aux_loss_coef = args.aux_coef
    if args.aux_scope is not None:  # not unconditionally: that overrode the localmoe shape's "global" with "batch"
        cfg.aux_scope = args.aux_scope
    if args.aux_ema is not None:
        if not 0 < args.aux_ema < 1:
            error("--aux-ema: a decay in (0, 1)")
        cfg.aux_ema = args.aux_ema
    if args.locality_coef is not None:
        cfg.locality_coef = args.locality_coef
    if args.locality_window is not None:
        if args.locality_window < 1 or cfg.n_ctx % args.locality_window:
            error(f"--locality-window: a divisor of the context ({cfg.n_ctx})")
        cfg.locality_window = args.locality_window
    if args.precision != "auto":
        cfg.precision = args.precision
    elif args.stage in ("train", "all"):
        import torch
        cfg.precision = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    if args.steps is not None:
        cfg.steps = args.steps
    if args.decay_start is not None:
        cfg.decay_start = args.decay_start
    if (args.stable_steps is None) != (args.decay_steps is None):
        error("--stable-steps and --decay-steps go together")
    if args.stable_steps is not None:
        cfg.decay_start = args.stable_steps
        cfg.steps = args.stable_steps + args.decay_steps
    return cfg


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", default="all", choices=["tokenizer", "train", "export", "eval", "all"])
    ap.add_argument("--shape", default="tinymoe", choices=sorted(SHAPES))
    ap.add_argument("--work", default=None, help="default build/tinymoe, or for studymoe the cache folder "
                    "$MOE_SUBST_CACHE/studymoe (~/.cache/moe-subst/studymoe), which outlives a fresh checkout")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2; rounding only differs)")
    ap.add_argument("--out", default=None, help="default models/<shape>-f16.gguf")
    ap.add_argument("--steps", type=int, default=None, help="total training steps (Config.steps)")
    ap.add_argument("--decay-start", type=int, default=None, help="step where the lr decay starts")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds of training; picks decay_start/steps from the clock (see Config)")
    ap.add_argument("--stable-steps", type=int, default=None,
                    help="constant-lr steps (after warmup) before the decay; with --decay-steps")
    ap.add_argument("--decay-steps", type=int, default=None, help="steps of the linear decay after --stable-steps")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="seconds: stop at a step boundary with a checkpoint (go on later with --resume)")
    ap.add_argument("--stop-after-steps", type=int, default=None, help="stop (with a checkpoint) after this many steps")
    ap.add_argument("--resume", action="store_true", help="go on from <work>/ckpt.pt")
    ap.add_argument("--tokenizer", default=None, metavar="JSON",
                    help="tokenizer stage: encode the corpus with this tokenizer.json instead of training one (to go "
                         "on from a committed model: models/<shape>-tokenizer.json)")
    ap.add_argument("--init-gguf", default=None, metavar="GGUF",
                    help="train stage: start from this exported model (e.g. models/studymoe-q8_0.gguf) at its step, "
                         "with a fresh optimiser; with --resume, only when <work> has no checkpoint yet")
    ap.add_argument("--init-log", default=None, metavar="JSONL",
                    help="with --init-gguf: the model's trainlog (e.g. models/studymoe-trainlog.jsonl), kept at the "
                         "head of this run's log")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the shape's)")
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: the shape's)")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                    help="auto: bf16 autocast where the CPU has native bf16 (AVX-512 BF16/AMX), else fp32")
    ap.add_argument("--ditto", type=float, default=None, metavar="FRAC",
                    help="share of each batch that is DITTO pseudo-repetitions (Config.ditto_frac; default 0)")
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="training capacity per expert in fair shares of a batch (0: none dropped)")
    ap.add_argument("--aux-coef", type=float, default=None, help="load-balancing loss coefficient (default 0.01)")
    ap.add_argument("--aux-scope", default=None, choices=["batch", "global"],
                    help="balance each micro-batch, or the load averaged over steps (default: the shape's; batch)")
    ap.add_argument("--aux-ema", type=float, default=None, help="decay of the averaged load for --aux-scope global")
    ap.add_argument("--locality-coef", type=float, default=None,
                    help="weight of the per-window router entropy (routing locality; default 0: off)")
    ap.add_argument("--locality-window", type=int, default=None, help="tokens per window of --locality-coef")
    ap.add_argument("--checkpoint-every", type=float, default=600.0, help="seconds between checkpoints")
    ap.add_argument("--from-checkpoint", action="store_true",
                    help="export/eval the newest checkpoint (<work>/ckpt.pt) of a run in progress: an interim model")
    ap.add_argument("--quantize", default=None, metavar="TYPE",
                    help="after the export, also write <out> quantized to TYPE (e.g. q8_0) with the stock build's "
                         "llama-quantize (the pin's own converter path)")
    return ap


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    work = Path(args.work) if args.work else default_work(args.shape)
    out = Path(args.out) if args.out else ROOT / "models" / f"{args.shape}-f16.gguf"
    cfg = config_from_args(args, ap.error)
    ckpt = work / out.name
    if args.stage in ("tokenizer", "all"):
        train_tokenizer(cfg, work, Path(args.tokenizer) if args.tokenizer else None)
    if args.stage in ("train", "all"):
        done = train(cfg, work, ckpt, args.time_budget, resume=args.resume, stop_after=args.stop_after,
                     stop_after_steps=args.stop_after_steps, ckpt_every=args.checkpoint_every,
                     init_gguf=Path(args.init_gguf) if args.init_gguf else None,
                     init_log=Path(args.init_log) if args.init_log else None)
        (work / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
        if not done:
            return 0
    interim = work / "ckpt.pt" if args.from_checkpoint else None
    if interim is not None and not interim.exists():
        ap.error(f"--from-checkpoint: no checkpoint at {interim}")
    if args.stage in ("export", "all"):
        cfg, model, ck = load_trained(ckpt, interim)
        out.parent.mkdir(parents=True, exist_ok=True)
        export(cfg, model, work, out, ck["tokens_seen"], step=ck.get("step") if interim else None)
        # an all-F32 copy (not committed) for the exact export check of scripts/check_export.py
        export(cfg, model, work, work / out.name.replace("-f16", "-f32"), ck["tokens_seen"], f32=True,
               step=ck.get("step") if interim else None)
        if args.quantize:
            quantize(out, args.quantize)
    if args.stage in ("eval", "all"):
        cfg, model, ck = load_trained(ckpt, interim)
        evaluate(cfg, model, work, out if interim else ckpt, ck)
    return 0


if __name__ == "__main__":
    sys.exit(main())
