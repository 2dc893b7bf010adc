"""Small random-weight GGUF models for tests, deterministic by seed: the writer, and the package's face.

`write_synth_model(spec, path)` writes the Mixture-of-Experts model that a `SynthSpec` describes, which stock
llama.cpp loads and runs; `write_dense_model(path, seed)` a tiny dense ``qwen3`` model, for the "not an MoE model"
paths. The parts:

- harness.tools.synth_layouts: the architectures (qwen3moe, qwen2moe, hy_v3, mixtral, gpt-oss, deepseek2,
  qwen3next, glm4moe, grovemoe), `SynthSpec` and its checks, each layout's tensors and metadata, the dtypes;
- harness.tools.synth_tokenizer: the byte-level BPE tokenizer every model carries (trained on a built-in text),
  and `synth_text`, deterministic text for perplexity runs;
- this module: the tensors' values and encoding, and the GGUF file.

The same seed gives a byte-identical file (for a given numpy and gguf version): every tensor draws from
its own generator seeded by (seed, tensor name).

`direct=True` (speed benchmarks of models of tens of GB: bench_tiers --full-scale) draws the quantized tensors'
Q4_0/Q8_0 blocks directly instead of quantizing normals: uniform random quants and one scale per tensor, chosen so
that the dequantized values have the normals' standard deviation. Same sizes, layout and kernels, the router and
every unquantized tensor as before; about a hundred times faster (the quantizer of the gguf package encodes ~12 MB/s
on two cores; drawing bytes is bound by the disk).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError
from harness.core.files import special_kind
from harness.tools.synth_layouts import (
    ARCHS,
    CACHE_REFUSED,
    DTYPES,
    GGUF_ARCH,
    WEIGHTS_SCALE,
    DType,
    PlannedTensor,
    SynthSpec,
    check_spec,
    common_hparams,
    dtype_of,
    expected_bytes_per_expert,
    iter_plan,
    matrix,
    model_name,
    moe_hparams,
    n_bytes,
    plan_moe,
    vector,
)
from harness.tools.synth_tokenizer import (
    CHAT_TEMPLATE,
    MIN_VOCAB,
    SPECIAL_TOKENS,
    TOKENIZER_PRE,
    Tokenizer,
    build_tokenizer,
    synth_text,
)

__all__ = [
    "ARCHS",
    "CACHE_REFUSED",
    "DTYPES",
    "GGUF_ARCH",
    "MIN_VOCAB",
    "SPECIAL_TOKENS",
    "WEIGHTS_SCALE",
    "SynthSpec",
    "Tokenizer",
    "build_tokenizer",
    "check_spec",
    "direct_supported",
    "expected_bytes_per_expert",
    "iter_plan",
    "synth_text",
    "write_dense_model",
    "write_synth_model",
]


def _tensor_seed(seed: int, name: str) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, zlib.crc32(name.encode("utf-8"))])


# The writer streams: a tensor's values are drawn and encoded in chunks of whole rows of at most this many bytes of
# float32 and written as they come, so that writing a model needs memory for a few chunks, never a whole tensor (the
# study's full geometry has expert tensors of 2 GiB in float32) and never the model; the file is written once, under
# a temporary name in the same folder and renamed. Drawing a generator's normals in chunks gives the values of one
# draw, and the encodings are per row (a quantization block never spans rows), so the bytes do not depend on the
# chunk size (tests/test_synth.py).
CHUNK_BYTES = 64 << 20


def _value_chunks(t: PlannedTensor, seed: int, chunk_bytes: int) -> Iterator[npt.NDArray[np.float32]]:
    """The tensor's values in row order, in chunks of whole rows (the last axis) of at most `chunk_bytes` float32
    bytes (at least one row)."""
    row = t.shape[-1]
    rows = int(np.prod(t.shape[:-1], dtype=np.int64))
    step = max(1, chunk_bytes // (4 * row))
    if t.std == 0.0:
        for r0 in range(0, rows, step):
            yield np.full((min(step, rows - r0), row), t.fill, dtype=np.float32)
        return
    rng = np.random.default_rng(_tensor_seed(seed, t.name))
    for r0 in range(0, rows, step):
        data = rng.standard_normal((min(step, rows - r0), row), dtype=np.float32) * np.float32(t.std)
        yield data + np.float32(t.fill) if t.fill else data


# Direct blocks: (block bytes, values per block, std of the dequantized quant values when uniform) of the types whose
# block is one float16 scale followed by the quants: Q4_0 (nibbles 0..15, value q - 8) and Q8_0 (int8 -127..127).
_DIRECT_BLOCKS: dict[str, tuple[int, int, float]] = {
    "Q4_0": (18, 32, float(np.std(np.arange(16) - 8))),
    "Q8_0": (34, 32, float(np.std(np.arange(-127, 128)))),
}


def direct_supported(qtype: int) -> bool:
    import gguf

    return gguf.GGMLQuantizationType(qtype).name in _DIRECT_BLOCKS


def _direct_chunks(t: PlannedTensor, qtype: int, seed: int, chunk_bytes: int) -> Iterator[npt.NDArray[np.uint8]]:
    """The tensor's encoded rows drawn as blocks, in chunks of whole rows of about `chunk_bytes` encoded bytes:
    random quants, every block's scale std / (the quants' std), so the dequantized values have the tensor's std."""
    import gguf

    name = gguf.GGMLQuantizationType(qtype).name
    block, per_block, q_std = _DIRECT_BLOCKS[name]
    row = t.shape[-1]
    if row % per_block:
        raise HarnessError(f"synth: tensor {t.name}: rows of {row} values are not whole {name} blocks")
    blocks_per_row = row // per_block
    rows = int(np.prod(t.shape[:-1], dtype=np.int64))
    step = max(1, chunk_bytes // (block * blocks_per_row))
    scale = np.frombuffer(np.float16(t.std / q_std).tobytes(), dtype=np.uint8)
    rng = np.random.default_rng(_tensor_seed(seed, t.name))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0) * blocks_per_row
        data = np.frombuffer(rng.bytes(n * block), dtype=np.uint8).reshape(n, block).copy()
        data[:, :2] = scale
        if name == "Q8_0":  # int8 -128 is outside the quantizer's range
            q = data[:, 2:]
            q[q == 0x80] = 0x81
        yield data


