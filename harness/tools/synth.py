"""Small random-weight GGUF models for tests, deterministic by seed (DESIGN.md section 5 (a)).

`write_synth_model(spec, path)` writes a Mixture-of-Experts model that stock llama.cpp loads and runs:

- ``qwen3moe``: softmax router over all experts, top-k, normalised weights, q/k RMS norm.
- ``qwen2moe``: softmax router, top-k, weights not normalised, q/k/v biases, one shared expert whose
  output is scaled by a sigmoid gate (``ffn_gate_inp_shexp``).
- ``hy_v3``: routed experts stored as one merged ``ffn_gate_up_exps`` tensor per layer (gate rows
  first, then up rows), a sigmoid router with an expert-selection bias (``exp_probs_b``), normalised
  weights, q/k RMS norm and one ungated shared expert. It is the simplest plain-attention architecture
  whose llama.cpp loader accepts the merged tensor (qwen3moe/qwen2moe load only separate gate/up).
- ``mixtral``: the Mixtral layout, GGUF architecture ``llama`` with experts: softmax router, top-k,
  normalised weights, no shared expert, no q/k norm; its loader takes the expert FFN size from
  ``llama.feed_forward_length``.
- ``gpt-oss`` (GGUF ``gpt-oss``, llama.cpp's openai-moe): per-expert biases (``ffn_{gate,up,down}_exps.bias``)
  and a router bias, gating after top-k (softmax over the k selected logits), attention sinks, q/k/v and
  output biases, sliding-window attention on every other layer, the swiglu-oai expert activation.
- ``deepseek2``: multi-head latent attention (q and kv low-rank projections, split ``attn_k_b``/``attn_v_b``),
  a sigmoid router with an expert-selection bias (``exp_probs_b.bias``), normalised weights scaled by
  ``expert_weights_scale`` (2.5), grouped top-k (4 groups, the best 2 used, when n_expert allows it) and one
  ungated shared expert of the routed experts' size.
- ``qwen3next`` (the study's architecture, Qwen3-Next): hybrid attention, every other layer a linear-attention
  (gated delta net) layer (``attn_qkv``, ``attn_gate``, ``ssm_*``) and the others gated full attention (a
  query projection of twice the size, q/k RMS norm); softmax router, normalised top-k, and a shared expert
  whose output is scaled by its own sigmoid gate (``ffn_gate_inp_shexp``). ``SynthSpec(fused_gate_up=True)``
  writes its routed experts' gate and up as one ``ffn_gate_up_exps`` tensor (gate rows first), as the pinned
  converter's ``--fuse-gate-up-exps`` does; its loader takes either.
- ``glm4moe`` (GLM-4.5): a sigmoid router with an expert-selection bias (``exp_probs_b.bias``), normalised weights
  scaled by ``expert_weights_scale`` (2.5, GLM-4.5's routed scaling), one ungated shared expert of the routed
  experts' size, q/k/v biases and q/k RMS norm, half-size (partial) NeoX rotary embeddings, ``post_attention_norm``
  as the FFN input norm; ``SynthSpec(n_dense_lead=N)``: GLM's leading dense layers (``leading_dense_block_count``;
  GLM-4.5-Air has 1, GLM-4.5 3); ``SynthSpec(n_nextn=N)``: N NextN/MTP layers after the ``n_layer`` trunk layers
  (``nextn_predict_layers``; ``block_count`` counts them, as the pinned converter writes it). llama.cpp loads the
  MTP layers only for MTP speculative decoding (``load_mtp``) and never runs them in the main graph.
- ``grovemoe``: qwen3moe-like, plus a second, smaller set of "chunk" experts per layer (``ffn_*_chexps``, one
  per pair of experts) that ``build_moe_ffn`` routes separately with the same router. The expert cache refuses
  it (two expert sets per layer); it is here for that refusal's test.

`write_dense_model(path, seed)` writes a tiny dense ``qwen3`` model, for the "not an MoE model" paths.

Every model carries the same byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``, pre-tokenizer
``gpt-2``): token ids 0-255 are the 256 bytes, then merges learned from a built-in English text (and,
for vocabularies larger than that text supports, deterministic letter-extension merges), then the
control tokens ``<|endoftext|>`` (bos), ``<|im_start|>`` and ``<|im_end|>`` (eos/eot) at the end, and a
ChatML chat template. So any text tokenizes, and ``n_vocab`` must be at least 259.

Weights: N(0, 1/fan_in) matrices, unit norms, router rows scaled so that router logits have a spread of
about 2 (different tokens pick different experts). The router (``ffn_gate_inp``), norms and biases stay
F32 whatever ``dtype`` says; every other matrix is written in ``dtype``. Quantized types need the
matrix rows (``n_embd``, ``n_ff_exp``, ``n_ff_shexp``) to be multiples of the type's block size (32 for
Q8_0/Q4_0). Q4_K is listed but the gguf package (0.19.0) cannot quantize to it (it only dequantizes
K-quants), so asking for it raises a HarnessError saying so; harness.tools.quantize (``harness synth
--quantize Q4_K_M``) writes f16 and runs the build's llama-quantize instead.

The same seed gives a byte-identical file (for a given numpy and gguf version): every tensor draws from
its own generator seeded by (seed, tensor name).
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError

ARCHS: tuple[str, ...] = ("qwen3moe", "qwen2moe", "hy_v3", "mixtral", "gpt-oss", "deepseek2", "qwen3next",
                          "glm4moe", "grovemoe")
# Archs the expert cache refuses (with a one-line error naming the arch); the others it serves.
CACHE_REFUSED: tuple[str, ...] = ("grovemoe",)
# The GGUF architecture each writes, where it differs from the name.
GGUF_ARCH: dict[str, str] = {"mixtral": "llama"}
DTYPES: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_0", "q4_k")
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
TOKENIZER_PRE = "gpt-2"
RMS_EPS = 1e-6
ROPE_FREQ_BASE = 10000.0
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Archs with one shared expert, and whether its output goes through a sigmoid gate.
_SHARED_EXPERT = {"qwen2moe": True, "hy_v3": False, "deepseek2": False, "qwen3next": True, "glm4moe": False}
_MERGED_GATE_UP = frozenset({"hy_v3"})
# Archs whose pinned loader and gguf-py tensor list take a merged ffn_gate_up_exps as well as separate gate/up
# (deepseek2's loader takes it too, but gguf-py's DEEPSEEK2 tensor list has no FFN_GATE_UP_EXP: no converter
# writes it).
_FUSABLE_GATE_UP = frozenset({"qwen3next"})
_ROUTER_LOGIT_STD = 2.0
GPT_OSS_SLIDING_WINDOW = 16
QWEN3NEXT_FULL_ATTENTION_INTERVAL = 2  # layers 1, 3, ... full attention; 0, 2, ... linear attention
QWEN3NEXT_CONV_KERNEL = 4
GROVEMOE_EXPERTS_PER_GROUP = 2
DEEPSEEK2_WEIGHTS_SCALE = 2.5
GLM4MOE_WEIGHTS_SCALE = 2.5  # GLM-4.5's routed_scaling_factor (GLM-4.5-Air: 1.0)
# expert_weights_scale: what the graph multiplies the (normalised) gate weights by after the route step's weights
WEIGHTS_SCALE: dict[str, float] = {"deepseek2": DEEPSEEK2_WEIGHTS_SCALE, "glm4moe": GLM4MOE_WEIGHTS_SCALE}
# Archs whose loader takes leading dense layers, and the one with NextN/MTP layers.
_DENSE_LEAD = frozenset({"deepseek2", "glm4moe"})
_NEXTN = frozenset({"glm4moe"})


@dataclass(frozen=True)
class SynthSpec:
    """What to generate. Head size is n_embd // n_head; n_vocab counts the 3 control tokens."""

    arch: str = "qwen3moe"
    n_layer: int = 2
    n_expert: int = 16
    n_expert_used: int = 4
    n_embd: int = 64
    n_ff_exp: int = 32
    n_ff_shexp: int = 64  # qwen2moe and hy_v3 (the archs with a shared expert)
    n_head: int = 4
    n_head_kv: int = 2
    n_ctx: int = 512
    n_vocab: int = 512
    dtype: str = "f32"
    seed: int = 0
    n_dense_lead: int = 0  # deepseek2, glm4moe: leading layers with a dense FFN instead of experts (first_k_dense)
    n_nextn: int = 0  # glm4moe: NextN/MTP layers after the n_layer trunk layers (nextn_predict_layers)
    fused_gate_up: bool = False  # qwen3next: one merged ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def has_shared_expert(self) -> bool:
        return self.arch in _SHARED_EXPERT

    @property
    def merged_gate_up(self) -> bool:
        return self.arch in _MERGED_GATE_UP or self.fused_gate_up

    @property
    def gguf_arch(self) -> str:
        return GGUF_ARCH.get(self.arch, self.arch)

    @property
    def shared_ff(self) -> int:
        """The shared expert's FFN size (deepseek2's and glm4moe's loaders take the routed experts' size times the
        count)."""
        return self.n_ff_exp if self.arch in ("deepseek2", "glm4moe") else self.n_ff_shexp

    @property
    def n_block(self) -> int:
        """Layers in the file (block_count): the trunk and the NextN/MTP layers."""
        return self.n_layer + self.n_nextn

    @property
    def weights_scale(self) -> float:
        return WEIGHTS_SCALE.get(self.arch, 1.0)

    @property
    def expert_groups(self) -> tuple[int, int]:
        """(groups, groups used) of grouped top-k: deepseek2 uses 4 groups, the best 2, when every group holds
        at least 2 experts and the 2 groups hold k; (1, 1) otherwise (no grouping)."""
        if self.arch == "deepseek2" and self.n_expert % 4 == 0 and self.n_expert >= 8 and \
                self.n_expert_used <= self.n_expert // 2:
            return 4, 2
        return 1, 1


