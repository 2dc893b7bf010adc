"""What a GGUF model is, for the cache: read from its metadata and tensor table (no weights are loaded).

A pure reader: `read_model_info(path)` returns a frozen `ModelInfo` or raises a `HarnessError` with a
one-line message (not a GGUF file, truncated, not an MoE model, expert counts that llama.cpp would abort on:
`check_expert_counts`).

NextN/MTP layers (``{arch}.nextn_predict_layers``, the last layers of ``block_count``: GLM-4.5, DeepSeek-V3,
Qwen3-Next... as the pinned converter writes them) are not counted as MoE layers and their tensors are in neither
byte count: llama.cpp of the pin loads them only for MTP speculative decoding (``load_mtp``) and otherwise skips
them ("model has unused tensor"), so they take no memory, and the expert cache has no state or banks for them.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.core.errors import HarnessError, NotMoEError
from harness.parsers.gguf_open import gguf_damage, open_gguf

# Routed-expert tensors: blk.N.ffn_{gate,up,down,gate_up}_exps.{weight,bias,scale}; shared experts
# (ffn_*_shexp) are dense and stay on the device, as llama.cpp's --cpu-moe regex does.
_EXPS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias|scale)$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_SHEXP_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight$")
_ROUTER_RE = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")
_GATE_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}
# Architectures whose llama.cpp graph fixes the gating without the expert_gating_func key.
_GATING_BY_ARCH = {"gpt-oss": "softmax_weight"}


@dataclass(frozen=True)
class ExpertTensor:
    name: str
    kind: str  # gate, up, down, gate_up
    role: str  # weight, bias, scale
    dtype: str
    shape: tuple[int, ...]  # GGUF order: ne0, ne1, ne2 (ne2 = n_expert)
    n_bytes: int
    offset: int = 0  # where its data starts in the file (bytes)


@dataclass(frozen=True)
class ModelInfo:
    path: str
    arch: str
    name: str
    n_layers: int
    moe_layers: tuple[int, ...]
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    gating: str
    weights_norm: bool | None
    merged_gate_up: bool
    expert_tensors: tuple[ExpertTensor, ...]
    expert_bytes: int
    non_expert_bytes: int
    file_bytes: int
    file_type: str
    kv_bytes_per_cell: int = 0  # the KV cache's bytes per context cell over all layers (f16 K and V); 0: unknown
    n_nextn_layers: int = 0  # NextN/MTP layers at the end of n_layers (not loaded without MTP decoding)
    nextn_bytes: int = 0  # their tensors' bytes (in file_bytes, not in expert_bytes or non_expert_bytes)

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert in one layer, all its tensors together (weights, biases, scales)."""
        return self.expert_bytes // (self.n_moe_layers * self.n_expert)

    @property
    def bytes_per_expert_tensor(self) -> dict[str, int]:
        """Bytes of one expert's slice of each expert tensor kind (layer 0 of the MoE layers)."""
        first = f"blk.{self.moe_layers[0]}."
        return {f"{t.kind}.{t.role}": t.n_bytes // self.n_expert
                for t in self.expert_tensors if t.name.startswith(first)}

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes + self.non_expert_bytes


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.contents()
    return value


def _count(p: Path, reader: Any, key: str) -> int:
    """A count of the metadata (0 when absent); one per layer (an array): the largest, as llama.cpp validates
    n_expert_used_max(); anything else is a one-line error."""
    value = _field(reader, key)
    if value is None:
        return 0
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise HarnessError(f"{p}: {key} is {value!r}, not a count")
    return max(int(v) for v in values)


