"""The layouts of the generated models (harness.tools.synth): what `SynthSpec` can describe, its checks, and for
each architecture its tensors (`plan_moe`) and its metadata (`moe_hparams`). `write_synth_model` writes a
Mixture-of-Experts model that stock llama.cpp loads and runs:

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

Weights: N(0, 1/fan_in) matrices, unit norms, router rows scaled so that router logits have a spread of
about 2 (different tokens pick different experts). The router (``ffn_gate_inp``), norms and biases stay
F32 whatever ``dtype`` says; every other matrix is written in ``dtype``. Quantized types need the
matrix rows (``n_embd``, ``n_ff_exp``, ``n_ff_shexp``) to be multiples of the type's block size (32 for
Q8_0/Q4_0). Q4_K is listed but the gguf package (0.19.0) cannot quantize to it (it only dequantizes
K-quants), so asking for it raises a HarnessError saying so; harness.tools.quantize (``harness synth
--quantize Q4_K_M``) writes f16 and runs the build's llama-quantize instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np

from harness.core.errors import HarnessError
from harness.tools.synth_tokenizer import MIN_VOCAB, SPECIAL_TOKENS

ARCHS: tuple[str, ...] = ("qwen3moe", "qwen2moe", "hy_v3", "mixtral", "gpt-oss", "deepseek2", "qwen3next",
                          "glm4moe", "grovemoe")
# Archs the expert cache refuses (with a one-line error naming the arch); the others it serves.
CACHE_REFUSED: tuple[str, ...] = ("grovemoe",)
# The GGUF architecture each writes, where it differs from the name.
GGUF_ARCH: dict[str, str] = {"mixtral": "llama"}
DTYPES: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_0", "q4_k")
RMS_EPS = 1e-6
ROPE_FREQ_BASE = 10000.0

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
class DType:
    name: str
    ggml: int  # gguf.GGMLQuantizationType value
    file_type: int  # gguf.LlamaFileType value
    block: int  # elements per block (1 for float types)


def dtype_of(name: str) -> DType:
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
    return DType(name, int(qtype), int(ftype), gguf.GGML_QUANT_SIZES[qtype][0])


def can_quantize(dtype: DType) -> bool:
    if dtype.block == 1:
        return True
    import gguf

    try:
        gguf.quants.quantize(np.zeros((1, dtype.block), dtype=np.float32), gguf.GGMLQuantizationType(dtype.ggml))
    except NotImplementedError:
        return False
    return True


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "unknown"


def n_bytes(shape: tuple[int, ...], qtype: int) -> int:
    import gguf

    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * type_size


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
    dt = dtype_of(spec.dtype)
    if not can_quantize(dt):
        raise bad(f"dtype {spec.dtype} cannot be written: the gguf package {gguf_version()} has no quantizer "
                  f"for {spec.dtype.upper()} (only a dequantizer); use harness synth --quantize (llama-quantize), "
                  f"or use one of {', '.join(d for d in DTYPES if can_quantize(dtype_of(d)))}")
    if dt.block > 1:
        rows = {"n_embd": spec.n_embd, "n_ff_exp": spec.n_ff_exp}
        if spec.has_shared_expert and spec.shared_ff != spec.n_ff_exp:
            rows["n_ff_shexp"] = spec.n_ff_shexp
        for name, n in rows.items():
            if n % dt.block:
                raise bad(f"{spec.dtype} stores rows in blocks of {dt.block}: {name}={n} is not a multiple "
                          f"of {dt.block}")


# --------------------------------------------------------------------------------------------------
# tensors


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: the last axis is the row (ne0)
    std: float  # normal(0, std); 0 means constant `fill`
    quantize: bool  # written in the spec's dtype (else F32)
    fill: float = 0.0


def matrix(name: str, *shape: int, quantize: bool = True, scale: float = 1.0) -> PlannedTensor:
    return PlannedTensor(name, tuple(shape), scale / float(np.sqrt(shape[-1])), quantize)


def vector(name: str, n: int, *, fill: float = 0.0, std: float = 0.0) -> PlannedTensor:
    return PlannedTensor(name, (n,), std, False, fill)


def biases(name: str, *shape: int, std: float = 0.02) -> PlannedTensor:
    """An F32 bias tensor (a vector, or one vector per expert)."""
    return PlannedTensor(name, tuple(shape), std, False)


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


def _plan_attention(spec: SynthSpec, b: str, il: int) -> list[PlannedTensor]:
    e, hd, q_dim, kv_dim = spec.n_embd, spec.head_dim, spec.n_embd, spec.head_dim * spec.n_head_kv
    if spec.arch == "qwen3next":
        plan = [vector(b + "attn_norm.weight", e, fill=1.0), vector(b + "post_attention_norm.weight", e, fill=1.0)]
        if (il + 1) % QWEN3NEXT_FULL_ATTENTION_INTERVAL == 0:  # gated full attention: query and gate
            return plan + [matrix(b + "attn_q.weight", 2 * q_dim, e), matrix(b + "attn_k.weight", kv_dim, e),
                           matrix(b + "attn_v.weight", kv_dim, e), matrix(b + "attn_output.weight", e, q_dim),
                           vector(b + "attn_q_norm.weight", hd, fill=1.0),
                           vector(b + "attn_k_norm.weight", hd, fill=1.0)]
        d = _qwen3next_dims(spec)
        conv_dim = 2 * d["key"] + d["value"]
        return plan + [matrix(b + "attn_qkv.weight", conv_dim, e), matrix(b + "attn_gate.weight", d["value"], e),
                       matrix(b + "ssm_conv1d.weight", conv_dim, QWEN3NEXT_CONV_KERNEL, quantize=False),
                       vector(b + "ssm_dt.bias", d["v_heads"], std=0.1),
                       PlannedTensor(b + "ssm_a", (d["v_heads"],), 0.1, False, -0.5),  # A = -exp(A_log): negative
                       matrix(b + "ssm_ba.weight", 2 * d["v_heads"], e),
                       vector(b + "ssm_norm.weight", d["state"], fill=1.0),
                       matrix(b + "ssm_out.weight", e, d["value"])]
    if spec.arch == "deepseek2":
        d = _deepseek2_dims(spec)
        block = dtype_of(spec.dtype).block
        k_mla = d["nope"] + d["rope"]

        def mla(name: str, *shape: int) -> PlannedTensor:  # low-rank pieces stay F32 where rows do not fill blocks
            return matrix(name, *shape, quantize=shape[-1] % block == 0)

        return [vector(b + "attn_norm.weight", e, fill=1.0),
                vector(b + "attn_q_a_norm.weight", d["q_lora"], fill=1.0),
                vector(b + "attn_kv_a_norm.weight", d["kv_lora"], fill=1.0),
                mla(b + "attn_q_a.weight", d["q_lora"], e),
                mla(b + "attn_q_b.weight", spec.n_head * k_mla, d["q_lora"]),
                mla(b + "attn_kv_a_mqa.weight", d["kv_lora"] + d["rope"], e),
                mla(b + "attn_k_b.weight", spec.n_head, d["kv_lora"], d["nope"]),
                mla(b + "attn_v_b.weight", spec.n_head, d["v"], d["kv_lora"]),
                mla(b + "attn_output.weight", e, spec.n_head * d["v"])]
    plan = [vector(b + "attn_norm.weight", e, fill=1.0),
            matrix(b + "attn_q.weight", q_dim, e), matrix(b + "attn_k.weight", kv_dim, e),
            matrix(b + "attn_v.weight", kv_dim, e), matrix(b + "attn_output.weight", e, q_dim)]
    if spec.arch in ("qwen2moe", "gpt-oss", "glm4moe"):
        plan += [vector(b + "attn_q.bias", q_dim, std=0.02), vector(b + "attn_k.bias", kv_dim, std=0.02),
                 vector(b + "attn_v.bias", kv_dim, std=0.02)]
    if spec.arch == "gpt-oss":
        plan += [vector(b + "attn_output.bias", e, std=0.02), vector(b + "attn_sinks.weight", spec.n_head, std=0.5),
                 vector(b + "post_attention_norm.weight", e, fill=1.0)]
    elif spec.arch in ("qwen3moe", "hy_v3", "grovemoe", "glm4moe"):
        plan += [vector(b + "attn_q_norm.weight", hd, fill=1.0), vector(b + "attn_k_norm.weight", hd, fill=1.0)]
    if spec.arch == "glm4moe":  # the FFN input norm
        plan.append(vector(b + "post_attention_norm.weight", e, fill=1.0))
    return plan


def plan_moe(spec: SynthSpec) -> list[PlannedTensor]:
    e, f, n_exp = spec.n_embd, spec.n_ff_exp, spec.n_expert
    plan = [matrix("token_embd.weight", spec.n_vocab, e), vector("output_norm.weight", e, fill=1.0),
            matrix("output.weight", spec.n_vocab, e)]
    for i in range(spec.n_block):
        b = f"blk.{i}."
        plan += _plan_attention(spec, b, i)
        if spec.arch not in ("gpt-oss", "qwen3next", "glm4moe"):  # these take post_attention_norm as the FFN norm
            plan.append(vector(b + "ffn_norm.weight", e, fill=1.0))
        if i >= spec.n_layer:  # an MTP layer (glm4moe): its own input projection and norms, then a MoE layer
            plan += [matrix(b + "nextn.eh_proj.weight", e, 2 * e), vector(b + "nextn.enorm.weight", e, fill=1.0),
                     vector(b + "nextn.hnorm.weight", e, fill=1.0),
                     vector(b + "nextn.shared_head_norm.weight", e, fill=1.0)]
        if i < spec.n_dense_lead:  # leading dense layers: feed_forward_length = n_ff_exp * k
            n_ff = f * spec.n_expert_used
            plan += [matrix(b + "ffn_gate.weight", n_ff, e), matrix(b + "ffn_up.weight", n_ff, e),
                     matrix(b + "ffn_down.weight", e, n_ff)]
            continue
        plan.append(matrix(b + "ffn_gate_inp.weight", n_exp, e, quantize=False, scale=_ROUTER_LOGIT_STD))
        if spec.arch == "gpt-oss":
            plan.append(vector(b + "ffn_gate_inp.bias", n_exp, std=0.1))
        elif spec.arch in ("deepseek2", "glm4moe"):
            plan.append(vector(b + "exp_probs_b.bias", n_exp, std=0.1))
        if spec.arch == "hy_v3":
            plan.append(vector(b + "exp_probs_b", n_exp, std=0.1))
        if spec.merged_gate_up:
            plan.append(matrix(b + "ffn_gate_up_exps.weight", n_exp, 2 * f, e))
        else:
            plan += [matrix(b + "ffn_gate_exps.weight", n_exp, f, e), matrix(b + "ffn_up_exps.weight", n_exp, f, e)]
        plan.append(matrix(b + "ffn_down_exps.weight", n_exp, e, f))
        if spec.arch == "grovemoe":
            n_chunk = n_exp // GROVEMOE_EXPERTS_PER_GROUP
            plan += [matrix(b + "ffn_gate_chexps.weight", n_chunk, f, e),
                     matrix(b + "ffn_up_chexps.weight", n_chunk, f, e),
                     matrix(b + "ffn_down_chexps.weight", n_chunk, e, f)]
        if spec.arch == "gpt-oss":
            plan += [biases(b + "ffn_gate_exps.bias", n_exp, f), biases(b + "ffn_up_exps.bias", n_exp, f),
                     biases(b + "ffn_down_exps.bias", n_exp, e)]
        if spec.has_shared_expert:
            s = spec.shared_ff
            if _SHARED_EXPERT[spec.arch]:
                plan.append(matrix(b + "ffn_gate_inp_shexp.weight", e, quantize=False))
            plan += [matrix(b + "ffn_gate_shexp.weight", s, e), matrix(b + "ffn_up_shexp.weight", s, e),
                     matrix(b + "ffn_down_shexp.weight", e, s)]
    return plan


def expected_bytes_per_expert(spec: SynthSpec) -> int:
    """Bytes of one routed expert in one layer (all its tensors), as the file stores them."""
    dt = dtype_of(spec.dtype)
    per = [(spec.n_ff_exp, spec.n_embd), (spec.n_ff_exp, spec.n_embd), (spec.n_embd, spec.n_ff_exp)]
    return sum(n_bytes(shape, dt.ggml) for shape in per)


def iter_plan(spec: SynthSpec) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, written in spec.dtype) for every tensor `write_synth_model` writes."""
    check_spec(spec)
    for t in plan_moe(spec):
        yield t.name, t.shape, t.quantize