# --------------------------------------------------------------------------------------------------
# dtypes


@dataclass(frozen=True)
class _DType:
    name: str
    ggml: int  # gguf.GGMLQuantizationType value
    file_type: int  # gguf.LlamaFileType value
    block: int  # elements per block (1 for float types)


def _dtype(name: str) -> _DType:
    import gguf

    q = gguf.GGMLQuantizationType
    ft = gguf.LlamaFileType
    table = {
        "f32": (q.F32, ft.ALL_F32),
        "f16": (q.F16, ft.MOSTLY_F16),
        "q8_0": (q.Q8_0, ft.MOSTLY_Q8_0),
        "q4_0": (q.Q4_0, ft.MOSTLY_Q4_0),
        "q4_k": (q.Q4_K, ft.MOSTLY_Q4_K_M),
    }
    qtype, ftype = table[name]
    return _DType(name, int(qtype), int(ftype), gguf.GGML_QUANT_SIZES[qtype][0])


def _can_quantize(dtype: _DType) -> bool:
    if dtype.block == 1:
        return True
    import gguf

    try:
        gguf.quants.quantize(np.zeros((1, dtype.block), dtype=np.float32), gguf.GGMLQuantizationType(dtype.ggml))
    except NotImplementedError:
        return False
    return True


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------------------------------
# validation


