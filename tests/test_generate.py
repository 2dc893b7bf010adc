"""The generation test (harness generate): agreement counting, answer extraction, the prompt files and the datasets'
offline message, the summary on hand-made generations, and one small run on the trained model (2 prompts x 2
policies) in which fetch-all must reproduce the full model's tokens exactly."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.project import project_root
from harness.domain.catalogue import FULL
from harness.domain.generation import GenerateOptions, fetches_first_choice, outcomes, summarize
from harness.parsers.generation import final_number, parse_generations
from harness.stats.agreement import agreeing_prefix, bootstrap_mean, identical, wilson
from harness.tools import datasets
from harness.tools.datasets import Prompt, dataset_prompts, read_prompts

ROOT = project_root()
MODEL = ROOT / "models" / "tinymoe-f16.gguf"


def test_tokens_until_the_first_divergence() -> None:
    assert agreeing_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert agreeing_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert agreeing_prefix([1, 2, 3, 4], [7, 2, 3, 4]) == 0
    assert agreeing_prefix([1, 2, 3, 4], [1, 2]) == 2  # stopped early: diverges where it ends
    assert agreeing_prefix([1, 2], [1, 2, 3]) == 2
    assert agreeing_prefix([], []) == 0
    assert identical([1, 2], [1, 2]) and not identical([1, 2], [1, 2, 3]) and not identical([1, 2], [2, 1])


def test_wilson_and_bootstrap_intervals() -> None:
    p = wilson(8, 10)
    assert p.share == 0.8 and 0.44 < p.low < 0.5 and 0.94 < p.high < 0.97  # the textbook 0.490, 0.943
    assert wilson(10, 10).high == 1.0 and wilson(10, 10).low < 1.0
    assert wilson(0, 10).low == 0.0 and wilson(0, 10).high > 0.0
    assert math.isnan(wilson(0, 0).low)
    with pytest.raises(HarnessError):
        wilson(3, 2)
    b = bootstrap_mean([0, 10, 20, 30], seed=1)
    assert b.mean == 15 and 0 <= b.low < 15 < b.high <= 30
    assert bootstrap_mean([5.0, 5.0]).low == 5.0
    assert math.isnan(bootstrap_mean([5.0]).low)


@pytest.mark.parametrize(("text", "want"), [
    (" 2 + 1 = 3. The answer is 3.", "3"),
    ("He has 1,250 dollars, then spends 50.", "50"),
    ("Total: 1,250", "1250"),
    ("#### 72", "72"),
    (" 1.19200000000000000000000000000", "1.192"),
    ("it costs 7.0 dollars", "7"),
    ("the loss is -4 points", "-4"),
    ("The\nThe\nThe", None),
    ("", None),
    ("version v2", None),  # digits inside a word are not a number
    (" 1.1.1200000000000000000000000000000000000000000", "1.1"),  # "1.12..." follows a number: not one of its own
    (" 1" + "2" * 60, "1" + "2" * 60),  # any length, no rounding
    ("0.50 and 007", "7"),
    ("-0.0", "0"),
])
def test_the_final_number(text: str, want: str | None) -> None:
    assert final_number(text) == want


def test_worker_output_is_parsed_or_refused() -> None:
    line = json.dumps({"id": "a", "prompt_tokens": [1, 2], "tokens": [3], "text": "x", "stats": None})
    (g,) = parse_generations(line + "\n\n")
    assert g.id == "a" and g.tokens == (3,) and g.stats is None
    with pytest.raises(HarnessError, match="not a generation record"):
        parse_generations("llama: some log line")


def _gen(tokens: list[int], text: str = "", mass: float | None = 0.0) -> dict[str, object]:
    return {"tokens": tokens, "text": text, "mass": mass}


def test_summary_counts_agreement_per_kind() -> None:
    prompts = [Prompt("m1", "gsm8k", "q1"), Prompt("m2", "gsm8k", "q2"), Prompt("m3", "gsm8k", "q3"),
               Prompt("c1", "humaneval", "def f():")]
    runs = {
        FULL: {"m1": _gen([1, 2, 3], "is 5"), "m2": _gen([4, 5], "no number"), "m3": _gen([6], "7"),
               "c1": _gen([7, 8, 9, 10])},
        "fetch-all": {"m1": _gen([1, 2, 3], "is 5"), "m2": _gen([4, 5], "no number"), "m3": _gen([6], "7"),
                      "c1": _gen([7, 8, 9, 10])},
        "substitute-all": {"m1": _gen([1, 9, 9], "is 6", 0.7), "m2": _gen([4, 5], "no number", 0.7),
                           "m3": _gen([0], "7", 0.8), "c1": _gen([7, 8, 0], mass=0.9)},
    }
    o = outcomes(prompts, runs[FULL], runs["substitute-all"])
    assert [x.prefix for x in o] == [1, 2, 0, 2] and [x.same for x in o] == [False, True, False, False]
    assert [x.answer for x in o[:3]] == ["6", None, "7"] and o[0].answer_ref == "5"
    rows, corr, _ = summarize(prompts, runs, ["fetch-all", "substitute-all"])
    by = {(r.policy, r.kind): r for r in rows}
    fa, sa = by[("fetch-all", "gsm8k")], by[("substitute-all", "gsm8k")]
    assert fa.same.k == fa.same.n == 3 and fa.answers is not None and fa.answers.k == fa.answers.n == 2
    # answers over the prompts where the full model has a number (m1, m3): m3 agrees, m1 does not
    assert sa.answers is not None and (sa.answers.k, sa.answers.n) == (1, 2)
    assert sa.prefix.mean == 1.0 and sa.same.k == 1 and sa.mass == pytest.approx(0.7333, abs=1e-4)
    assert by[("substitute-all", "humaneval")].answers is None and by[("substitute-all", "all")].n == 4
    # two policies, one of them fetching the first choice: no correlation, with the reason
    assert all(c.correlation is None and "at least 4" in c.note for c in corr)


def test_first_choice_fetching_policies() -> None:
    assert all(fetches_first_choice(p) for p in ("fetch-all", "rule-0.15", "first-choice", "quality", "speed",
                                                  "rule-0.05"))
    assert not fetches_first_choice("substitute-all")


def test_the_bundled_prompts() -> None:
    prompts = read_prompts(ROOT / "eval" / "data" / "gen-prompts.jsonl")
    assert len(prompts) == 40
    assert sum(p.kind == "gsm8k" for p in prompts) == 20 and sum(p.kind == "humaneval" for p in prompts) == 20
    assert all(p.text.endswith("Answer:") for p in prompts if p.kind == "gsm8k")


def test_prompt_file_errors(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "kind": "essay", "text": "x"}\n')
    with pytest.raises(HarnessError, match="kind 'essay'"):
        read_prompts(f)
    f.write_text('{"id": "a", "kind": "gsm8k", "text": "x"}\n{"id": "a", "kind": "gsm8k", "text": "y"}\n')
    with pytest.raises(HarnessError, match="repeat"):
        read_prompts(f)
    f.write_text("not json\n")
    with pytest.raises(HarnessError, match=r"p.jsonl:1: not a prompt record"):
        read_prompts(f)
    with pytest.raises(HarnessError, match="cannot read the prompt file"):
        read_prompts(tmp_path / "missing.jsonl")


def test_prompt_file_not_utf8_or_with_an_empty_prompt_names_the_line(tmp_path: Path) -> None:
    """Before, a non-UTF-8 prompt file was a UnicodeDecodeError traceback and an empty prompt reached the worker;
    now each is one line naming the file and the line."""
    f = tmp_path / "p.jsonl"
    good = b'{"id": "a", "kind": "prose", "text": "x"}\n'
    f.write_bytes(good + b'\n{"id": "b", "kind": "prose", "text": "caf\xe9"}\n')
    with pytest.raises(HarnessError) as e:
        read_prompts(f)
    assert str(e.value) == f"{f}:3: not UTF-8 (byte 0xe9 at column 42): save the prompt file as UTF-8"
    f.write_bytes(good + b'{"id": "b", "kind": "gsm8k", "text": ""}\n')
    with pytest.raises(HarnessError) as e:
        read_prompts(f)
    assert str(e.value) == f"{f}:2: prompt 'b' has an empty text: give it a text, or remove the line"
    f.write_bytes(good + '{"id": "c", "kind": "prose", "text": "caf\u00e9 \u2028 ok"}\r\n'.encode())
    assert [p.text for p in read_prompts(f)] == ["x", "caf\u00e9 \u2028 ok"]  # U+2028 inside a text is no line end


@pytest.mark.parametrize("bad", [b'{"id": "a", "kind": "prose", "text": "\xff"}\n',
                                 b'{"id": "a", "kind": "prose", "text": ""}\n'])
def test_generate_with_a_bad_prompt_file_is_one_line(tmp_path: Path, bad: bytes,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`harness generate --prompts BAD`: exit 2 and one line on stderr naming the file and line, no traceback."""
    from harness.cli import main
    from harness.tools.synth import SynthSpec, write_synth_model

    model = write_synth_model(SynthSpec(n_expert=8, n_expert_used=2), tmp_path / "m.gguf")
    prompts = tmp_path / "bad.jsonl"
    prompts.write_bytes(bad)
    assert main(["generate", "--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"harness: error: {prompts}:1: ") and "\n" not in err, err


def test_dataset_prompts_offline_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_SUBST_CACHE", str(tmp_path))

    def offline(spec: datasets.DatasetSpec) -> list[dict[str, str]]:
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    with pytest.raises(HarnessError) as e:
        dataset_prompts("gsm8k", loader=offline)
    msg = str(e.value)
    assert "could not load gsm8k" in msg and "offline, use the bundled prompts" in msg
    assert "eval/data/gen-prompts.jsonl" in msg and "\n" not in msg

    def no_package(spec: datasets.DatasetSpec) -> list[dict[str, str]]:
        raise ImportError("datasets")

    with pytest.raises(HarnessError, match="needs the 'datasets' package"):
        dataset_prompts("humaneval", loader=no_package)
    with pytest.raises(HarnessError, match="no prompts for dataset 'wikitext-2'"):
        dataset_prompts("wikitext-2")


def test_dataset_prompts_are_rendered_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_SUBST_CACHE", str(tmp_path))
    rows = [{"question": "What is 2 + 2?", "answer": "#### 4"}, {"question": "And 3 + 3?", "answer": "#### 6"}]
    got = dataset_prompts("gsm8k", loader=lambda spec: rows, limit=1)
    assert got == [Prompt("gsm8k-0000", "gsm8k", "Question: What is 2 + 2?\nAnswer:")]

    def fail(spec: datasets.DatasetSpec) -> list[dict[str, str]]:
        raise AssertionError("the cached prompts were not used")

    assert len(dataset_prompts("gsm8k", loader=fail)) == 2  # the cache, no fetch
    he = dataset_prompts("humaneval", loader=lambda spec: [{"task_id": "HumanEval/0", "prompt": "def f():\n"}])
    assert he == [Prompt("HumanEval-0", "humaneval", "def f():\n")]


def test_generation_on_the_trained_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 prompts x 2 policies through the real worker: fetch-all equals the full model token for token. The results
    folder is relative (as `--out eval/...` gives it): the worker, which runs in a folder of its own, still writes
    the statistics there."""
    from harness.tools.bindings import installed_bindings

    if installed_bindings() is None:
        pytest.skip(f"llama-cpp-python is not installed for {sys.executable}: ./build.sh --bindings")
    from harness.orchestration.generation import run_generation
    from harness.parsers.gguf_model import read_model_info

    all_prompts = read_prompts(ROOT / "eval" / "data" / "gen-prompts.jsonl")
    two = [all_prompts[0], next(p for p in all_prompts if p.kind == "humaneval")]
    pf = tmp_path / "two.jsonl"
    datasets.write_prompts(pf, two)
    monkeypatch.chdir(tmp_path)
    opts = GenerateOptions(out=Path("gen"), model=MODEL, prompts=pf, policies=("fetch-all", "substitute-all"),
                           n_predict=16, threads=2)
    opts.out.mkdir()
    res = run_generation(opts, read_model_info(MODEL))
    by = {(r.policy, r.kind): r for r in res.rows}
    fa, sa = by[("fetch-all", "all")], by[("substitute-all", "all")]
    assert fa.n == 2 and fa.same.k == 2 and not res.warnings
    assert all(o.prefix == o.n_ref > 0 for o in res.outcomes["fetch-all"])
    assert fa.mass == 0.0 and sa.mass is not None and sa.mass > 0.5  # 16 of 64 resident: most misses substituted
    assert sa.prefix.mean < fa.prefix.mean  # substituting every miss changes the greedy tokens
    # resumed: nothing runs again
    lines = (opts.out / "results.jsonl").read_text().splitlines()
    assert [json.loads(x)["key"] for x in lines] == ["meta", "gen:full", "gen:fetch-all", "gen:substitute-all"]
    again = run_generation(opts, read_model_info(MODEL))
    assert (opts.out / "results.jsonl").read_text().splitlines() == lines and again.rows == res.rows


@pytest.mark.parametrize(("tokens", "loop"), [
    ([5] * 16, (1, 16)),  # "0000..." : one token over and over
    ([9, 8] + [1, 2, 3, 4, 5] * 4, (5, 20)),  # a 5-token line, four times to the end
    ([1, 2, 3] * 5 + [7], None),  # a loop the generation left
    ([1, 2, 3, 4, 5, 6] * 2, None),  # two periods are not a loop
    (list(range(48)), None),  # no repetition
    ([3, 1, 4, 1, 5, 9, 2, 6] * 2 + [3, 1, 4, 1, 5, 9, 2, 6] * 1, (8, 24)),  # 3 periods of 8, span 24 >= 16
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11] * 2 + [1], None),  # period 11 needs 33 tokens
    ([], None),
])
def test_a_generation_degenerates_when_it_ends_in_a_loop(tokens: list[int], loop: tuple[int, int] | None) -> None:
    from harness.stats.degeneration import Loop, degenerates, loop_tail

    got = loop_tail(tokens)
    assert got == (None if loop is None else Loop(*loop))
    assert degenerates(tokens) is (loop is not None)


def test_the_full_models_degenerate_generations_per_kind() -> None:
    from harness.domain.generation import degeneration

    prompts = [Prompt("c1", "code", "def f():"), Prompt("c2", "code", "import os"), Prompt("p1", "prose", "NAME")]
    full = {"c1": _gen([7] * 20), "c2": _gen(list(range(30))), "p1": _gen([1, 2] * 10)}
    by = {d.kind: d for d in degeneration(prompts, full)}
    assert (by["code"].share.k, by["code"].share.n, by["code"].ids) == (1, 2, ("c1",))
    assert (by["prose"].share.k, by["prose"].share.n) == (1, 1) and by["all"].share.k == 2


def test_rows_over_the_prompts_that_do_not_loop() -> None:
    """A policy that falls into the full model's loop agrees to the end: the "not looping" rows leave such prompts
    out (here l1 loops with period 2 over 24 tokens and agrees fully; c1 does not loop and diverges at once)."""
    from harness.domain.generation import NOT_LOOPING

    loop = [5, 6] * 12
    prompts = [Prompt("l1", "humaneval", "def f():"), Prompt("c1", "humaneval", "def g():")]
    runs = {FULL: {"l1": _gen(loop), "c1": _gen(list(range(20, 44)))},
            "substitute-all": {"l1": _gen(loop, mass=0.5), "c1": _gen([0] + list(range(21, 44)), mass=0.5)}}
    rows, _, _ = summarize(prompts, runs, ["substitute-all"])
    by = {r.kind: r for r in rows}
    assert by["humaneval"].n == 2 and by["humaneval"].prefix.mean == 12.0  # (24 + 0) / 2, inflated by the loop
    assert by[NOT_LOOPING].n == 1 and by[NOT_LOOPING].prefix.mean == 0.0
    no_loop = {FULL: {"c1": runs[FULL]["c1"]}, "substitute-all": {"c1": runs["substitute-all"]["c1"]}}
    rows, _, _ = summarize(prompts[1:], no_loop, ["substitute-all"])
    assert NOT_LOOPING not in {r.kind for r in rows}  # nothing loops: no extra rows