def check_expert_counts(p: Path, arch: str, n_expert: int, n_used: int, *, routed: bool) -> None:
    """The expert counts that llama.cpp of the pin asserts when it loads the model (llama_model::load_hparams:
    n_expert_used <= n_expert, and none used without experts; a MoE architecture throws "n_expert must be > 0"), as
    one-line errors: a file with routed expert or router tensors (`routed`) or an experts-used count, but an expert
    count of 0, and more experts used per token than a layer has. Without any of them the model is dense (NotMoEError
    follows)."""
    fix = "a damaged or wrongly converted GGUF (llama.cpp aborts loading it): convert the model again"
    if n_expert <= 0 and (routed or n_used > 0):
        what = "routed expert tensors" if routed else f"{arch}.expert_used_count={n_used}"
        raise HarnessError(f"{p}: {arch}.expert_count is {'0 or missing' if n_expert == 0 else n_expert}, yet the "
                           f"file has {what}: {fix}")
    if n_expert > 0 and n_used > n_expert:
        raise HarnessError(f"{p}: {arch}.expert_used_count={n_used} is more than {arch}.expert_count={n_expert} (a "
                           f"token cannot use more experts than a layer has): {fix}")


def read_model_info(path: str | Path) -> ModelInfo:
    p = Path(path)
    reader = open_gguf(p)
    with gguf_damage(p):
        tensors = list(reader.tensors)
        file_bytes = p.stat().st_size
    for t in tensors:
        if t.data_offset + t.n_bytes > file_bytes:
            raise HarnessError(f"{p}: truncated GGUF file (tensor {t.name} ends past the end of the file)")

    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise HarnessError(f"{p}: the GGUF file has no general.architecture")
    n_layers = int(_field(reader, f"{arch}.block_count") or 0)
    n_expert = _count(p, reader, f"{arch}.expert_count")
    n_used = _count(p, reader, f"{arch}.expert_used_count")
    n_shared = _field(reader, f"{arch}.expert_shared_count")
    gating_id = _field(reader, f"{arch}.expert_gating_func")
    norm = _field(reader, f"{arch}.expert_weights_norm")
    n_nextn = int(_field(reader, f"{arch}.nextn_predict_layers") or 0)
    if n_nextn and not 0 < n_nextn < n_layers:
        raise HarnessError(f"{p}: {arch}.nextn_predict_layers={n_nextn} is not below block_count={n_layers}")
    n_trunk = n_layers - n_nextn if n_nextn else None  # layers >= n_trunk are the MTP layers

    experts: list[ExpertTensor] = []
    moe_layers: set[int] = set()
    shexp_layers: set[int] = set()
    non_expert = nextn = 0
    for t in tensors:
        if n_trunk is not None and (b := _BLOCK_RE.match(t.name)) is not None and int(b.group(1)) >= n_trunk:
            nextn += int(t.n_bytes)
            continue
        m = _EXPS_RE.match(t.name)
        if m:
            moe_layers.add(int(m.group(1)))
            experts.append(ExpertTensor(t.name, m.group(2), m.group(3), t.tensor_type.name,
                                        tuple(int(x) for x in t.shape), int(t.n_bytes), int(t.data_offset)))
            continue
        if (s := _SHEXP_RE.match(t.name)) is not None:
            shexp_layers.add(int(s.group(1)))
        non_expert += int(t.n_bytes)
    routers = any(_ROUTER_RE.match(t.name) for t in tensors)
    check_expert_counts(p, arch, n_expert, n_used, routed=bool(experts) or routers)
    if not experts or n_expert <= 1:
        raise NotMoEError(f"{p}: not a Mixture-of-Experts model ({arch} has no routed expert tensors): "
                          "there is nothing to cache; run it with stock llama.cpp")
    if n_used <= 0:
        raise HarnessError(f"{p}: {arch}.expert_used_count is missing")
    for et in experts:
        if et.role == "weight" and (len(et.shape) != 3 or et.shape[2] != n_expert):
            raise HarnessError(f"{p}: expert tensor {et.name} has shape {et.shape}, expected n_expert={n_expert} "
                               "in its last dimension")
    if n_shared is None:
        n_shared = 1 if shexp_layers else 0
    weights = {t.tensor_type.name for t in tensors if t.name.endswith("_exps.weight")}
    return ModelInfo(
        path=str(p),
        arch=arch,
        name=str(_field(reader, "general.name") or p.stem),
        n_layers=n_layers,
        moe_layers=tuple(sorted(moe_layers)),
        n_expert=n_expert,
        n_expert_used=n_used,
        n_expert_shared=int(n_shared),
        gating=(_GATE_FUNCS.get(int(gating_id), f"unknown({gating_id})") if gating_id is not None
                else _GATING_BY_ARCH.get(arch, "softmax")),
        weights_norm=bool(norm) if norm is not None else None,
        merged_gate_up=any(t.kind == "gate_up" for t in experts),
        expert_tensors=tuple(experts),
        expert_bytes=sum(t.n_bytes for t in experts),
        non_expert_bytes=non_expert,
        file_bytes=file_bytes,
        file_type=",".join(sorted(weights)),
        kv_bytes_per_cell=_kv_bytes_per_cell(reader, arch, n_layers if n_trunk is None else n_trunk),
        n_nextn_layers=n_nextn,
        nextn_bytes=nextn,
    )


