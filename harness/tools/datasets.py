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
from typing import Any

from harness.core.errors import HarnessError


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
    try:
        rows = (loader or _load_with_datasets)(spec)
        text = spec.joiner.join(spec.render(r) for r in rows)
    except ImportError:
        raise HarnessError(f"--dataset {name} needs the 'datasets' package (pip install datasets) and network "
                           f"once; {offline}") from None
    except Exception as e:  # network, hub or format errors from the datasets package
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HarnessError(f"could not load {name} from the Hugging Face hub ({type(e).__name__}: {first}); "
                           f"{offline}") from None
    if not text.strip():
        raise HarnessError(f"dataset {name} came back empty; {offline}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
