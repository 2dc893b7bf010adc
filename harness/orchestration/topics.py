"""Admission after topic changes (PAPER.md, finding 4): delta-PPL in windows of tokens right after the
boundaries of eval/data/topic-shift.txt, for a policy with background admission and the same policy without.

Three emulate-mode perplexity runs on the topic-shift text (the full model, the policy, the policy with
`admit=off`), all on the same tokens. The segment boundaries (characters, eval/data/topic-shift.json) are
turned into token positions with the model's Hugging Face tokenizer, which must reproduce llama.cpp's
tokens: every scored token in the NLL dump is checked against it. A scored token is "after a topic change"
when it is among the first `window` tokens of a segment (other than the first).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.files import require_utf8_text
from harness.core.records import ResultsFile, prepare_out_dir
from harness.domain.catalogue import FULL, check_policies, is_preset, policy_cache_spec
from harness.domain.options import TopicOptions
from harness.domain.plan import RunSpec, slots_for_residency
from harness.domain.results import TopicResult, TopicRow
from harness.orchestration.compare import default_model
from harness.orchestration.executor import Environment, Progress, execute_runs, no_progress
from harness.orchestration.serialise import TOPIC_OPTION_KEYS, options_json, topics_fingerprint, warm_key
from harness.orchestration.summary import load_nlls
from harness.orchestration.warmstart import warm_start
from harness.parsers.gguf_model import ModelInfo
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import DeltaPPL, paired_delta_ppl
from harness.tools.requests import CacheSpec, PerplexityRequest, Placement, Runner

DEFAULT_TEXT = Path("eval/data/topic-shift.txt")


# ---- pure -----------------------------------------------------------------------------------------------------


def segment_starts(segments_json: dict[str, Any]) -> list[int]:
    """Character offsets where a new segment (topic) begins, the first segment excluded."""
    try:
        segs = segments_json["segments"]
        starts = sorted(int(s["char_start"]) for s in segs)
    except (KeyError, TypeError, ValueError) as e:
        raise HarnessError(f"the segments file is damaged ({type(e).__name__}: {e})") from None
    return [s for s in starts if s > 0]


def boundary_tokens(token_char_starts: Sequence[int], char_boundaries: Sequence[int]) -> list[int]:
    """For each character boundary, the index of the first token that starts at or after it."""
    starts = np.asarray(token_char_starts, dtype=np.int64)
    return [int(np.searchsorted(starts, b, side="left")) for b in char_boundaries]


def scored_positions(dump: NllDump) -> npt.NDArray[np.int64]:
    """Index, in llama.cpp's token sequence of the whole text, of every token the dump scores (the predicted
    token of position first + j of chunk c is token c * n_ctx + first + 1 + j)."""
    per = dump.n_ctx - dump.first - 1
    c = np.repeat(np.arange(dump.n_chunk, dtype=np.int64), per)
    j = np.tile(np.arange(per, dtype=np.int64), dump.n_chunk)
    return c * dump.n_ctx + dump.first + 1 + j


def align(dump: NllDump, ids: Sequence[int]) -> int:
    """The offset s (0, or 1 for a BOS that llama.cpp adds) with ids[p - s] == dump token for every scored p.
    Raises when the tokenizer does not reproduce llama.cpp's tokens."""
    pos = scored_positions(dump)
    arr = np.asarray(ids, dtype=np.int64)
    for s in (0, 1):
        idx = pos - s
        if idx.min() >= 0 and idx.max() < arr.size and np.array_equal(arr[idx], dump.tokens.astype(np.int64)):
            return s
    raise HarnessError("the tokenizer does not reproduce the tokens llama-perplexity scored: cannot place the "
                       "topic boundaries (is it the model's own tokenizer?)")


def window_mask(positions: npt.NDArray[np.int64], boundaries: Sequence[int], window: int) -> npt.NDArray[np.bool_]:
    """True for positions within `window` tokens after any boundary (boundary included)."""
    mask = np.zeros(positions.shape, dtype=bool)
    for b in boundaries:
        mask |= (positions >= b) & (positions < b + window)
    return mask


def topic_rows(full: NllDump, on: NllDump, off: NllDump, mask: npt.NDArray[np.bool_], policy: str, *,
               n_boot: int = 2000, seed: int = 0) -> tuple[TopicRow, ...]:
    chunk = full.chunk

    def sub(base: NllDump, test: NllDump, m: npt.NDArray[np.bool_]) -> DeltaPPL | None:
        if not m.any():
            return None
        return paired_delta_ppl(base.nll[m], test.nll[m], chunk[m], n_boot=n_boot, seed=seed)

    out = []
    for label, base, test in ((f"{policy} vs full", full, on), (f"{policy} admit=off vs full", full, off),
                              ("admission effect (admit on vs off)", off, on)):
        whole = paired_delta_ppl(base.nll, test.nll, chunk, n_boot=n_boot, seed=seed)
        out.append(TopicRow(label, whole, sub(base, test, mask), sub(base, test, ~mask)))
    return tuple(out)


