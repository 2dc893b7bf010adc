"""harness.core.records: the JSON Lines writer and reader."""

from __future__ import annotations

import json
import os
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


# ---- one writer per results folder ------------------------------------------------------------------------------

_WRITER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_compare import FakeEnv, FakeRunner
from harness.core.errors import HarnessError
from harness.domain.options import CompareOptions
from harness.orchestration.compare import compare

class Slow(FakeRunner):
    def bench(self, build, req):
        time.sleep(0.2)  # long enough for the two writers to overlap
        return super().bench(build, req)

tmp = Path({tmp!r})
opts = CompareOptions(out=tmp / "out", model=Path({model!r}), quality=False, policies=("quality",), runs=3,
                      argv=("harness", "compare", "--out", str(tmp / "out")))
print("start", flush=True)
try:
    compare(opts, runner=Slow(), env=FakeEnv(tmp))
except HarnessError as e:
    print(f"harness: error: {{e}}", file=sys.stderr)
    sys.exit(2)
"""


def test_two_writers_into_one_folder(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    """Before: two `harness compare --out DIR` at once both ran every configuration and appended every record
    (n=6 for --runs 3). Now the second stops at once with one line naming the first; each run is recorded once."""
    import subprocess
    import sys

    script = _WRITER.format(tests=str(Path(__file__).parent), tmp=str(tmp_path), model=str(synth_models["qwen3moe"]))
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    rcs = sorted(p.returncode for p in procs)
    assert rcs == [0, 2], outs
    loser = next(i for i, p in enumerate(procs) if p.returncode == 2)
    winner = procs[1 - loser]
    err = outs[loser][1].strip()
    assert "\n" not in err and err.startswith(f"harness: error: --out {tmp_path / 'out'} is in use by another "
                                              f"harness run (pid {winner.pid}: "), err
    assert "wait for it to finish, or pass another --out folder" in err
    keys = [r["key"] for r in ResultsFile(tmp_path / "out" / "results.jsonl").read()]
    assert sorted(keys) == sorted({*keys}) and len(keys) == 1 + 2 * 3  # the meta record, stock and quality x 3
    # the winner has exited: its lock went with it, and the folder resumes (nothing left to run)
    again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert len(ResultsFile(tmp_path / "out" / "results.jsonl").read()) == len(keys)


def test_the_lock_goes_with_a_killed_holder(tmp_path: Path) -> None:
    """A holder killed by SIGKILL leaves no stale lock (the kernel drops a dead process's flock); this process
    takes the folder then, and holding it twice in one process is fine (check runs compare into its own --out)."""
    import subprocess
    import sys

    from harness.core.records import LOCK_NAME, prepare_out_dir, release_out_dir

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from harness.core.records import prepare_out_dir; prepare_out_dir(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(300)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(HarnessError, match=rf"is in use by another harness run \(pid {holder.pid}: "):
            prepare_out_dir(out)
    finally:
        holder.kill()
        holder.wait()
    assert (out / LOCK_NAME).exists()  # left behind, but not held
    try:
        prepare_out_dir(out)
        prepare_out_dir(out)
        assert f"pid {os.getpid()}: " in (out / LOCK_NAME).read_text()
    finally:
        release_out_dir(out)