def _encode(data: npt.NDArray[np.float32], qtype: int) -> npt.NDArray[np.generic]:
    import gguf

    q = gguf.GGMLQuantizationType(qtype)
    if q == gguf.GGMLQuantizationType.F32:
        return data
    if q == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    encoded: npt.NDArray[np.generic] = gguf.quants.quantize(data, q)
    return encoded


def _workers(plan: list[PlannedTensor]) -> int:
    """Chunks encoded at once: up to the CPU count, as many as memory holds (~6x a chunk's float32 bytes each,
    for the values and the quantizer's temporaries), 1 for small models."""
    import os

    import psutil

    largest = max((int(np.prod(t.shape, dtype=np.int64)) * 4 for t in plan), default=0)
    if largest < (64 << 20):
        return 1
    by_memory = int(psutil.virtual_memory().available // (6 * min(largest, CHUNK_BYTES)))
    return max(1, min(os.cpu_count() or 1, by_memory, 8))


def _encoded_in_order(plan: list[PlannedTensor], qtypes: list[int], seed: int, direct: bool = False
                      ) -> Iterator[tuple[int, npt.NDArray[np.generic]]]:
    """(index in the plan, encoded chunk) for every chunk of every tensor, in file order. Each tensor's values
    depend only on the seed and its name, so the bytes are the same for any number of workers; large models encode
    several chunks at once (numpy releases the GIL in the quantizer), with a bounded window: memory is a few chunks.
    """
    chunk_bytes = CHUNK_BYTES
    if direct:
        for i, (t, qt) in enumerate(zip(plan, qtypes, strict=True)):
            if t.quantize and t.std != 0.0 and direct_supported(qt):
                for block_rows in _direct_chunks(t, qt, seed, chunk_bytes // 8):
                    yield i, block_rows
            else:
                for values in _value_chunks(t, seed, chunk_bytes):
                    yield i, _encode(values, qt)
        return
    n = _workers(plan)
    if n == 1:
        for i, (t, qt) in enumerate(zip(plan, qtypes, strict=True)):
            for values in _value_chunks(t, seed, chunk_bytes):
                yield i, _encode(values, qt)
        return
    from collections import deque
    from concurrent.futures import Future, ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=n) as pool:
        window: deque[tuple[int, Future[npt.NDArray[np.generic]]]] = deque()
        for i, (t, qt) in enumerate(zip(plan, qtypes, strict=True)):
            for values in _value_chunks(t, seed, chunk_bytes):
                window.append((i, pool.submit(_encode, values, qt)))
                if len(window) >= n:
                    j, f = window.popleft()
                    yield j, f.result()
        while window:
            j, f = window.popleft()
            yield j, f.result()


# --------------------------------------------------------------------------------------------------
# writing


def check_output(path: str | Path, *, replace: bool) -> None:
    """A HarnessError (one line) when the model cannot be written at `path`: a folder or another file that is not a
    regular one (a FIFO, a device), or, unless `replace`, an existing model (`harness synth` replaces one only with
    --force: a model overwritten silently is lost)."""
    kind = special_kind(path)
    if kind == "a folder":
        raise HarnessError(f"synth: -o {path} is a folder: name the .gguf file to write (e.g. "
                           f"{Path(path) / 'model.gguf'})")
    if kind is not None:
        raise HarnessError(f"synth: -o {path} is {kind}, not a regular file: name the .gguf file to write")
    if not replace and Path(path).exists():
        raise HarnessError(f"synth: {path} exists: pass --force to replace it, or another -o")


def _write(path: Path, arch: str, name: str, dtype: DType, seed: int, plan: list[PlannedTensor],
           add_hparams: Callable[[object], None], n_vocab: int, direct: bool = False, replace: bool = True) -> Path:
    import gguf

    check_output(path, replace=replace)
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
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), n_bytes(t.shape, qt),
                                   raw_dtype=gguf.GGMLQuantizationType(qt))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        # gguf's write_tensor_data takes a whole tensor; its layout (the data aligned, each tensor padded to the
        # alignment) written chunk by chunk instead
        fout = writer.fout[0] if writer.fout else None
        assert fout is not None
        current, written = -1, 0
        for i, data in _encoded_in_order(plan, qtypes, seed, direct):
            if i != current:
                if current >= 0:
                    _end_tensor(writer, fout, plan[current], qtypes[current], written)
                writer.write_padding(fout, fout.tell())
                current, written = i, 0
            data.tofile(fout)
            written += data.nbytes
        if current >= 0:
            _end_tensor(writer, fout, plan[current], qtypes[current], written)
        writer.close()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    return path


