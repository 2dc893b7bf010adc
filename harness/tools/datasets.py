"""Evaluation texts from public datasets, fetched once with Hugging Face `datasets` and cached as plain text.

`--dataset NAME` (wikitext-2, gsm8k, humaneval) loads the test split with the `datasets` package (optional; it
needs network the first time), renders it as one text and caches it in `$MOE_SUBST_CACHE/datasets/NAME.txt`
(default `~/.cache/moe-subst/datasets/`). Afterwards, and on a machine with no network, the cached file is used.
Without either, a one-line error says how to pass a local file instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from harness.core.errors import HarnessError
from harness.core.files import refuse_special

T = TypeVar("T")


@dataclass(frozen=True)
class DatasetSpec:
    hf_path: str
    hf_config: str | None
    split: str
    render: Callable[[Mapping[str, Any]], str]
    joiner: str
    local_hint: str


DATASETS: dict[str, DatasetSpec] = {
    # rows are the lines of wiki.test.raw, newlines included: joined, they are that file
    "wikitext-2": DatasetSpec("wikitext", "wikitext-2-raw-v1", "test", lambda r: str(r["text"]), "",
                              "wiki.test.raw of wikitext-2-raw-v1"),
    "gsm8k": DatasetSpec("openai/gsm8k", "main", "test", lambda r: f"{r['question']}\n{r['answer']}\n", "\n",
                         "the GSM8K test questions with their answers, as text"),
    "humaneval": DatasetSpec("openai/openai_humaneval", None, "test",
                             lambda r: f"{r['prompt']}{r['canonical_solution']}\n", "\n",
                             "the HumanEval prompts with their canonical solutions, as text"),
}

Loader = Callable[[DatasetSpec], Iterable[Mapping[str, Any]]]


def cache_dir() -> Path:
    base = os.environ.get("MOE_SUBST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "moe-subst")
    return Path(base) / "datasets"


def _load_with_datasets(spec: DatasetSpec) -> Iterable[Mapping[str, Any]]:
    import datasets  # optional dependency: ImportError is handled by the caller

    ds: Iterable[Mapping[str, Any]] = datasets.load_dataset(spec.hf_path, spec.hf_config, split=spec.split)
    return ds


def dataset_text(name: str, *, loader: Loader | None = None) -> Path:
    """The cached text of dataset `name`, fetching it first if needed."""
    spec = DATASETS.get(name)
    if spec is None:
        raise HarnessError(f"unknown dataset {name!r}: known are {', '.join(DATASETS)}, or pass --text FILE")
    path = cache_dir() / f"{name}.txt"
    if path.is_file() and path.stat().st_size > 0:
        return path
    offline = (f"offline, save {spec.local_hint} to a file and pass it with --text FILE (or put it at {path})")
    load = loader or _load_with_datasets
    text = _from_hub(name, offline, lambda: spec.joiner.join(spec.render(r) for r in load(spec)))
    if not text.strip():
        raise HarnessError(f"dataset {name} came back empty; {offline}")
    _write_atomic(path, text)
    return path


def _from_hub(name: str, offline: str, fetch: Callable[[], T]) -> T:
    """fetch() (a load with the `datasets` package), its failures as one-line errors ending in `offline`."""
    try:
        return fetch()
    except ImportError:
        raise HarnessError(f"--dataset {name} needs the 'datasets' package (pip install datasets) and network "
                           f"once; {offline}") from None
    except Exception as e:  # network, hub or format errors from the datasets package
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HarnessError(f"could not load {name} from the Hugging Face hub ({type(e).__name__}: {first}); "
                           f"{offline}") from None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# ---- prompts for the generation test (harness generate) --------------------------------------------------------

# a math word problem (its final number is its answer), a code stub; the beginning of a code file or of a prose
# document (agreement and degeneration only: scripts/make_domain_prompts.py, eval/data/gen-prompts-domains.jsonl)
PROMPT_KINDS = ("gsm8k", "humaneval", "code", "prose")


@dataclass(frozen=True)
class Prompt:
    """One prompt of the generation test: `kind` one of PROMPT_KINDS (gsm8k: answer agreement is measured too)."""

    id: str
    kind: str
    text: str


def _gsm8k_prompt(i: int, r: Mapping[str, Any]) -> Prompt:
    return Prompt(f"gsm8k-{i:04d}", "gsm8k", f"Question: {r['question']}\nAnswer:")


def _humaneval_prompt(i: int, r: Mapping[str, Any]) -> Prompt:
    return Prompt(str(r.get("task_id", f"humaneval-{i:04d}")).replace("/", "-"), "humaneval", str(r["prompt"]))


_PROMPT_RENDER: dict[str, Callable[[int, Mapping[str, Any]], Prompt]] = {
    "gsm8k": _gsm8k_prompt, "humaneval": _humaneval_prompt,
}


def read_prompts(path: Path) -> list[Prompt]:
    """A prompt file: JSON Lines of {"id", "kind", "text"} (eval/data/gen-prompts.jsonl), UTF-8, each text not
    empty; one-line errors naming the file and line."""
    import json

    refuse_special(path, "the prompt file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise HarnessError(f"cannot read the prompt file {path}: {e.strerror or e}") from None
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        n, col = data.count(b"\n", 0, e.start) + 1, e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise HarnessError(f"{path}:{n}: not UTF-8 (byte 0x{data[e.start]:02x} at column {col}): save the prompt "
                           "file as UTF-8") from None
    out: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            p = Prompt(str(d["id"]), str(d["kind"]), str(d["text"]))
        except (ValueError, KeyError, TypeError) as e:
            raise HarnessError(f"{path}:{n}: not a prompt record {{id, kind, text}} ({type(e).__name__})") from None
        if p.kind not in PROMPT_KINDS:
            raise HarnessError(f"{path}:{n}: kind {p.kind!r}: use {', '.join(PROMPT_KINDS)}")
        if not p.text:
            raise HarnessError(f"{path}:{n}: prompt {p.id!r} has an empty text: give it a text, or remove the line")
        out.append(p)
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        raise HarnessError(f"{path}: prompt ids repeat: each id must be unique")
    if not out:
        raise HarnessError(f"{path}: no prompts")
    return out


def write_prompts(path: Path, prompts: Iterable[Prompt]) -> None:
    import json

    _write_atomic(path, "".join(json.dumps({"id": p.id, "kind": p.kind, "text": p.text}) + "\n" for p in prompts))


def dataset_prompts(name: str, *, limit: int | None = None, loader: Loader | None = None) -> list[Prompt]:
    """The prompts of dataset `name` (gsm8k: "Question: ...\\nAnswer:"; humaneval: the function stub), fetched once
    with `datasets` and cached as a prompt file beside the texts; the first `limit` of them. Offline without a
    cached file: a one-line error pointing at the bundled prompt file."""
    if name not in _PROMPT_RENDER:
        raise HarnessError(f"no prompts for dataset {name!r}: the generation test takes {', '.join(_PROMPT_RENDER)}")
    spec = DATASETS[name]
    path = cache_dir() / f"{name}.prompts.jsonl"
    if not (path.is_file() and path.stat().st_size > 0):
        offline = (f"offline, use the bundled prompts (--prompts eval/data/gen-prompts.jsonl, the default), or save "
                   f"the {name} prompts as JSON Lines of {{id, kind, text}} to {path}")
        rows = _from_hub(name, offline, lambda: list((loader or _load_with_datasets)(spec)))
        if not rows:
            raise HarnessError(f"dataset {name} came back empty; {offline}")
        write_prompts(path, (_PROMPT_RENDER[name](i, r) for i, r in enumerate(rows)))
    prompts = read_prompts(path)
    return prompts[:limit] if limit else prompts
