"""`harness bpb`: cross-entropy per byte of a text (harness.domain.bpb), tokenizer-independent.

One llama-perplexity run of the patched build with no cache spec (the stock graph: docs/expert-cache.md, `mode`) and
`--nll-dump`, through the executor (a results folder resumes). The dump holds each scored token's id and NLL; the
token's bytes come from the model's own vocabulary (harness.parsers.vocab), so no tokenizer outside the GGUF file is
needed. The arithmetic is harness.stats.bpb.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.files import require_utf8_text
from harness.core.records import ResultsFile, prepare_out_dir
from harness.domain.bpb import MIN_CTX, BpbOptions, BpbResult, resolve_ctx
from harness.domain.plan import RunSpec
from harness.orchestration.executor import Environment, Progress, execute_runs, no_progress, safe_name
from harness.orchestration.serialise import BPB_OPTION_KEYS, bpb_fingerprint, options_json
from harness.parsers.base import ParseError
from harness.parsers.vocab import VocabBytes
from harness.stats.bpb import bits_per_byte, chunk_totals
from harness.tools.requests import Placement, Runner

DEFAULT_TEXT = Path("eval/data/heldout.txt")
CONFIG = "full"  # the one run's configuration: the whole model, no cache
PPL_AGREE = 1e-3  # relative: exp(mean NLL) of the dump against llama-perplexity's printed final estimate


def bpb_text(opts: BpbOptions, root: Path | None = None) -> Path:
    """The text a run reads (--text, else eval/data/heldout.txt); one line of HarnessError when it is missing or
    empty."""
    text = opts.text or (root or project.project_root()) / DEFAULT_TEXT
    if not text.is_file():
        raise HarnessError(f"the text {text} is missing (or not a file)")
    if text.stat().st_size == 0:
        raise HarnessError(f"the text {text} is empty")
    require_utf8_text(text, "the text")
    return text


def run_bpb(opts: BpbOptions, runner: Runner, vocab: VocabBytes, *, env: Environment | None = None,
            progress: Progress = no_progress, root: Path | None = None) -> BpbResult:
    env = env or Environment()
    text = bpb_text(opts, root)
    text_bytes = text.stat().st_size
    n_ctx, ctx_source = resolve_ctx(opts.n_ctx, vocab.n_ctx_train)
    if n_ctx < MIN_CTX:
        raise HarnessError(f"--ctx {n_ctx} is too small: at least {MIN_CTX} tokens")
    if opts.chunks is not None and opts.chunks < 0:
        raise HarnessError(f"--chunks {opts.chunks}: a count of chunks, or 0 for all")
    warnings: list[str] = []
    if vocab.n_ctx_train and n_ctx > vocab.n_ctx_train:
        warnings.append(f"--ctx {n_ctx} is beyond the model's training context of {vocab.n_ctx_train} tokens: "
                        "positions past it were never trained")
    settings = replace(opts, n_ctx=n_ctx)
    dump = opts.out / "nll" / f"{safe_name(opts.model.stem)}.bin"
    req = settings.perplexity_request(opts.model, text, Placement(), cache=None, nll_dump=dump, label=CONFIG)
    specs = [RunSpec(f"ppl:{CONFIG}", "ppl", "patched", CONFIG, None, ppl=req)]
    builds = env.builds()
    prov = env.provenance(builds, opts.argv, env.gpu())
    fp = bpb_fingerprint(opts.model, text, n_ctx, opts.chunks, dict(prov.binaries))
    results = ResultsFile(opts.out / "results.jsonl")
    try:
        outcome = execute_runs(specs, runner, builds, prov, fp, results, progress,
                               meta={"command": "bpb", "options": options_json(settings, BPB_OPTION_KEYS)})
    except ParseError as e:
        if "too short" in e.what:  # llama-perplexity needs two chunks of text (2 * n_ctx tokens)
            raise HarnessError(f"{text}: {e.what}") from None
        raise
    if outcome.interrupted:
        raise KeyboardInterrupt
    record = next((r for r in results.read() if r.get("kind") == "ppl" and r.get("config") == CONFIG), None)
    if record is None or not record.get("nll_dump"):
        raise HarnessError(f"{results.path} has no perplexity record with an NLL dump")
    nll = runner.load_nll(Path(record["nll_dump"]))
    if nll.n_ctx != n_ctx:
        raise HarnessError(f"the NLL dump {record['nll_dump']} is of a context of {nll.n_ctx}, not {n_ctx}")
    if nll.tokens.size and (int(nll.tokens.min()) < 0 or int(nll.tokens.max()) >= vocab.n_vocab):
        raise HarnessError(f"the NLL dump scores token ids outside the model's vocabulary of {vocab.n_vocab}: is it "
                           "this model's dump?")
    lengths = vocab.lengths[nll.tokens.astype(np.int64)]
    totals = chunk_totals(nll.nll, lengths, nll.chunk)
    stats = bits_per_byte(totals, n_boot=opts.n_boot, seed=opts.seed)
    ppl_tool, ppl_se = float(record["ppl"]), float(record["ppl_se"])
    if abs(stats.ppl / ppl_tool - 1) > PPL_AGREE:
        warnings.append(f"the dump's perplexity {stats.ppl:.4f} differs from llama-perplexity's own {ppl_tool:.4f} "
                        f"by more than {PPL_AGREE * 100:g}%: the dump and the run disagree")
    n_zero = int((lengths == 0).sum())
    if n_zero:
        warnings.append(f"{n_zero} scored tokens are control tokens (0 bytes): their NLL counts, their bytes do not")
    return BpbResult(options=settings, model=opts.model, text=text, text_bytes=text_bytes, n_ctx=n_ctx,
                     ctx_source=ctx_source, vocab_model=vocab.model, vocab_pre=vocab.pre, n_vocab=vocab.n_vocab,
                     n_zero_vocab=vocab.n_zero, n_zero_scored=n_zero, bpb=stats, totals=totals, ppl_tool=ppl_tool,
                     ppl_tool_se=ppl_se, results_path=results.path,
                     warnings=tuple(warnings) + tuple(outcome.notes) + tuple(results.warnings))


def bpb(opts: BpbOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
        env: Environment | None = None) -> BpbResult:
    """`harness bpb`: run (or resume) the one run; write bpb.json (the result with its per-chunk totals) and
    report.md into the results folder."""
    from harness.parsers.vocab import read_vocab_bytes
    from harness.report.bpb import render_bpb_json, render_bpb_markdown
    from harness.tools.runners import ToolRunner

    vocab = read_vocab_bytes(opts.model)  # before the folder is made: a bad model or text is one line, no folder
    bpb_text(opts)
    prepare_out_dir(opts.out)
    result = run_bpb(opts, runner or ToolRunner(), vocab, env=env, progress=progress)
    (opts.out / "bpb.json").write_text(render_bpb_json(result))
    (opts.out / "report.md").write_text(render_bpb_markdown(result))
    return result