def _end_tensor(writer: object, fout: object, t: PlannedTensor, qtype: int, written: int) -> None:
    """After a tensor's last chunk: check its size against the header's, pad to the alignment."""
    if written != n_bytes(t.shape, qtype):
        raise HarnessError(f"synth: tensor {t.name}: wrote {written} bytes, the header says {n_bytes(t.shape, qtype)}")
    writer.write_padding(fout, written)  # type: ignore[attr-defined]


def write_synth_model(spec: SynthSpec, path: str | Path, *, direct: bool = False, replace: bool = True) -> Path:
    """Write the model `spec` describes to `path` (atomically) and return the path. `direct`: Q4_0/Q8_0 blocks
    drawn directly (the module's docstring); refused for another dtype. `replace=False`: an existing file at `path`
    is refused (check_output)."""
    check_spec(spec)
    dt = dtype_of(spec.dtype)
    if direct and not direct_supported(dt.ggml):
        raise HarnessError(f"synth: direct blocks are drawn for q4_0 and q8_0, not {spec.dtype}")
    return _write(Path(path), spec.gguf_arch, model_name(spec), dt, spec.seed, plan_moe(spec),
                  lambda w: moe_hparams(spec, w), spec.n_vocab, direct, replace)


def write_dense_model(path: str | Path, seed: int = 0, *, n_layer: int = 2, n_embd: int = 64, n_ff: int = 128,
                      n_head: int = 4, n_head_kv: int = 2, n_ctx: int = 512, n_vocab: int = 512,
                      dtype: str = "f32") -> Path:
    """A tiny dense (no experts) ``qwen3`` model with the same tokenizer, for "not an MoE model" checks."""
    probe = SynthSpec(n_layer=n_layer, n_embd=n_embd, n_ff_exp=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                      n_ctx=n_ctx, n_vocab=n_vocab, dtype=dtype, seed=seed)
    check_spec(probe)
    hd, kv_dim = probe.head_dim, probe.head_dim * n_head_kv
    plan = [matrix("token_embd.weight", n_vocab, n_embd), vector("output_norm.weight", n_embd, fill=1.0),
            matrix("output.weight", n_vocab, n_embd)]
    for i in range(n_layer):
        b = f"blk.{i}."
        plan += [vector(b + "attn_norm.weight", n_embd, fill=1.0),
                 matrix(b + "attn_q.weight", n_embd, n_embd), matrix(b + "attn_k.weight", kv_dim, n_embd),
                 matrix(b + "attn_v.weight", kv_dim, n_embd), matrix(b + "attn_output.weight", n_embd, n_embd),
                 vector(b + "attn_q_norm.weight", hd, fill=1.0), vector(b + "attn_k_norm.weight", hd, fill=1.0),
                 vector(b + "ffn_norm.weight", n_embd, fill=1.0),
                 matrix(b + "ffn_gate.weight", n_ff, n_embd), matrix(b + "ffn_up.weight", n_ff, n_embd),
                 matrix(b + "ffn_down.weight", n_embd, n_ff)]

    def hparams(w: object) -> None:
        common_hparams(w, n_layer=n_layer, n_ctx=n_ctx, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
                        n_head_kv=n_head_kv, head_dim=hd)

    return _write(Path(path), "qwen3", f"synth-dense-qwen3-L{n_layer}-d{n_embd}-{dtype}-s{seed}", dtype_of(dtype),
                  seed, plan, hparams, n_vocab)