def check_spec(spec: SynthSpec) -> None:
    """Raise a HarnessError with a one-line message when `spec` cannot be generated or run."""

    def bad(msg: str) -> HarnessError:
        return HarnessError(f"synth: {msg}")

    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.name in ("arch", "dtype"):
            continue
        if f.name == "fused_gate_up":
            if not isinstance(value, bool):
                raise bad(f"fused_gate_up must be True or False, got {value!r}")
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad(f"{f.name} must be an integer, got {value!r}")
    if spec.arch not in ARCHS:
        raise bad(f"unknown arch {spec.arch!r}; choose one of {', '.join(ARCHS)}")
    if spec.dtype not in DTYPES:
        raise bad(f"unknown dtype {spec.dtype!r}; choose one of {', '.join(DTYPES)}")
    if spec.seed < 0:
        raise bad(f"seed must be >= 0, got {spec.seed}")
    if spec.n_layer < 1:
        raise bad(f"n_layer must be >= 1, got {spec.n_layer}")
    if spec.n_expert < 2:
        raise bad(f"n_expert must be >= 2 for a Mixture-of-Experts model, got {spec.n_expert}")
    if not 1 <= spec.n_expert_used <= spec.n_expert:
        raise bad(f"n_expert_used must be between 1 and n_expert={spec.n_expert}, got {spec.n_expert_used}")
    if spec.n_head < 1 or spec.n_head_kv < 1:
        raise bad(f"n_head and n_head_kv must be >= 1, got {spec.n_head} and {spec.n_head_kv}")
    if spec.n_head % spec.n_head_kv:
        raise bad(f"n_head={spec.n_head} must be a multiple of n_head_kv={spec.n_head_kv}")
    if spec.n_embd % spec.n_head or spec.head_dim % 2:
        raise bad(f"n_embd={spec.n_embd} must be n_head={spec.n_head} times an even head size")
    if spec.arch == "grovemoe" and spec.n_expert % GROVEMOE_EXPERTS_PER_GROUP:
        raise bad(f"grovemoe groups experts in pairs: n_expert={spec.n_expert} must be even")
    if spec.n_dense_lead and spec.arch not in _DENSE_LEAD:
        raise bad(f"n_dense_lead is a setting of {', '.join(sorted(_DENSE_LEAD))}, not {spec.arch}'s")
    if spec.n_nextn and spec.arch not in _NEXTN:
        raise bad(f"n_nextn (MTP layers) is a setting of {', '.join(sorted(_NEXTN))}, not {spec.arch}'s")
    if spec.fused_gate_up and spec.arch not in _FUSABLE_GATE_UP:
        raise bad(f"fused_gate_up: {spec.arch}'s loader (or gguf-py's tensor list) takes no merged ffn_gate_up_exps; "
                  f"one of {', '.join(sorted(_FUSABLE_GATE_UP))} does (hy_v3 always has it)")
    if not 0 <= spec.n_nextn <= 1:
        raise bad(f"n_nextn must be 0 or 1 (the pin's glm4moe runs one MTP layer), got {spec.n_nextn}")
    if not 0 <= spec.n_dense_lead < spec.n_layer:
        raise bad(f"n_dense_lead must be between 0 and n_layer-1={spec.n_layer - 1}, got {spec.n_dense_lead}")
    if spec.n_ff_exp < 1:
        raise bad(f"n_ff_exp must be >= 1, got {spec.n_ff_exp}")
    if spec.has_shared_expert and spec.shared_ff < 1:
        raise bad(f"n_ff_shexp must be >= 1 for {spec.arch}, got {spec.n_ff_shexp}")
    if spec.n_ctx < 8:
        raise bad(f"n_ctx must be >= 8, got {spec.n_ctx}")
    if spec.n_vocab < MIN_VOCAB:
        raise bad(f"n_vocab must be >= {MIN_VOCAB} (256 byte tokens and {len(SPECIAL_TOKENS)} control tokens), "
                  f"got {spec.n_vocab}")
    dt = _dtype(spec.dtype)
    if not _can_quantize(dt):
        raise bad(f"dtype {spec.dtype} cannot be written: the gguf package {_gguf_version()} has no quantizer "
                  f"for {spec.dtype.upper()} (only a dequantizer); use harness synth --quantize (llama-quantize), "
                  f"or use one of {', '.join(d for d in DTYPES if _can_quantize(_dtype(d)))}")
    if dt.block > 1:
        rows = {"n_embd": spec.n_embd, "n_ff_exp": spec.n_ff_exp}
        if spec.has_shared_expert and spec.shared_ff != spec.n_ff_exp:
            rows["n_ff_shexp"] = spec.n_ff_shexp
        for name, n in rows.items():
            if n % dt.block:
                raise bad(f"{spec.dtype} stores rows in blocks of {dt.block}: {name}={n} is not a multiple "
                          f"of {dt.block}")


