"""harness.core.records: the JSON Lines writer and reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.records import SCHEMA_VERSION, Provenance, ResultsFile, make_record

PROV = Provenance("llama-cpp-python-0.3.36", "ab" * 32, "0123456789abcdef", {"stock/llama-bench": "ff" * 8}, "cpu",
                  "none", ("harness", "compare"), "2026-11-29T00:00:00+00:00")


def test_records_carry_schema_provenance_and_raw_samples(tmp_path: Path) -> None:
    f = ResultsFile(tmp_path / "r" / "results.jsonl")
    f.append(make_record("bench:stock:0", "bench", PROV, {"config": "stock", "tests": [{"samples_ns": [5, 6]}]},
                         started="2026-11-29T00:00:01+00:00"))
    f.append(make_record("bench:quality:0", "bench", PROV, {"config": "quality"}))
    lines = (tmp_path / "r" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[0])
    assert rec["schema_version"] == SCHEMA_VERSION and rec["key"] == "bench:stock:0" and rec["kind"] == "bench"
    assert rec["tests"][0]["samples_ns"] == [5, 6]
    assert rec["provenance"]["patch_series"] == "0123456789abcdef"
    assert rec["provenance"]["binaries"] == {"stock/llama-bench": "ff" * 8}
    assert rec["provenance"]["argv"] == ["harness", "compare"] and rec["provenance"]["gpu"] == "none"
    assert rec["started"] < rec["finished"]
    assert f.finished_keys() == {"bench:stock:0", "bench:quality:0"}


def test_append_only_across_writers(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    ResultsFile(path).append(make_record("a", "x", PROV, {}))
    ResultsFile(path).append(make_record("b", "x", PROV, {}))
    assert [r["key"] for r in ResultsFile(path).read()] == ["a", "b"]


def test_reserved_fields_and_non_json_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="may not set 'key'"):
        make_record("a", "x", PROV, {"key": "b"})
    with pytest.raises(ValueError):
        ResultsFile(tmp_path / "r.jsonl").append(make_record("a", "x", PROV, {"ppl": float("nan")}))
    with pytest.raises(ValueError, match="schema_version"):
        ResultsFile(tmp_path / "r.jsonl").append({"key": "a"})


def test_torn_lines_are_skipped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    f = ResultsFile(path)
    f.append(make_record("a", "x", PROV, {}))
    with path.open("a") as fh:
        fh.write('{"schema_version": 1, "key": "b", "ki')
    assert [r["key"] for r in f.read()] == ["a"]
    assert len(f.warnings) == 1 and "damaged record" in f.warnings[0]


def test_another_schema_version_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"schema_version": 99, "key": "a"}) + "\n")
    with pytest.raises(HarnessError, match="schema_version 99.*new --out"):
        ResultsFile(path).read()


def test_missing_file_reads_empty(tmp_path: Path) -> None:
    assert ResultsFile(tmp_path / "none.jsonl").read() == []


def test_a_torn_last_line_is_dropped_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    f = ResultsFile(path)
    f.append(make_record("a", "x", PROV, {}))
    good = path.read_bytes()
    with path.open("a") as fh:
        fh.write('{"schema_version": 1, "key": "b", "ki')  # killed mid-write
    assert f.drop_torn_tail() is True
    assert path.read_bytes() == good  # truncated to the end of the last good line
    f.append(make_record("b", "x", PROV, {}))
    assert [r["key"] for r in f.read()] == ["a", "b"] and f.warnings == []
    assert f.drop_torn_tail() is False and len(path.read_text().splitlines()) == 2


def test_a_damaged_line_before_the_last_is_kept_and_skipped(tmp_path: Path) -> None:
    """Only the last line can be torn by an interrupted append; damage elsewhere is left for the user to see."""
    path = tmp_path / "results.jsonl"
    f = ResultsFile(path)
    f.append(make_record("a", "x", PROV, {}))
    with path.open("a") as fh:
        fh.write("{not json\n")
    f.append(make_record("c", "x", PROV, {}))
    before = path.read_bytes()
    assert f.drop_torn_tail() is False and path.read_bytes() == before
    assert [r["key"] for r in f.read()] == ["a", "c"]
    assert len(f.warnings) == 1 and ":2: damaged record" in f.warnings[0]


def test_a_complete_last_record_without_its_newline_gets_one(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    f = ResultsFile(path)
    f.append(make_record("a", "x", PROV, {}))
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # killed between the record and its newline
    assert f.drop_torn_tail() is False
    f.append(make_record("b", "x", PROV, {}))
    assert [r["key"] for r in f.read()] == ["a", "b"]


def test_an_undecodable_line_is_a_damaged_record(tmp_path: Path) -> None:
    """Before: one non-UTF-8 byte in results.jsonl made `harness report` and a resuming `harness compare` die with
    UnicodeDecodeError. Now that line is skipped with the warning a torn line gets, the others are read."""
    path = tmp_path / "results.jsonl"
    f = ResultsFile(path)
    f.append(make_record("a", "x", PROV, {}))
    f.append(make_record("b", "x", PROV, {}))
    f.append(make_record("c", "x", PROV, {}))
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"b"', b'"\xff"')  # a flipped bit: not UTF-8 any more
    path.write_bytes(b"\n".join(lines))
    assert [r["key"] for r in f.read()] == ["a", "c"]
    assert len(f.warnings) == 1 and ":2: damaged record skipped" in f.warnings[0]
    # as the last line it is torn: a resumed run drops it, and appends after the good records
    path.write_bytes(b"\n".join([lines[0], lines[2], lines[1]]) + b"\n")
    assert f.drop_torn_tail() is True
    assert [r["key"] for r in f.read()] == ["a", "c"] and f.warnings == []


def test_an_unreadable_results_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error (EIO) reading results.jsonl: one line of HarnessError naming the file, not an OSError."""
    import errno

    path = tmp_path / "results.jsonl"
    f = ResultsFile(path)
    f.append(make_record("a", "x", PROV, {}))

    def eio(self: Path) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Path, "read_bytes", eio)
    for call in (f.read, f.drop_torn_tail):
        with pytest.raises(HarnessError) as e:
            call()
        assert str(e.value) == f"cannot read the results {path}: Input/output error"
