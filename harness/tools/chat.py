"""A multi-turn chat with llama-server through a real OpenAI-compatible client (the `openai` package), the way a
user's chat application talks to it (issue 24, item 3): each turn sends the whole conversation so far, llama-server
reuses what its prompt cache holds, and the answer streams back.

Per turn: the time to the first streamed token (the client's clock) and the server's own accounting from /metrics
deltas around the request (prompt tokens processed and reused, prompt seconds, tokens generated and their seconds,
the expert cache's counters). One request at a time: the deltas are that turn's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.core.errors import HarnessError
from harness.tools.server import Server, ServerMetrics


@dataclass(frozen=True)
class Turn:
    index: int
    user: str
    answer: str
    ttft_s: float  # request sent -> first streamed content (client clock); nan if nothing streamed
    wall_s: float  # request sent -> stream ended
    prompt_tokens: int  # prompt tokens the server processed this turn (not counting reused ones)
    prompt_cached: int  # prompt tokens reused from the server's prompt cache
    prompt_s: float
    predicted: int  # tokens generated
    predicted_s: float
    cache: dict[str, int] | None  # the expert cache's counter deltas (None: no cache)

    @property
    def decode_tps(self) -> float:
        return self.predicted / self.predicted_s if self.predicted_s > 0 else float("nan")

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else float("nan")


def _client(server: Server) -> Any:
    try:
        from openai import OpenAI
    except ImportError:
        raise HarnessError("the chat needs the openai package: .venv/bin/pip install openai "
                           "(or pip install -e '.[chat]')") from None
    return OpenAI(base_url=server.base + "/v1", api_key="not-needed", max_retries=0, timeout=3600)


def _delta(after: ServerMetrics, before: ServerMetrics, key: str) -> float:
    return after.server.get(key, 0.0) - before.server.get(key, 0.0)


def chat(server: Server, turns: Sequence[str], *, max_tokens: int, system: str | None = None,
         ignore_eos: bool = False, seed: int = 0) -> list[Turn]:
    """Hold the conversation: greedy answers (temperature 0), `max_tokens` at most each (exactly, with
    `ignore_eos`), llama-server's prompt cache on."""
    client = _client(server)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    out: list[Turn] = []
    for i, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        before = server.metrics()
        t0 = time.perf_counter()
        first = None
        parts: list[str] = []
        try:
            stream = client.chat.completions.create(
                model="local", messages=messages, max_tokens=max_tokens, temperature=0, seed=seed, stream=True,
                extra_body={"cache_prompt": True, "ignore_eos": ignore_eos})
            for chunk in stream:
                text = chunk.choices[0].delta.content if chunk.choices else None
                if text:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(text)
        except Exception as e:  # the client's errors (connection, HTTP status) as one line
            raise HarnessError(f"turn {i + 1}: the chat request failed ({type(e).__name__}: {e}); "
                               f"llama-server's log: {server.log_tail(400).strip()}") from None
        wall = time.perf_counter() - t0
        after = server.metrics()
        answer = "".join(parts)
        cache = None
        if after.cache is not None:
            b = before.cache.counters if before.cache is not None else {}
            cache = {k: v - b.get(k, 0) for k, v in after.cache.counters.items()}
        out.append(Turn(i + 1, user, answer, (first - t0) if first is not None else float("nan"), wall,
                        int(_delta(after, before, "prompt_tokens_total")),
                        int(_delta(after, before, "prompt_tokens_cached_total")),
                        _delta(after, before, "prompt_seconds_total"),
                        int(_delta(after, before, "tokens_predicted_total")),
                        _delta(after, before, "tokens_predicted_seconds_total"), cache))
        messages.append({"role": "assistant", "content": answer})
    return out