# --------------------------------------------------------------------------------------------------
# tokenizer

# Built-in text the merges are learned from (written for this project; any English prose would do).
_CORPUS = """\
A mixture of experts model replaces the feed forward block of a transformer with many smaller blocks,
the experts, and a router that picks a few of them for every token. Only the chosen experts run, so a
model with a great many parameters costs little to compute for each token. The catch is memory: all of
the experts must be somewhere the computer can reach them quickly, and the largest models do not fit in
the memory of one graphics card. An expert cache keeps the experts that are used most often on the
device and leaves the others in the main memory of the host, where they are slower to reach but still
there when the router asks for them. When the router asks for an expert that is not in the cache, the
cache can wait and copy it in, or it can substitute an expert that is already present and close enough
in what it would have computed. The router itself gives a hint: the weights it assigns to the experts it
chose say how much each one matters for this token, and a small weight means a cheap mistake.
The tests in this project use small models whose weights are random numbers. They say nothing about
language, but they have the same shape as the real ones, they load in the same program, and they route
tokens to experts in the same way. That is enough to check that the cache keeps the right experts, that
it never returns the wrong one, and that the numbers it prints are the numbers it measured.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512 and 1024 appear often in
such work, and so do words like layer, tensor, weight, token, batch, context, memory, bandwidth, time,
speed, quality, perplexity, and the question of what happens when there is not enough room for it all.
"""

_PRETOKENIZE = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest map to 256+n."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class Tokenizer:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]  # gguf.TokenType: 1 normal, 3 control
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int


def _learn_merges(n_merges: int) -> list[tuple[str, str]]:
    """Greedy byte-level BPE on the built-in text; ties go to the smallest pair, so it is deterministic."""
    b2u = _byte_to_unicode()
    words: Counter[tuple[str, ...]] = Counter()
    for piece in _PRETOKENIZE.findall(_CORPUS):
        words[tuple(b2u[b] for b in piece.encode("utf-8"))] += 1
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[(a, b)] += count
        if not pairs:
            break
        best_count = max(pairs.values())
        best = min(p for p, c in pairs.items() if c == best_count)
        merges.append(best)
        joined = best[0] + best[1]
        new_words: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return merges


def build_tokenizer(n_vocab: int) -> Tokenizer:
    """The byte-level BPE vocabulary of exactly `n_vocab` tokens that every synthetic model carries."""
    if n_vocab < MIN_VOCAB:
        raise HarnessError(f"synth: n_vocab must be >= {MIN_VOCAB}, got {n_vocab}")
    b2u = _byte_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    known = set(tokens)
    n_merges = n_vocab - MIN_VOCAB
    merges = _learn_merges(n_merges)
    for a, b in merges:
        tokens.append(a + b)
        known.add(a + b)
    # Past what the text supports: extend word-like tokens by one lowercase letter, in token order.
    space = b2u[ord(" ")]
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(merges) < n_merges:
        stem = tokens[i]
        i += 1
        body = stem[1:] if stem.startswith(space) else stem
        if not (stem == space or body.isascii() and body.isalpha()):
            continue
        for c in letters:
            if len(merges) == n_merges:
                break
            if stem + c not in known:
                merges.append((stem, c))
                tokens.append(stem + c)
                known.add(stem + c)
    n_normal = len(tokens)
    tokens.extend(SPECIAL_TOKENS)
    assert len(tokens) == n_vocab
    return Tokenizer(
        tokens=tuple(tokens),
        token_types=tuple([1] * n_normal + [3] * len(SPECIAL_TOKENS)),
        merges=tuple(f"{a} {b}" for a, b in merges),
        bos_id=n_normal + SPECIAL_TOKENS.index("<|endoftext|>"),
        eos_id=n_normal + SPECIAL_TOKENS.index("<|im_end|>"),
    )


def synth_text(n_chars: int, seed: int = 0) -> str:
    """Deterministic English-looking text of exactly `n_chars` characters, for perplexity runs."""
    words = re.findall(r"[A-Za-z0-9]+[,.:]?", _CORPUS)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x7E57]))
    parts: list[str] = []
    size = 0
    while size < n_chars:
        n = int(rng.integers(6, 18))
        sentence = " ".join(words[int(j)] for j in rng.integers(0, len(words), n)).rstrip(",.:")
        line = sentence[:1].upper() + sentence[1:] + ".\n"
        parts.append(line)
        size += len(line)
    return "".join(parts)[:n_chars]


# --------------------------------------------------------------------------------------------------
# tensors


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: the last axis is the row (ne0)
    std: float  # normal(0, std); 0 means constant `fill`
    quantize: bool  # written in the spec's dtype (else F32)
    fill: float = 0.0