def _per_layer(value: Any, n_layers: int) -> list[int]:
    """A metadata value that is one number or one per layer (head_count_kv of some models)."""
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value][:n_layers]
    return [int(value)] * n_layers


def _kv_bytes_per_cell(reader: Any, arch: str, n_layers: int) -> int:
    """f16 K and V of one context cell in every layer: n_head_kv x (key_length + value_length) x 2 bytes
    (llama.cpp's default KV cache type), the head sizes defaulting to n_embd / n_head; 0 when the metadata
    lacks them."""
    n_embd = _field(reader, f"{arch}.embedding_length")
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_head_kv = _field(reader, f"{arch}.attention.head_count_kv")
    if n_embd is None or n_head is None:
        return 0
    heads = _per_layer(n_head, n_layers)
    heads_kv = _per_layer(n_head_kv if n_head_kv is not None else n_head, n_layers)
    if not heads or min(heads) <= 0:
        return 0
    k_len = _field(reader, f"{arch}.attention.key_length")
    v_len = _field(reader, f"{arch}.attention.value_length")
    total = 0
    for h, hkv in zip(heads, heads_kv, strict=False):
        dk = int(k_len) if k_len is not None else int(n_embd) // h
        dv = int(v_len) if v_len is not None else int(n_embd) // h
        total += hkv * (dk + dv) * 2
    return total


FINGERPRINT_ROUTER_BYTES = 4096  # of each router's weights, from its start
_FNV_OFFSET, _FNV_PRIME, _U64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1
_EXPERT_KINDS = ("gate", "up", "down", "gate_up")


def fnv1a64(data: bytes, h: int = _FNV_OFFSET) -> int:
    """64-bit FNV-1a of `data`, continuing from `h`."""
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _U64
    return h


def model_fingerprint(path: str | Path) -> int:
    """The fingerprint of a model for its router traces (docs/expert-cache.md, "Router trace"): 64-bit FNV-1a over,
    for each MoE layer of the trunk (NextN/MTP layers excepted) in order: the layer index; for each routed-expert
    weight tensor of the layer in the order gate, up, down, gate_up (those present): ne0, ne1, ne2 and its ggml type;
    the router weights' (ffn_gate_inp.weight) byte size and their first FINGERPRINT_ROUTER_BYTES bytes as stored;
    every number a little-endian uint64. Two models of the same shape differ in their routers; 0 is never a
    fingerprint (it means none, and becomes 1)."""
    info = read_model_info(path)
    import gguf

    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    h = _FNV_OFFSET
    for il in info.moe_layers:
        h = fnv1a64(struct.pack("<Q", il), h)
        for kind in _EXPERT_KINDS:
            t = by_name.get(f"blk.{il}.ffn_{kind}_exps.weight")
            if t is not None:
                ne = [int(x) for x in t.shape] + [1] * (3 - len(t.shape))
                h = fnv1a64(struct.pack("<4Q", *ne[:3], int(t.tensor_type)), h)
        router = by_name.get(f"blk.{il}.ffn_gate_inp.weight")
        if router is None:
            raise HarnessError(f"{path}: MoE layer {il} has no router (blk.{il}.ffn_gate_inp.weight)")
        raw = np.asarray(router.data).view(np.uint8).reshape(-1)
        h = fnv1a64(struct.pack("<Q", int(router.n_bytes)) + raw[:FINGERPRINT_ROUTER_BYTES].tobytes(), h)
    return h or 1
