"""The greedy-generation worker: `python -m harness.tools.genworker JOB.json`, run by `harness.tools.generate` in a
process of its own, whose environment points llama-cpp-python at the patched libllama (LLAMA_CPP_LIB_PATH) and
configures the expert cache (LLAMA_MOE_CACHE, without `stats=`: the worker adds one per prompt).

For every prompt of the job a fresh `llama_cpp.Llama` is made (the cache starts from its configured residency
with zero counters, so a prompt's result does not depend on the prompts before it), the prompt is evaluated and
`n_predict` tokens are chosen greedily (the argmax of the logits, no sampler: ties go to the lowest id), stopping
early at the end-of-generation token. The context is closed before the next prompt, which makes the cache write
its statistics file. One JSON line per prompt is printed: the prompt's id, its tokens, the generated tokens, their
text, and the statistics file's path.

`LLAMA_ARG_REPACK` (llama.cpp's environment form of `--repack`/`--no-repack`) is honoured as the llama.cpp tools
honour it: off, disabled, false or 0 loads the model without weight repacking (llama-cpp-python has no option for
it), which a CPU whose repack kernels fail needs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

CACHE_ENV_VAR = "LLAMA_MOE_CACHE"


def _spec_with_stats(base: str, stats: Path) -> str:
    return f"{base},stats={stats}" if base else ""


def _no_repack() -> None:
    """Every model this process loads is loaded without repacking (llama_model_params.use_extra_bufts = false)."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():  # type: ignore[no-untyped-def]
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def run_job(job: dict[str, Any]) -> None:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    if os.environ.get("LLAMA_ARG_REPACK", "") in ("off", "disabled", "false", "0"):
        _no_repack()

    base_spec = os.environ.get(CACHE_ENV_VAR, "")
    stats_dir = Path(job["stats_dir"])
    stats_dir.mkdir(parents=True, exist_ok=True)
    for p in job["prompts"]:
        stats = stats_dir / f"{p['id']}.json"
        stats.unlink(missing_ok=True)
        if base_spec:
            os.environ[CACHE_ENV_VAR] = _spec_with_stats(base_spec, stats)
        llm = Llama(model_path=job["model"], n_ctx=int(job["n_ctx"]), n_batch=int(job["n_ctx"]),
                    n_threads=int(job["threads"]), seed=0, verbose=False)
        prompt = llm.tokenize(p["text"].encode(), add_bos=True, special=False)
        eog = llm.token_eos()
        n_vocab = llm.n_vocab()
        llm.eval(prompt)
        out: list[int] = []
        for _ in range(int(job["n_predict"])):
            if llm.n_tokens >= int(job["n_ctx"]):
                break
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(logits))
            if tok == eog:
                break
            out.append(tok)
            llm.eval([tok])
        text = llm.detokenize(out).decode("utf-8", errors="replace")
        llm.close()
        print(json.dumps({"id": p["id"], "prompt_tokens": list(map(int, prompt)), "tokens": out, "text": text,
                          "stats": str(stats) if base_spec else None}), flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m harness.tools.genworker JOB.json", file=sys.stderr)
        return 2
    run_job(json.loads(Path(argv[1]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