def _matrix(name: str, *shape: int, quantize: bool = True, scale: float = 1.0) -> _Tensor:
    return _Tensor(name, tuple(shape), scale / float(np.sqrt(shape[-1])), quantize)


def _vector(name: str, n: int, *, fill: float = 0.0, std: float = 0.0) -> _Tensor:
    return _Tensor(name, (n,), std, False, fill)


def _biases(name: str, *shape: int, std: float = 0.02) -> _Tensor:
    """An F32 bias tensor (a vector, or one vector per expert)."""
    return _Tensor(name, tuple(shape), std, False)


def _deepseek2_dims(spec: SynthSpec) -> dict[str, int]:
    """Multi-head latent attention sizes, from the head size: q/kv ranks n_embd/2, rope part one head size,
    the rest two."""
    hd = spec.head_dim
    return {"q_lora": spec.n_embd // 2, "kv_lora": spec.n_embd // 2, "rope": hd, "nope": 2 * hd, "v": 2 * hd}


def _qwen3next_dims(spec: SynthSpec) -> dict[str, int]:
    """Gated delta net sizes: head size = the attention head size, n_head_kv key heads, n_head value heads."""
    hd = spec.head_dim
    return {"state": hd, "k_heads": spec.n_head_kv, "v_heads": spec.n_head, "key": hd * spec.n_head_kv,
            "value": hd * spec.n_head}


def _plan_attention(spec: SynthSpec, b: str, il: int) -> list[_Tensor]:
    e, hd, q_dim, kv_dim = spec.n_embd, spec.head_dim, spec.n_embd, spec.head_dim * spec.n_head_kv
    if spec.arch == "qwen3next":
        plan = [_vector(b + "attn_norm.weight", e, fill=1.0), _vector(b + "post_attention_norm.weight", e, fill=1.0)]
        if (il + 1) % QWEN3NEXT_FULL_ATTENTION_INTERVAL == 0:  # gated full attention: query and gate
            return plan + [_matrix(b + "attn_q.weight", 2 * q_dim, e), _matrix(b + "attn_k.weight", kv_dim, e),
                           _matrix(b + "attn_v.weight", kv_dim, e), _matrix(b + "attn_output.weight", e, q_dim),
                           _vector(b + "attn_q_norm.weight", hd, fill=1.0),
                           _vector(b + "attn_k_norm.weight", hd, fill=1.0)]
        d = _qwen3next_dims(spec)
        conv_dim = 2 * d["key"] + d["value"]
        return plan + [_matrix(b + "attn_qkv.weight", conv_dim, e), _matrix(b + "attn_gate.weight", d["value"], e),
                       _matrix(b + "ssm_conv1d.weight", conv_dim, QWEN3NEXT_CONV_KERNEL, quantize=False),
                       _vector(b + "ssm_dt.bias", d["v_heads"], std=0.1),
                       _Tensor(b + "ssm_a", (d["v_heads"],), 0.1, False, -0.5),  # A = -exp(A_log): negative
                       _matrix(b + "ssm_ba.weight", 2 * d["v_heads"], e),
                       _vector(b + "ssm_norm.weight", d["state"], fill=1.0),
                       _matrix(b + "ssm_out.weight", e, d["value"])]
    if spec.arch == "deepseek2":
        d = _deepseek2_dims(spec)
        block = _dtype(spec.dtype).block
        k_mla = d["nope"] + d["rope"]

        def mla(name: str, *shape: int) -> _Tensor:  # low-rank pieces stay F32 where rows do not fill blocks
            return _matrix(name, *shape, quantize=shape[-1] % block == 0)

        return [_vector(b + "attn_norm.weight", e, fill=1.0),
                _vector(b + "attn_q_a_norm.weight", d["q_lora"], fill=1.0),
                _vector(b + "attn_kv_a_norm.weight", d["kv_lora"], fill=1.0),
                mla(b + "attn_q_a.weight", d["q_lora"], e),
                mla(b + "attn_q_b.weight", spec.n_head * k_mla, d["q_lora"]),
                mla(b + "attn_kv_a_mqa.weight", d["kv_lora"] + d["rope"], e),
                mla(b + "attn_k_b.weight", spec.n_head, d["kv_lora"], d["nope"]),
                mla(b + "attn_v_b.weight", spec.n_head, d["v"], d["kv_lora"]),
                mla(b + "attn_output.weight", e, spec.n_head * d["v"])]
    plan = [_vector(b + "attn_norm.weight", e, fill=1.0),
            _matrix(b + "attn_q.weight", q_dim, e), _matrix(b + "attn_k.weight", kv_dim, e),
            _matrix(b + "attn_v.weight", kv_dim, e), _matrix(b + "attn_output.weight", e, q_dim)]
    if spec.arch in ("qwen2moe", "gpt-oss", "glm4moe"):
        plan += [_vector(b + "attn_q.bias", q_dim, std=0.02), _vector(b + "attn_k.bias", kv_dim, std=0.02),
                 _vector(b + "attn_v.bias", kv_dim, std=0.02)]
    if spec.arch == "gpt-oss":
        plan += [_vector(b + "attn_output.bias", e, std=0.02), _vector(b + "attn_sinks.weight", spec.n_head, std=0.5),
                 _vector(b + "post_attention_norm.weight", e, fill=1.0)]
    elif spec.arch in ("qwen3moe", "hy_v3", "grovemoe", "glm4moe"):
        plan += [_vector(b + "attn_q_norm.weight", hd, fill=1.0), _vector(b + "attn_k_norm.weight", hd, fill=1.0)]
    if spec.arch == "glm4moe":  # the FFN input norm
        plan.append(_vector(b + "post_attention_norm.weight", e, fill=1.0))
    return plan


def _plan_moe(spec: SynthSpec) -> list[_Tensor]:
    e, f, n_exp = spec.n_embd, spec.n_ff_exp, spec.n_expert
    plan = [_matrix("token_embd.weight", spec.n_vocab, e), _vector("output_norm.weight", e, fill=1.0),
            _matrix("output.weight", spec.n_vocab, e)]
    for i in range(spec.n_block):
        b = f"blk.{i}."
        plan += _plan_attention(spec, b, i)
        if spec.arch not in ("gpt-oss", "qwen3next", "glm4moe"):  # these take post_attention_norm as the FFN norm
            plan.append(_vector(b + "ffn_norm.weight", e, fill=1.0))
        if i >= spec.n_layer:  # an MTP layer (glm4moe): its own input projection and norms, then a MoE layer
            plan += [_matrix(b + "nextn.eh_proj.weight", e, 2 * e), _vector(b + "nextn.enorm.weight", e, fill=1.0),
                     _vector(b + "nextn.hnorm.weight", e, fill=1.0),
                     _vector(b + "nextn.shared_head_norm.weight", e, fill=1.0)]
        if i < spec.n_dense_lead:  # leading dense layers: feed_forward_length = n_ff_exp * k
            n_ff = f * spec.n_expert_used
            plan += [_matrix(b + "ffn_gate.weight", n_ff, e), _matrix(b + "ffn_up.weight", n_ff, e),
                     _matrix(b + "ffn_down.weight", e, n_ff)]
            continue
        plan.append(_matrix(b + "ffn_gate_inp.weight", n_exp, e, quantize=False, scale=_ROUTER_LOGIT_STD))
        if spec.arch == "gpt-oss":
            plan.append(_vector(b + "ffn_gate_inp.bias", n_exp, std=0.1))
        elif spec.arch in ("deepseek2", "glm4moe"):
            plan.append(_vector(b + "exp_probs_b.bias", n_exp, std=0.1))
        if spec.arch == "hy_v3":
            plan.append(_vector(b + "exp_probs_b", n_exp, std=0.1))
        if spec.merged_gate_up:
            plan.append(_matrix(b + "ffn_gate_up_exps.weight", n_exp, 2 * f, e))
        else:
            plan += [_matrix(b + "ffn_gate_exps.weight", n_exp, f, e), _matrix(b + "ffn_up_exps.weight", n_exp, f, e)]
        plan.append(_matrix(b + "ffn_down_exps.weight", n_exp, e, f))
        if spec.arch == "grovemoe":
            n_chunk = n_exp // GROVEMOE_EXPERTS_PER_GROUP
            plan += [_matrix(b + "ffn_gate_chexps.weight", n_chunk, f, e),
                     _matrix(b + "ffn_up_chexps.weight", n_chunk, f, e),
                     _matrix(b + "ffn_down_chexps.weight", n_chunk, e, f)]
        if spec.arch == "gpt-oss":
            plan += [_biases(b + "ffn_gate_exps.bias", n_exp, f), _biases(b + "ffn_up_exps.bias", n_exp, f),
                     _biases(b + "ffn_down_exps.bias", n_exp, e)]
        if spec.has_shared_expert:
            s = spec.shared_ff
            if _SHARED_EXPERT[spec.arch]:
                plan.append(_matrix(b + "ffn_gate_inp_shexp.weight", e, quantize=False))
            plan += [_matrix(b + "ffn_gate_shexp.weight", s, e), _matrix(b + "ffn_up_shexp.weight", s, e),
                     _matrix(b + "ffn_down_shexp.weight", e, s)]
    return plan


def _tensor_seed(seed: int, name: str) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, zlib.crc32(name.encode("utf-8"))])


