"""The bytes of every token of a GGUF model's vocabulary, from its metadata (`tokenizer.ggml.*`; no weights loaded):
what `harness bpb` divides a model's cross-entropy by, so that models with different tokenizers compare per byte.

Byte-level BPE (`tokenizer.ggml.model` "gpt2": GPT-2, Qwen, Llama-3 and our own tinymoe/studymoe tokenizers) stores
each token as text in which every byte is one printable character of GPT-2's `bytes_to_unicode` table; its inverse
gives the token's bytes back, as llama.cpp's own detokenizer does (`llama_decode_text`). Per token type
(`tokenizer.ggml.token_type`, llama.cpp's `llama_token_type`):

- NORMAL (1): the inverse table, character by character;
- USER_DEFINED (4): the token's text as UTF-8, as it stands (llama.cpp does not byte-decode these);
- BYTE (6): `<0xNN>` is that one byte;
- CONTROL (3), UNKNOWN (2), UNUSED (5): zero bytes. These are the special tokens (BOS, EOS, `<|endoftext|>`...),
  which are no bytes of a text. llama-perplexity tokenizes without parsing special tokens (`common_tokenize`,
  parse_special false: a text that spells `<|endoftext|>` gets ordinary tokens) and adds BOS only as a chunk's first
  token, which is never scored; so no scored token should be one. Were one scored, its NLL would count and its
  bytes not (`harness bpb` warns, counting them).

Other vocabulary types (SentencePiece "llama", WordPiece "bert", RWKV...) are one line of HarnessError.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.core.errors import HarnessError
from harness.parsers.gguf_open import gguf_damage, open_gguf

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
ZERO_BYTE_TYPES = (TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_UNUSED)
BYTE_LEVEL_MODELS = ("gpt2",)  # tokenizer.ggml.model values whose token texts are GPT-2 byte-level


@cache
def gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's `bytes_to_unicode` (openai/gpt-2 encoder.py, as in Hugging Face tokenizers'
    ByteLevel): the printable bytes map to themselves, the other 68 to U+0100 upwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@dataclass(frozen=True, eq=False)
class VocabBytes:
    """The bytes of each token id of a model's vocabulary; `n_zero` ids (control, unknown, unused) have none."""

    path: str
    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre ("" when absent)
    n_ctx_train: int | None  # {arch}.context_length, when the model says
    pieces: tuple[bytes, ...]
    n_zero: int

    @property
    def n_vocab(self) -> int:
        return len(self.pieces)

    @property
    def lengths(self) -> npt.NDArray[np.int64]:
        return np.fromiter((len(p) for p in self.pieces), dtype=np.int64, count=len(self.pieces))

    def decode(self, ids: Any) -> bytes:
        """The bytes of a token sequence (ids in the vocabulary; a HarnessError names one that is not)."""
        out = []
        for t in ids:
            i = int(t)
            if not 0 <= i < len(self.pieces):
                raise HarnessError(f"token id {i} is outside the vocabulary of {self.path} ({len(self.pieces)} tokens)")
            out.append(self.pieces[i])
        return b"".join(out)


def token_bytes(text: str, token_type: int, token_id: int, decoder: dict[str, int]) -> bytes:
    """One byte-level BPE token's bytes by its type (module docstring)."""
    if token_type in ZERO_BYTE_TYPES:
        return b""
    if token_type == TOKEN_USER_DEFINED:
        return text.encode("utf-8")
    if token_type == TOKEN_BYTE:
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                pass
        raise HarnessError(f"token {token_id} is of type BYTE but reads {text!r}, not <0xNN>")
    try:
        return bytes(decoder[c] for c in text)
    except KeyError as e:
        raise HarnessError(f"token {token_id} ({text!r}) has the character {e.args[0]!r}, which is not in GPT-2's "
                           "byte-level table: not a byte-level BPE vocabulary") from None


def vocab_bytes_from_metadata(path: str, model: str, pre: str, tokens: list[str], types: list[int] | None,
                              n_ctx_train: int | None = None) -> VocabBytes:
    """VocabBytes from the tokenizer metadata values (pure; `types` None: every token NORMAL)."""
    if model not in BYTE_LEVEL_MODELS:
        raise HarnessError(f"{path}: its vocabulary is of type {model!r}; bits per byte knows byte-level BPE "
                           f"({', '.join(BYTE_LEVEL_MODELS)}) only")
    if not tokens:
        raise HarnessError(f"{path}: the GGUF file has no tokenizer.ggml.tokens")
    if types is not None and len(types) != len(tokens):
        raise HarnessError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    decoder = gpt2_byte_decoder()
    kinds = types if types is not None else [TOKEN_NORMAL] * len(tokens)
    pieces = tuple(token_bytes(t, int(k), i, decoder) for i, (t, k) in enumerate(zip(tokens, kinds, strict=True)))
    n_zero = sum(1 for k in kinds if int(k) in ZERO_BYTE_TYPES)
    return VocabBytes(path, model, pre, n_ctx_train, pieces, n_zero)


def read_vocab_bytes(path: str | Path) -> VocabBytes:
    """The vocabulary of the GGUF model at `path`; a one-line HarnessError for a missing, non-GGUF or damaged file,
    or a vocabulary that is not byte-level BPE."""
    p = Path(path)
    reader = open_gguf(p)
    with gguf_damage(p):
        def field(key: str) -> Any:
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        arch = field("general.architecture")
        model = field("tokenizer.ggml.model")
        pre = field("tokenizer.ggml.pre")
        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type")
        n_ctx = field(f"{arch}.context_length") if isinstance(arch, str) else None
    if not isinstance(model, str):
        raise HarnessError(f"{p}: the GGUF file has no tokenizer (tokenizer.ggml.model)")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise HarnessError(f"{p}: the GGUF file has no tokenizer.ggml.tokens")
    if types is not None and not isinstance(types, list):
        raise HarnessError(f"{p}: tokenizer.ggml.token_type is not a list")
    return vocab_bytes_from_metadata(str(p), model, pre if isinstance(pre, str) else "", tokens,
                                     [int(t) for t in types] if types is not None else None,
                                     int(n_ctx) if isinstance(n_ctx, int) and n_ctx > 0 else None)
