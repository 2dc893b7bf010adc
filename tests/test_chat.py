"""A chat that stays stock (issue 24, item 3): llama-server, patched with the cache on and stock, driven by a real
OpenAI-compatible client (the `openai` package, harness.tools.chat) over loopback through a 3-turn conversation
with llama-server's prompt cache on. With fetch-all the answers are stock's turn by turn; the prompt cache reuses
the conversation; the cache's counters move every turn; /metrics parses.

Skipped, with the reason, when the openai package is not installed (pip install -e '.[dev]' installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.core.project import Build, project_root
from harness.parsers.cache_metrics import PREFIX
from harness.tools.server import parse_server_metrics

ROOT = project_root()
MODEL = ROOT / "models" / "tinymoe-f16.gguf"
TURNS = ("Write a Python function that adds two numbers.", "Now make it multiply them instead.",
         "Explain what the function returns.")
MAX_TOKENS = 12


def test_server_metrics_are_parsed() -> None:
    text = ("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed\n"
            "# TYPE llamacpp:prompt_tokens_total counter\n"
            "llamacpp:prompt_tokens_total 40\nllamacpp:prompt_tokens_cached_total 12\n"
            "llamacpp:tokens_predicted_seconds_total 0.5\nllamacpp:requests_processing 0\n"
            f"{PREFIX}calls_total 96\n{PREFIX}hits_total 80\n{PREFIX}slots 16\n{PREFIX}bank_bytes 4096\n")
    m = parse_server_metrics(text)
    assert m.server == {"prompt_tokens_total": 40, "prompt_tokens_cached_total": 12,
                        "tokens_predicted_seconds_total": 0.5}
    assert m.cache is not None and m.cache.counters["calls"] == 96 and m.cache.slots == 16
    assert parse_server_metrics("llamacpp:prompt_tokens_total 3\n").cache is None


@pytest.mark.build
def test_a_three_turn_chat_is_stocks_with_fetch_all(tmp_path: Path, stock_build: Build, patched_build: Build) -> None:
    pytest.importorskip("openai", reason="the chat test needs the openai package: pip install -e '.[dev]'")
    from harness.tools.chat import chat
    from harness.tools.server import llama_server

    if not MODEL.is_file():
        pytest.skip(f"{MODEL} is missing")
    common = {"ctx": 1024, "threads": 2}
    with llama_server(stock_build.tool("llama-server"), MODEL, tmp_path / "stock.log", **common) as s:
        ref = chat(s, TURNS, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert s.metrics().cache is None  # stock has no cache rows
    with llama_server(patched_build.tool("llama-server"), MODEL, tmp_path / "patched.log",
                      spec="mode=engine,policy=fetch-all,slots=25%", **common) as s:
        got = chat(s, TURNS, max_tokens=MAX_TOKENS, ignore_eos=True)

    assert all(t.answer for t in ref)
    assert [t.answer for t in got] == [t.answer for t in ref]
    for t in (*ref, *got):
        assert t.predicted == MAX_TOKENS and t.predicted_s > 0 and t.ttft_s == t.ttft_s  # not nan
    # the prompt cache: each later turn reuses the conversation so far and processes only what is new
    for turns in (ref, got):
        assert turns[0].prompt_cached == 0
        assert 0 < turns[1].prompt_cached < turns[2].prompt_cached
        assert turns[2].prompt_tokens < turns[2].prompt_cached
    # the expert cache works every turn: routed calls, misses fetched (fetch-all substitutes none)
    for t in got:
        assert t.cache is not None
        assert t.cache["calls"] > 0 and t.cache["fetches"] > 0 and t.cache["substitutions"] == 0