def _values(t: _Tensor, seed: int) -> npt.NDArray[np.float32]:
    if t.std == 0.0:
        return np.full(t.shape, t.fill, dtype=np.float32)
    rng = np.random.default_rng(_tensor_seed(seed, t.name))
    data = rng.standard_normal(t.shape, dtype=np.float32) * np.float32(t.std)
    return data + np.float32(t.fill) if t.fill else data


def _n_bytes(shape: tuple[int, ...], qtype: int) -> int:
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * type_size


def _encode(data: npt.NDArray[np.float32], qtype: int) -> npt.NDArray[np.generic]:
    import gguf

    q = gguf.GGMLQuantizationType(qtype)
    if q == gguf.GGMLQuantizationType.F32:
        return data
    if q == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    encoded: npt.NDArray[np.generic] = gguf.quants.quantize(data, q)
    return encoded


def _workers(plan: list[_Tensor]) -> int:
    """Tensors encoded at once: up to the CPU count, as many as memory holds (~6x a tensor's float32 bytes each,
    for the values and the quantizer's temporaries), 1 for small models."""
    import os

    import psutil

    largest = max((int(np.prod(t.shape, dtype=np.int64)) * 4 for t in plan), default=0)
    if largest < (64 << 20):
        return 1
    by_memory = int(psutil.virtual_memory().available // (6 * largest))
    return max(1, min(os.cpu_count() or 1, by_memory, 8))


def _encoded_in_order(plan: list[_Tensor], qtypes: list[int], seed: int) -> Iterator[npt.NDArray[np.generic]]:
    """The plan's tensors, encoded, in order. Each tensor's values depend only on the seed and its name, so the
    bytes are the same for any number of workers; large models encode several tensors at once (numpy releases
    the GIL in the generator and the quantizer), with a bounded window."""
    def encode(t: _Tensor, qt: int) -> npt.NDArray[np.generic]:
        return _encode(_values(t, seed), qt)

    n = _workers(plan)
    if n == 1:
        for t, qt in zip(plan, qtypes, strict=True):
            yield encode(t, qt)
        return
    from collections import deque
    from concurrent.futures import Future, ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=n) as pool:
        window: deque[Future[npt.NDArray[np.generic]]] = deque()
        for t, qt in zip(plan, qtypes, strict=True):
            window.append(pool.submit(encode, t, qt))
            if len(window) >= n:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