# ---- the run --------------------------------------------------------------------------------------------------


def _tokenize(tokenizer: Path, text: str) -> tuple[list[int], list[int]]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise HarnessError("the topic-change analysis needs the `tokenizers` package (pip install "
                           "'moe-subst[train]')") from None
    enc = Tokenizer.from_file(str(tokenizer)).encode(text, add_special_tokens=False)
    return list(enc.ids), [a for a, _ in enc.offsets]


def _default_tokenizer(root: Path) -> Path:
    found = sorted((root / "models").glob("*tokenizer.json")) if (root / "models").is_dir() else []
    if len(found) != 1:
        raise HarnessError("pass --tokenizer FILE (the model's Hugging Face tokenizer.json): "
                           f"{len(found)} found in {root / 'models'}")
    return found[0]


def run_topic_shift(opts: TopicOptions, runner: Runner, info: ModelInfo, *, env: Environment | None = None,
                    progress: Progress = no_progress, root: Path | None = None) -> TopicResult:
    root = root or project.project_root()
    env = env or Environment()
    check_policies([opts.policy])
    if not is_preset(opts.policy):
        raise HarnessError(f"{opts.policy} has no admission to switch off: use quality or speed")
    model = opts.model or default_model(root)
    text = opts.text or root / DEFAULT_TEXT
    segments_path = text.with_suffix(".json")
    if not text.is_file() or not segments_path.is_file():
        raise HarnessError(f"the topic-change analysis needs {text} and its segments {segments_path}")
    require_utf8_text(text, "the text")
    tokenizer = opts.tokenizer or _default_tokenizer(root)
    slots = slots_for_residency(opts.fraction, info.n_expert, info.n_expert_used)
    placement = Placement(n_cpu_moe=info.n_layers)
    on = policy_cache_spec(opts.policy, "emulate", slots, str(opts.out / "stats" / "on.json"))
    off = replace(policy_cache_spec(opts.policy, "emulate", slots, str(opts.out / "stats" / "off.json")),
                  extra=(("admit", "off"),))

    builds = env.builds()
    prov = env.provenance(builds, opts.argv, env.gpu())
    opts = warm_start(opts, model, text, opts.out / "warm", runner, builds["patched"], info.n_expert,
                      info.n_moe_layers)

    def req(label: str, cache: CacheSpec) -> PerplexityRequest:
        return opts.perplexity_request(model, text, placement, cache=cache,
                                       nll_dump=opts.out / "nll" / f"{label}.bin", label=label)

    specs = [RunSpec("ppl:full", "ppl", "patched", FULL, None, ppl=req("full", CacheSpec("off"))),
             RunSpec("ppl:admit-on", "ppl", "patched", "admit-on", None, ppl=req("admit-on", on)),
             RunSpec("ppl:admit-off", "ppl", "patched", "admit-off", None, ppl=req("admit-off", off))]
    fp = topics_fingerprint(model, text, opts.n_ctx, opts.chunks, opts.policy, slots, dict(prov.binaries),
                            warm_key(opts))
    results = ResultsFile(opts.out / "results.jsonl")
    outcome = execute_runs(specs, runner, builds, prov, fp, results, progress,
                           meta={"command": "topics", "options": options_json(opts, TOPIC_OPTION_KEYS)})
    if outcome.interrupted:
        raise KeyboardInterrupt
    records = [r for r in results.read() if r.get("kind") == "ppl"]
    nll, warnings = load_nlls(records, runner.load_nll)
    if not all(k in nll for k in (FULL, "admit-on", "admit-off")):
        raise HarnessError("NLL dumps missing: " + "; ".join(warnings))
    full = nll[FULL]
    ids, char_starts = _tokenize(tokenizer, text.read_text())
    shift = align(full, ids)
    for k in ("admit-on", "admit-off"):
        if not np.array_equal(nll[k].tokens, full.tokens):
            raise HarnessError(f"the {k} run scored other tokens than the full model")
    starts = segment_starts(json.loads(segments_path.read_text()))
    boundaries = [b + shift for b in boundary_tokens(char_starts, starts)]
    mask = window_mask(scored_positions(full), boundaries, opts.window)
    rows = topic_rows(full, nll["admit-on"], nll["admit-off"], mask, opts.policy, n_boot=opts.n_boot, seed=opts.seed)
    return TopicResult(opts, len(boundaries), int(mask.size), int(mask.sum()), rows, results.path, tuple(warnings))


def topic_shift(opts: TopicOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
                env: Environment | None = None) -> TopicResult:
    """`harness topics`: run (or resume) the three runs, write report.md."""
    from harness.parsers.gguf_model import read_model_info
    from harness.report.markdown import render_topics_markdown
    from harness.tools.runners import ToolRunner

    prepare_out_dir(opts.out)
    opts = replace(opts, model=opts.model or default_model())
    assert opts.model is not None
    result = run_topic_shift(opts, runner or ToolRunner(), read_model_info(opts.model), env=env, progress=progress)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.md").write_text(render_topics_markdown(result))
    return result
