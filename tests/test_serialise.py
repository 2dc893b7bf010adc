"""harness.orchestration.serialise: the meta record's options keep every field of the options (and the keys of the
files written so far, in their order), and read back to the same options."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from harness.core.sizes import Size
from harness.domain.options import CompareOptions, SweepGrid, SweepOptions, TopicOptions
from harness.orchestration.serialise import (
    COMPARE_OPTION_KEYS,
    SWEEP_GRID_KEYS,
    SWEEP_OPTION_KEYS,
    TOPIC_OPTION_KEYS,
    compare_options_from_json,
    options_json,
    sweep_options_from_json,
)


def test_every_option_is_recorded() -> None:
    # n_batch is llama-perplexity's batch: compare records it; sweep and topics always run n_batch = n_ctx
    assert set(COMPARE_OPTION_KEYS) == {f.name for f in fields(CompareOptions)}
    assert set(SWEEP_OPTION_KEYS) == {f.name for f in fields(SweepOptions)} - {"n_batch"}
    assert set(TOPIC_OPTION_KEYS) == {f.name for f in fields(TopicOptions)} - {"n_batch"}
    assert SWEEP_GRID_KEYS == tuple(f.name for f in fields(SweepGrid))


def test_compare_options_round_trip(tmp_path: Path) -> None:
    opts = CompareOptions(out=tmp_path / "o", model=tmp_path / "m.gguf", vram=Size(fraction=0.25),
                          policies=("quality", "rule-0.15"), text=tmp_path / "t.txt", runs=2, n_ctx=256, chunks=4,
                          threads=3, argv=("harness", "compare"))
    doc = options_json(opts, COMPARE_OPTION_KEYS)
    assert list(doc) == list(COMPARE_OPTION_KEYS)
    assert doc["vram"] == {"bytes": None, "fraction": 0.25} and doc["text"] == str((tmp_path / "t.txt").resolve())
    assert compare_options_from_json(doc, tmp_path / "o") == opts


def test_sweep_options_round_trip(tmp_path: Path) -> None:
    grid = SweepGrid(rules=("threshold",), taus=(0.1, 0.2), fractions=(0.5,))
    opts = SweepOptions(out=tmp_path / "o", model=tmp_path / "m.gguf", text=tmp_path / "t.txt", grid=grid, chunks=8)
    doc = options_json(opts, SWEEP_OPTION_KEYS)
    assert doc["grid"] == repr(grid)  # as the files written so far hold it; the grid is read from its own record
    assert sweep_options_from_json(doc, options_json(grid, SWEEP_GRID_KEYS), tmp_path / "o") == opts