# --------------------------------------------------------------------------------------------------
# writing


def _write(path: Path, arch: str, name: str, dtype: _DType, seed: int, plan: list[_Tensor],
           add_hparams: Callable[[object], None], n_vocab: int) -> Path:
    import gguf

    f32 = int(gguf.GGMLQuantizationType.F32)
    tmp = path.with_name(path.name + ".part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb"):
            pass
    except OSError as e:
        raise HarnessError(f"synth: cannot write {path}: {e.strerror or e}") from None
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        writer.add_name(name)
        writer.add_file_type(dtype.file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_hparams(writer)
        tok = build_tokenizer(n_vocab)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(TOKENIZER_PRE)
        writer.add_token_list(list(tok.tokens))
        writer.add_token_types(list(tok.token_types))
        writer.add_token_merges(list(tok.merges))
        writer.add_bos_token_id(tok.bos_id)
        writer.add_eos_token_id(tok.eos_id)
        writer.add_eot_token_id(tok.eos_id)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)

        qtypes = [dtype.ggml if t.quantize else f32 for t in plan]
        for t, qt in zip(plan, qtypes, strict=True):
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), _n_bytes(t.shape, qt),
                                   raw_dtype=gguf.GGMLQuantizationType(qt))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in _encoded_in_order(plan, qtypes, seed):
            writer.write_tensor_data(data)
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return path


def _common_hparams(w: object, *, n_layer: int, n_ctx: int, n_embd: int, n_ff: int, n_head: int,
                    n_head_kv: int, head_dim: int, head_sizes: bool = True) -> None:
    import gguf

    assert isinstance(w, gguf.GGUFWriter)
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if head_sizes:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)


