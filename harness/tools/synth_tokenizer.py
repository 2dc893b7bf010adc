"""The tokenizer and text of the generated models (harness.tools.synth): a byte-level BPE trained here, on a
built-in English text, and deterministic text for perplexity runs.

Every model carries the same byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``, pre-tokenizer
``gpt-2``): token ids 0-255 are the 256 bytes, then merges learned from the built-in text (and, for vocabularies
larger than that text supports, deterministic letter-extension merges), then the control tokens
``<|endoftext|>`` (bos), ``<|im_start|>`` and ``<|im_end|>`` (eos/eot) at the end, and a ChatML chat template.
So any text tokenizes, and ``n_vocab`` must be at least 259.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from harness.core.errors import HarnessError

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
TOKENIZER_PRE = "gpt-2"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

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
