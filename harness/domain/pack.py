"""The expert pack's layout (`harness pack`): an expert-major copy of a GGUF model's routed experts, so that the
engine's file tier (`host=file`) reads each missed expert with one read instead of one per expert tensor.

Pure: the layout of a model's pack, and its header as bytes and back. The writer is
harness.orchestration.pack; the engine's reader is src/llama/llama-expert-pack.cpp, which reads the same format
(docs/expert-cache-engine.md, "Expert pack"). All integers little-endian.

    header (PACK_HEADER bytes)                       magic "MOEPACK\\0", version, header_bytes, gguf_size,
                                                     gguf_mtime_ns, pack_size, checksum, n_expert, n_layers,
                                                     n_tensors, align
    n_layers layer entries (PACK_LAYER bytes each)   il, n_tensors, first_tensor, record_bytes, data_bytes,
                                                     first_record
    n_tensors tensor entries (PACK_TENSOR each)      name, ggml type, n_dims, ne[4], row_bytes, expert_bytes,
                                                     rec_offset, gguf_offset, crc32
    zeros up to header_bytes (a multiple of align)
    records: for each layer, in the table's order, for each expert e: one record of record_bytes at
    first_record + e * record_bytes, holding the layer's tensors' slices of expert e (each as in the GGUF:
    expert_bytes at gguf_offset + e * expert_bytes) back to back at their rec_offset, zeros after data_bytes.

record_bytes is data_bytes rounded up to align (4096), so every record starts 4 KiB-aligned and one O_DIRECT read
of record_bytes fetches a whole expert. checksum: the CRC-32 (zlib) of the tensors' CRC-32s (each of a tensor's
bytes in the GGUF, u32 little-endian, in table order).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from harness.core.errors import HarnessError
from harness.parsers.gguf_model import ModelInfo

PACK_MAGIC = b"MOEPACK\0"
PACK_VERSION = 1
PACK_ALIGN = 4096
PACK_SUFFIX = ".moe-pack"  # the default pack of MODEL is MODEL + PACK_SUFFIX, which the engine looks for
PACK_NAME_BYTES = 64

_HEADER = struct.Struct("<8sIIQqQQIIII")
_LAYER = struct.Struct("<IIIIQQQ")
_TENSOR = struct.Struct(f"<{PACK_NAME_BYTES}sII4QQQQQII")
PACK_HEADER, PACK_LAYER, PACK_TENSOR = _HEADER.size, _LAYER.size, _TENSOR.size  # 64, 40, 144


@dataclass(frozen=True)
class PackTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order (ne0, ne1, ne2 = n_expert)
    row_bytes: int
    expert_bytes: int  # one expert's slice: the tensor's bytes / n_expert (its stride in the GGUF and in the banks)
    rec_offset: int  # where the slice starts in a record
    gguf_offset: int  # where the tensor's data starts in the GGUF file
    crc32: int = 0  # of the tensor's bytes in the GGUF (0 until written)


@dataclass(frozen=True)
class PackLayer:
    il: int
    tensors: tuple[PackTensor, ...]
    record_bytes: int  # data_bytes rounded up to PACK_ALIGN
    data_bytes: int
    first_record: int  # file offset of expert 0's record


@dataclass(frozen=True)
class PackLayout:
    gguf_size: int
    gguf_mtime_ns: int
    n_expert: int
    layers: tuple[PackLayer, ...]
    header_bytes: int
    pack_size: int
    checksum: int = 0

    @property
    def tensors(self) -> tuple[PackTensor, ...]:
        return tuple(t for layer in self.layers for t in layer.tensors)


def default_pack_path(model: str | Path) -> Path:
    """Where the engine looks for a model's pack: next to it, its name + .moe-pack."""
    return Path(str(model) + PACK_SUFFIX)


def _round_up(n: int, a: int = PACK_ALIGN) -> int:
    return (n + a - 1) // a * a


def ggml_type_id(dtype: str) -> int:
    import gguf

    try:
        return int(gguf.GGMLQuantizationType[dtype].value)
    except KeyError:
        raise HarnessError(f"unknown GGML type {dtype}") from None


