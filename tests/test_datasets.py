"""--dataset: fetched once through the `datasets` package (faked here: no network), cached, clear offline errors."""

import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from harness.core.errors import HarnessError
from harness.tools.datasets import DATASETS, DatasetSpec, dataset_text


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOE_SUBST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "datasets"


def _fake_datasets(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, str]], calls: list[tuple[Any, ...]]) -> None:
    mod = types.ModuleType("datasets")

    def load_dataset(path: str, config: str | None, split: str) -> list[dict[str, str]]:
        calls.append((path, config, split))
        return rows

    mod.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", mod)


def test_wikitext_is_the_joined_raw_lines_and_cached(monkeypatch: pytest.MonkeyPatch, _cache: Path) -> None:
    calls: list[tuple[Any, ...]] = []
    _fake_datasets(monkeypatch, [{"text": " = Title = \n"}, {"text": "\n"}, {"text": " Some prose .\n"}], calls)
    path = dataset_text("wikitext-2")
    assert path == _cache / "wikitext-2.txt"
    assert path.read_text() == " = Title = \n\n Some prose .\n"
    assert calls == [("wikitext", "wikitext-2-raw-v1", "test")]
    # second call: from the cache, no load
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert dataset_text("wikitext-2") == path
    assert len(calls) == 1


def test_gsm8k_and_humaneval_render(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    _fake_datasets(monkeypatch, [{"question": "Q1?", "answer": "A1 #### 3"}, {"question": "Q2?", "answer": "#### 4"}],
                   calls)
    assert dataset_text("gsm8k").read_text() == "Q1?\nA1 #### 3\n\nQ2?\n#### 4\n"
    _fake_datasets(monkeypatch, [{"prompt": "def f():\n", "canonical_solution": "    return 1\n"}], calls)
    assert dataset_text("humaneval").read_text() == "def f():\n    return 1\n\n"
    assert [c[0] for c in calls] == ["openai/gsm8k", "openai/openai_humaneval"]


def test_offline_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(HarnessError, match=r"needs the 'datasets' package.*--text FILE"):
        dataset_text("wikitext-2")


def test_offline_with_package() -> None:
    def failing(spec: DatasetSpec) -> Iterable[Mapping[str, Any]]:
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)\nmore detail")

    pattern = r"could not load wikitext-2 .*ConnectionError: Couldn't reach.*--text FILE"
    with pytest.raises(HarnessError, match=pattern) as e:
        dataset_text("wikitext-2", loader=failing)
    assert "\n" not in str(e.value)


def test_unknown_and_empty() -> None:
    with pytest.raises(HarnessError, match="unknown dataset 'pile'"):
        dataset_text("pile")
    with pytest.raises(HarnessError, match="came back empty"):
        dataset_text("humaneval", loader=lambda spec: [])
    assert set(DATASETS) == {"wikitext-2", "gsm8k", "humaneval"}