# --------------------------------------------------------------------------------------------------
# metadata


def common_hparams(w: object, *, n_layer: int, n_ctx: int, n_embd: int, n_ff: int, n_head: int,
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


def moe_hparams(spec: SynthSpec, w: object) -> None:
    """The layout's metadata (hyperparameters) for `spec`, added to a gguf.GGUFWriter `w`."""
    import gguf

    assert isinstance(w, gguf.GGUFWriter)
    # llama (mixtral) sizes its experts by feed_forward_length
    n_ff = spec.n_ff_exp if spec.arch == "mixtral" else spec.n_ff_exp * spec.n_expert_used
    head_dim = spec.head_dim
    if spec.arch == "deepseek2":
        d = _deepseek2_dims(spec)
        # MLA is stored as MQA with larger heads (as the pinned convert script writes it)
        common_hparams(w, n_layer=spec.n_layer, n_ctx=spec.n_ctx, n_embd=spec.n_embd, n_ff=n_ff,
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
        common_hparams(w, n_layer=spec.n_block, n_ctx=spec.n_ctx, n_embd=spec.n_embd, n_ff=n_ff,
                        n_head=spec.n_head, n_head_kv=spec.n_head_kv, head_dim=head_dim, head_sizes=False)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim // 2)
        w.add_leading_dense_block_count(spec.n_dense_lead)
        w.add_expert_weights_scale(GLM4MOE_WEIGHTS_SCALE)
        if spec.n_nextn:
            w.add_nextn_predict_layers(spec.n_nextn)
    else:
        common_hparams(w, n_layer=spec.n_layer, n_ctx=spec.n_ctx, n_embd=spec.n_embd, n_ff=n_ff,
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


def model_name(spec: SynthSpec) -> str:
    """general.name of the model `spec` describes."""
    name = (f"synth-{spec.arch}-L{spec.n_layer}-E{spec.n_expert}k{spec.n_expert_used}-d{spec.n_embd}"
            f"-{spec.dtype}-s{spec.seed}")
    if spec.fused_gate_up:
        name += "-fused"
    return name