def plan_pack(info: ModelInfo, gguf_size: int, gguf_mtime_ns: int) -> PackLayout:
    """The pack of a model: per MoE layer its routed-expert tensors (in the GGUF's order), one record per expert."""
    by_layer: dict[int, list[PackTensor]] = {}
    for t in info.expert_tensors:
        il = int(t.name.split(".")[1])
        if len(t.name.encode()) >= PACK_NAME_BYTES:
            raise HarnessError(f"{info.path}: tensor name {t.name} is longer than the pack's "
                               f"{PACK_NAME_BYTES - 1} bytes")
        if t.n_bytes % info.n_expert != 0 or t.shape[-1] != info.n_expert:
            raise HarnessError(f"{info.path}: expert tensor {t.name} (shape {t.shape}, {t.n_bytes} bytes) is not "
                               f"{info.n_expert} experts of equal size in its last dimension")
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        layer = by_layer.setdefault(il, [])
        rec = sum(x.expert_bytes for x in layer)
        layer.append(PackTensor(t.name, ggml_type_id(t.dtype), tuple(t.shape), t.n_bytes // rows,
                                t.n_bytes // info.n_expert, rec, t.offset))
    n_tensors = sum(len(v) for v in by_layer.values())
    header_bytes = _round_up(PACK_HEADER + PACK_LAYER * len(by_layer) + PACK_TENSOR * n_tensors)
    layers, pos = [], header_bytes
    for il in sorted(by_layer):
        ts = tuple(by_layer[il])
        data = sum(t.expert_bytes for t in ts)
        layers.append(PackLayer(il, ts, _round_up(data), data, pos))
        pos += _round_up(data) * info.n_expert
    return PackLayout(gguf_size, gguf_mtime_ns, info.n_expert, tuple(layers), header_bytes, pos)


def checksum_of(crcs: list[int] | tuple[int, ...]) -> int:
    """The header's checksum: the CRC-32 of the tensors' CRC-32s in table order."""
    return zlib.crc32(b"".join(struct.pack("<I", c & 0xFFFFFFFF) for c in crcs))


def with_crcs(layout: PackLayout, crcs: list[int] | tuple[int, ...]) -> PackLayout:
    """The layout with each tensor's CRC-32 (table order) and the header's checksum."""
    it = iter(crcs)
    layers = tuple(PackLayer(la.il, tuple(PackTensor(t.name, t.ggml_type, t.shape, t.row_bytes, t.expert_bytes,
                                                     t.rec_offset, t.gguf_offset, next(it)) for t in la.tensors),
                             la.record_bytes, la.data_bytes, la.first_record) for la in layout.layers)
    return PackLayout(layout.gguf_size, layout.gguf_mtime_ns, layout.n_expert, layers, layout.header_bytes,
                      layout.pack_size, checksum_of(crcs))


def encode_header(layout: PackLayout) -> bytes:
    """The pack's first header_bytes bytes."""
    out = bytearray(_HEADER.pack(PACK_MAGIC, PACK_VERSION, layout.header_bytes, layout.gguf_size,
                                 layout.gguf_mtime_ns, layout.pack_size, layout.checksum, layout.n_expert,
                                 len(layout.layers), len(layout.tensors), PACK_ALIGN))
    first = 0
    for la in layout.layers:
        out += _LAYER.pack(la.il, len(la.tensors), first, 0, la.record_bytes, la.data_bytes, la.first_record)
        first += len(la.tensors)
    for t in layout.tensors:
        ne = (list(t.shape) + [1, 1, 1, 1])[:4]
        out += _TENSOR.pack(t.name.encode(), t.ggml_type, len(t.shape), *ne, t.row_bytes, t.expert_bytes,
                            t.rec_offset, t.gguf_offset, t.crc32, 0)
    out += bytes(layout.header_bytes - len(out))
    return bytes(out)


def decode_header(data: bytes, where: str) -> PackLayout:
    """A pack's header from its first bytes (at least header_bytes of them); HarnessError (one line) if it is not
    a pack of this version or its tables are inconsistent."""
    if len(data) < PACK_HEADER:
        raise HarnessError(f"{where}: not an expert pack (shorter than its {PACK_HEADER}-byte header)")
    (magic, version, header_bytes, gguf_size, mtime, pack_size, checksum, n_expert, n_layers, n_tensors,
     align) = _HEADER.unpack_from(data)
    if magic != PACK_MAGIC:
        raise HarnessError(f"{where}: not an expert pack (it starts with {magic!r}, not {PACK_MAGIC!r})")
    if version != PACK_VERSION:
        raise HarnessError(f"{where}: expert pack version {version}; this build reads version {PACK_VERSION}: "
                           "write it again with harness pack")
    need = PACK_HEADER + PACK_LAYER * n_layers + PACK_TENSOR * n_tensors
    if align != PACK_ALIGN or header_bytes % PACK_ALIGN or header_bytes < need or len(data) < need or n_expert < 2:
        raise HarnessError(f"{where}: damaged expert pack header (align {align}, header {header_bytes} bytes, "
                           f"{n_layers} layers, {n_tensors} tensors, {n_expert} experts)")
    tensors = []
    for i in range(n_tensors):
        (name, gtype, n_dims, ne0, ne1, ne2, ne3, row, eb, rec, goff, crc, _) = _TENSOR.unpack_from(
            data, PACK_HEADER + PACK_LAYER * n_layers + PACK_TENSOR * i)
        if not 1 <= n_dims <= 4:
            raise HarnessError(f"{where}: damaged expert pack header (tensor {i} has {n_dims} dimensions)")
        tensors.append(PackTensor(name.rstrip(b"\0").decode(errors="replace"), gtype,
                                  (ne0, ne1, ne2, ne3)[:n_dims], row, eb, rec, goff, crc))
    layers = []
    for i in range(n_layers):
        il, nt, first, _, record_bytes, data_bytes, first_record = _LAYER.unpack_from(
            data, PACK_HEADER + PACK_LAYER * i)
        ts = tuple(tensors[first:first + nt])
        if (len(ts) != nt or nt == 0 or record_bytes % PACK_ALIGN or first_record % PACK_ALIGN
                or data_bytes != sum(t.expert_bytes for t in ts) or record_bytes < data_bytes
                or first_record < header_bytes or first_record + record_bytes * n_expert > pack_size):
            raise HarnessError(f"{where}: damaged expert pack header (layer entry {i})")
        layers.append(PackLayer(il, ts, record_bytes, data_bytes, first_record))
    return PackLayout(gguf_size, mtime, n_expert, tuple(layers), header_bytes, pack_size, checksum)