def write_synth_model(spec: SynthSpec, path: str | Path) -> Path:
    """Write the model `spec` describes to `path` (atomically) and return the path."""
    check_spec(spec)
    dtype = _dtype(spec.dtype)

    def hparams(w: object) -> None:
        import gguf

        assert isinstance(w, gguf.GGUFWriter)
        # llama (mixtral) sizes its experts by feed_forward_length
        n_ff = spec.n_ff_exp if spec.arch == "mixtral" else spec.n_ff_exp * spec.n_expert_used
        head_dim = spec.head_dim
        if spec.arch == "deepseek2":
            d = _deepseek2_dims(spec)
            # MLA is stored as MQA with larger heads (as the pinned convert script writes it)
            _common_hparams(w, n_layer=spec.n_layer, n_ctx=spec.n_ctx, n_embd=spec.n_embd, n_ff=n_ff,
                            n_head=spec.n_head, n_head_kv=1, head_dim=head_dim, head_sizes=False)
            w.add_key_length(d["kv_lora"] + d["rope"])
            w.add_value_length(d["kv_lora"])
            w.add_key_length_mla(d["nope"] + d["rope"])
            w.add_value_length_mla(d["v"])
            w.add_rope_dimension_count(d["rope"])
            w.add_q_lora_rank(d["q_lora"])
            w.add_kv_lora_rank(d["kv_lora"])
            w.add_vocab_size(spec.n_vocab)
            w.add_leading_dense_block_count(spec.n_dense_lead)
            w.add_expert_weights_scale(DEEPSEEK2_WEIGHTS_SCALE)
            groups, used = spec.expert_groups
            if groups > 1:
                w.add_expert_group_count(groups)
                w.add_expert_group_used_count(used)
        elif spec.arch == "glm4moe":  # partial rotary embeddings: half of each head (GLM's partial_rotary_factor)
            _common_hparams(w, n_layer=spec.n_block, n_ctx=spec.n_ctx, n_embd=spec.n_embd, n_ff=n_ff,
                            n_head=spec.n_head, n_head_kv=spec.n_head_kv, head_dim=head_dim, head_sizes=False)
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
            w.add_rope_dimension_count(head_dim // 2)
            w.add_leading_dense_block_count(spec.n_dense_lead)
            w.add_expert_weights_scale(GLM4MOE_WEIGHTS_SCALE)
            if spec.n_nextn:
                w.add_nextn_predict_layers(spec.n_nextn)
        else:
            _common_hparams(w, n_layer=spec.n_layer, n_ctx=spec.n_ctx, n_embd=spec.n_embd, n_ff=n_ff,
                            n_head=spec.n_head, n_head_kv=spec.n_head_kv, head_dim=head_dim)
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
        w.add_expert_feed_forward_length(spec.n_ff_exp)
        if spec.has_shared_expert:
            if spec.arch not in ("deepseek2", "glm4moe"):  # these loaders size it from n_ff_exp
                w.add_expert_shared_feed_forward_length(spec.n_ff_shexp)
            w.add_expert_shared_count(1)
        if spec.arch in ("qwen3moe", "mixtral"):
            w.add_expert_weights_norm(True)
        elif spec.arch == "grovemoe":
            w.add_expert_chunk_feed_forward_length(spec.n_ff_exp)
            w.add_experts_per_group(GROVEMOE_EXPERTS_PER_GROUP)
            w.add_expert_group_scale(1.0)
        elif spec.arch == "qwen2moe":
            w.add_expert_weights_norm(False)
        elif spec.arch in ("hy_v3", "deepseek2", "glm4moe"):
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            w.add_expert_weights_norm(True)
        elif spec.arch == "gpt-oss":  # its graph gates with softmax after top-k whatever the metadata says
            w.add_sliding_window(GPT_OSS_SLIDING_WINDOW)
        elif spec.arch == "qwen3next":  # its graph normalises the top-k weights whatever the metadata says
            d = _qwen3next_dims(spec)
            w.add_ssm_conv_kernel(QWEN3NEXT_CONV_KERNEL)
            w.add_ssm_state_size(d["state"])
            w.add_ssm_group_count(d["k_heads"])
            w.add_ssm_time_step_rank(d["v_heads"])
            w.add_ssm_inner_size(d["value"])
            w.add_full_attention_interval(QWEN3NEXT_FULL_ATTENTION_INTERVAL)

    name = (f"synth-{spec.arch}-L{spec.n_layer}-E{spec.n_expert}k{spec.n_expert_used}-d{spec.n_embd}"
            f"-{spec.dtype}-s{spec.seed}")
    if spec.fused_gate_up:
        name += "-fused"
    return _write(Path(path), spec.gguf_arch, name, dtype, spec.seed, _plan_moe(spec), hparams, spec.n_vocab)


def write_dense_model(path: str | Path, seed: int = 0, *, n_layer: int = 2, n_embd: int = 64, n_ff: int = 128,
                      n_head: int = 4, n_head_kv: int = 2, n_ctx: int = 512, n_vocab: int = 512,
                      dtype: str = "f32") -> Path:
    """A tiny dense (no experts) ``qwen3`` model with the same tokenizer, for "not an MoE model" checks."""
    probe = SynthSpec(n_layer=n_layer, n_embd=n_embd, n_ff_exp=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                      n_ctx=n_ctx, n_vocab=n_vocab, dtype=dtype, seed=seed)
    check_spec(probe)
    hd, kv_dim = probe.head_dim, probe.head_dim * n_head_kv
    plan = [_matrix("token_embd.weight", n_vocab, n_embd), _vector("output_norm.weight", n_embd, fill=1.0),
            _matrix("output.weight", n_vocab, n_embd)]
    for i in range(n_layer):
        b = f"blk.{i}."
        plan += [_vector(b + "attn_norm.weight", n_embd, fill=1.0),
                 _matrix(b + "attn_q.weight", n_embd, n_embd), _matrix(b + "attn_k.weight", kv_dim, n_embd),
                 _matrix(b + "attn_v.weight", kv_dim, n_embd), _matrix(b + "attn_output.weight", n_embd, n_embd),
                 _vector(b + "attn_q_norm.weight", hd, fill=1.0), _vector(b + "attn_k_norm.weight", hd, fill=1.0),
                 _vector(b + "ffn_norm.weight", n_embd, fill=1.0),
                 _matrix(b + "ffn_gate.weight", n_ff, n_embd), _matrix(b + "ffn_up.weight", n_ff, n_embd),
                 _matrix(b + "ffn_down.weight", n_embd, n_ff)]

    def hparams(w: object) -> None:
        _common_hparams(w, n_layer=n_layer, n_ctx=n_ctx, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
                        n_head_kv=n_head_kv, head_dim=hd)

    return _write(Path(path), "qwen3", f"synth-dense-qwen3-L{n_layer}-d{n_embd}-{dtype}-s{seed}", _dtype(dtype),
                  seed, plan, hparams, n_vocab)


def expected_bytes_per_expert(spec: SynthSpec) -> int:
    """Bytes of one routed expert in one layer (all its tensors), as the file stores them."""
    dt = _dtype(spec.dtype)
    per = [(spec.n_ff_exp, spec.n_embd), (spec.n_ff_exp, spec.n_embd), (spec.n_embd, spec.n_ff_exp)]
    return sum(_n_bytes(shape, dt.ggml) for shape in per)


def iter_plan(spec: SynthSpec) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, written in spec.dtype) for every tensor `write_synth_model` writes."""
    check_spec(spec)
    for t in _plan_moe(spec):
        yield t.name, t.shape, t.quantize
