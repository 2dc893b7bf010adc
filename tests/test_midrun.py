"""Faults during a run (issue 26), end to end with the patched llama-server on a generated model.

- host=file, the model file changed under a running server: truncated, or rewritten in place (even with the same
  bytes: only its modification time differs), fails every later request with "Compute aborted." and one log line
  that names the file and what changed, and the server keeps running; renamed over by another model (another inode
  at the path) or unchanged, requests keep their answers (the server still reads the file it loaded);
- the first SIGTERM or SIGINT with requests in flight writes the stats= and profile_out= files (the server itself then
  hangs, as the stock build does: upstream's shutdown waits for the requests in flight); profile_every= keeps a
  SIGKILLed server's profile; with the cache off the signal path is the stock one.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.core.project import Build
from harness.parsers.cache_stats import parse_cache_stats
from harness.tools.server import Server
from harness.tools.server import llama_server as server_tool
from harness.tools.synth import SynthSpec, write_synth_model

pytestmark = pytest.mark.build

THREADS = "2"
# fetch-all at 16 of 64 slots, one-token ubatches: every request reads missed experts from the model file
FILE_TIER = "mode=engine,policy=fetch-all,slots=16,host=file"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("midrun-models")
    for name, seed in (("a", 5), ("b", 6)):  # two models of one shape
        write_synth_model(SynthSpec(arch="qwen3moe", n_expert=64, n_expert_used=8, n_layer=2, seed=seed),
                          out / f"{name}.gguf")
    return out


@contextmanager
def llama_server(build: Build, model: Path, spec: str, log_path: Path, extra: Sequence[str] = (),
                 ctx: int = 256) -> Iterator[Server]:
    """harness.tools.server's llama-server with the cache spec, one-token ubatches and no warmup, healthy; stopped
    (SIGTERM, then SIGKILL) at the end."""
    with server_tool(build.tool("llama-server"), model, log_path, spec=spec, ctx=ctx, ready_timeout=90,
                     extra=["-ub", "1", "-t", THREADS, "--no-warmup", *extra]) as server:
        yield server


# ---- the model file changed under the file tier (issue 26, item 8) ---------------------------------------------

CHANGED = "changed after loading"


def _log_with(server: Server, text: str, timeout: float = 10.0) -> str:
    """The server's log once `text` is in it (llama.cpp's log worker writes a line after the response that it caused
    can reach the client), or as it is after `timeout` seconds: the assertions on it say what is missing."""
    deadline = time.time() + timeout
    out = server.log()
    while text not in out and time.time() < deadline and server.proc.poll() is None:
        time.sleep(0.1)
        out = server.log()
    return out


def test_host_file_truncated_after_load(model_dir: Path, tmp_path: Path, patched_build: Build) -> None:
    """host=file, the model file truncated while the server runs: the next ubatch notices its size, one line names the
    file and the sizes, and the cache ends the compute (llama_decode returns 2): the request fails with "Compute
    aborted.", the server keeps running and a second request fails the same way (never a crash or a silent wrong
    answer). The -fit probe context loads nothing, so it must not report host=file errors either."""
    model = tmp_path / "copy.gguf"
    shutil.copy(model_dir / "a.gguf", model)
    size = model.stat().st_size
    with llama_server(patched_build, model, FILE_TIER, tmp_path / "server.log") as server:
        assert server.health()[0] == 200
        os.truncate(model, size // 3)
        first, second = server.complete(), server.complete()
        assert server.proc.poll() is None  # the server still runs
        # /health says so (issue 35: it said ok while every request failed): 503 with the cache's line
        status, body = server.health()
        out = _log_with(server, CHANGED)
    assert status == 503 and CHANGED in body and "every decode now fails" in body, (status, body)
    assert "Compute aborted." in first and "Compute aborted." in second, (first, second)
    lines = [line for line in out.splitlines() if CHANGED in line]
    assert len(lines) == 1 and str(model) in lines[0], out[-3000:]
    assert f"size {size} -> {size // 3} bytes" in lines[0] and "every decode now fails" in lines[0], lines
    assert "not mapped from a file" not in out  # the -fit probe


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Truncate and write `data` into the file at `path`, keeping its inode (as `cp` over it does)."""
    ino = path.stat().st_ino
    with path.open("r+b") as f:
        f.truncate(0)
        f.write(data)
    assert path.stat().st_ino == ino and path.read_bytes() == data


def test_host_file_rewritten_in_place(model_dir: Path, tmp_path: Path, patched_build: Build) -> None:
    """Another model of the same shape and size written over the model file in place (the same inode): the size is the
    same, the modification time and the bytes are not; the file tier refuses, as for a truncated file: one line naming
    the file and its modification times, every request fails, the server keeps running. Before the change the
    requests are answered."""
    model = tmp_path / "copy.gguf"
    shutil.copy(model_dir / "a.gguf", model)
    other = (model_dir / "b.gguf").read_bytes()
    assert len(other) == model.stat().st_size and other != model.read_bytes()
    with llama_server(patched_build, model, FILE_TIER, tmp_path / "server.log") as server:
        before = [server.complete(), server.complete()]
        _rewrite_in_place(model, other)
        first, second = server.complete(), server.complete()
        assert server.proc.poll() is None
        out = _log_with(server, CHANGED)
    assert before[0].startswith("ok: ") and before[0] == before[1], before
    assert "Compute aborted." in first and "Compute aborted." in second, (first, second)
    lines = [line for line in out.splitlines() if CHANGED in line]
    assert len(lines) == 1 and str(model) in lines[0], out[-3000:]
    assert "(modified " in lines[0] and "size" not in lines[0], lines  # only the modification time changed


@pytest.mark.parametrize("how", ["touch", "same bytes"])
def test_host_file_touched_goes_on(how: str, model_dir: Path, tmp_path: Path, patched_build: Build) -> None:
    """`touch` of the model file, or its very bytes written again in place (issue 35, item 8: every later request
    failed while /health said ok): the size and the sampled bytes are unchanged, so the server goes on with one
    warning naming the file, and its answers stay the model's."""
    model = tmp_path / "copy.gguf"
    shutil.copy(model_dir / "a.gguf", model)
    with llama_server(patched_build, model, FILE_TIER, tmp_path / "server.log") as server:
        before = server.complete()
        if how == "touch":
            st = model.stat()
            os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
        else:
            _rewrite_in_place(model, model.read_bytes())
        after = [server.complete(), server.complete()]
        assert server.proc.poll() is None
        status = server.health()[0]
        out = _log_with(server, "sampled bytes")
    assert before.startswith("ok: ") and after == [before, before], (before, after)
    assert status == 200  # healthy: the file it reads is the one it loaded
    assert CHANGED not in out and "Compute aborted." not in out, out[-3000:]
    warned = [line for line in out.splitlines() if "sampled bytes" in line]
    assert len(warned) == 1 and str(model) in warned[0], out[-3000:]


def test_host_file_renamed_over(model_dir: Path, tmp_path: Path, patched_build: Build) -> None:
    """Another model of the same shape renamed over the model file (another inode at the path, as `mv` or rsync
    replace a file): the server still reads the file it loaded (its descriptors and the loader's mapping hold it,
    and nothing changed it), so the answers stay the loaded model's; one warning, once, says that the path now names
    another file. Nothing is refused."""
    model = tmp_path / "copy.gguf"
    shutil.copy(model_dir / "a.gguf", model)
    ino = model.stat().st_ino
    with llama_server(patched_build, model, FILE_TIER, tmp_path / "server.log") as server:
        before = server.complete()
        new = tmp_path / "incoming.gguf"
        shutil.copy(model_dir / "b.gguf", new)
        os.replace(new, model)
        assert model.stat().st_ino != ino
        after = [server.complete(), server.complete()]
        assert server.proc.poll() is None
        out = _log_with(server, "now names another file")
    assert before.startswith("ok: ") and after == [before, before], (before, after)
    assert CHANGED not in out and "Compute aborted." not in out, out[-3000:]
    warned = [line for line in out.splitlines() if "now names another file" in line]
    assert len(warned) == 1 and str(model) in warned[0] and f"inode {ino} -> " in warned[0], out[-3000:]


# ---- termination signals under load (issue 26, item 2) -----------------------------------------------------------

def _read_profile(path: Path) -> dict[int, list[int]]:
    """A profile_out= file (docs/expert-cache.md, "Profile files"): layer -> selection counts."""
    lines = path.read_text().splitlines()
    assert lines and lines[0] == "moe-expert-profile 1", lines[:2]
    out = {}
    for line in lines[1:]:
        tag, il, n, *counts = line.split()
        assert tag == "layer" and len(counts) == int(n), line[:80]
        out[int(il)] = [int(c) for c in counts]
    return out


def _wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():  # type: ignore[operator]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_under_load_writes_the_files(sig: signal.Signals, model_dir: Path, tmp_path: Path,
                                                  patched_build: Build) -> None:
    """Before: SIGTERM or SIGINT to llama-server with requests in flight logged "cleaning up before exit..." and
    never exited (the stock build too: its shutdown waits for the requests in flight, which wait for the stopped
    decode loop); the second signal exited 1, and the stats= and profile_out= files, written when the cache is
    destroyed, never were. Now the first signal has a thread of the cache write both (through a temporary file renamed
    over each): they appear, parse and hold the run's tokens, with the server still hanging or not."""
    stats, prof = tmp_path / "stats.json", tmp_path / "run.profile"
    spec = f"mode=engine,policy=quality,slots=25%,stats={stats},profile_out={prof}"
    with llama_server(patched_build, model_dir / "a.gguf", spec, tmp_path / "server.log",
                      extra=("-np", "4"), ctx=2048) as server:
        answers: list[str] = []

        def ask(i: int) -> None:
            try:
                answers.append(server.complete(f"request {i}: one two", 400))
            except OSError:  # the server stopped (or is killed) before answering
                pass

        clients = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(8)]
        for c in clients:
            c.start()
        _wait_for(lambda: server.log().count("processing task") >= 4, 120, "four requests in flight")
        time.sleep(1.0)  # decoding
        assert not stats.exists() and not prof.exists()
        server.proc.send_signal(sig)
        _wait_for(lambda: stats.exists() and prof.exists(), 60, "the files after the first signal: " +
                  server.log()[-2000:])
        doc = parse_cache_stats(stats.read_text())
        counts = _read_profile(prof)
        time.sleep(2.0)
        hung = server.proc.poll() is None  # upstream's hang (not asserted: a later pin may fix it)
        out = server.log()
    assert doc.tokens and doc.tokens > 0 and doc.policy == "quality", doc
    assert sorted(counts) == [0, 1] and all(sum(c) > 0 for c in counts.values()), counts
    assert f"expert cache: on a termination signal: statistics to {stats}, profile to {prof} written" in out, \
        out[-3000:]
    assert not list(tmp_path.glob("*.tmp.*"))
    print(f"server {'hung' if hung else 'exited'} after the first signal; {len(answers)} answers")


def test_profile_every_survives_sigkill(model_dir: Path, tmp_path: Path, patched_build: Build) -> None:
    """profile_every=N writes profile_out= every N tokens during the run, so that a server killed with SIGKILL (no
    signal handler, no destructor) keeps what it learned up to its last N tokens."""
    prof = tmp_path / "run.profile"
    spec = f"mode=engine,policy=quality,slots=25%,profile_out={prof},profile_every=16"
    with llama_server(patched_build, model_dir / "a.gguf", spec, tmp_path / "server.log") as server:
        assert not prof.exists()
        assert server.complete("one two three", 64).startswith("ok: ")
        _wait_for(prof.exists, 30, "the periodic profile")
        server.proc.kill()
        server.proc.wait()
    counts = _read_profile(prof)
    assert sorted(counts) == [0, 1] and all(sum(c) >= 8 * 48 for c in counts.values()), counts  # k=8, >= 48 tokens
    assert not list(tmp_path.glob("*.tmp.*"))


def test_cache_off_signal_path_is_stock(model_dir: Path, tmp_path: Path, patched_build: Build) -> None:
    """With the cache off, the first SIGTERM to an idle server exits 0 as stock does, and the cache says nothing."""
    with llama_server(patched_build, model_dir / "a.gguf", "mode=off", tmp_path / "server.log") as server:
        assert server.complete().startswith("ok: ")
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        out = server.log()
    assert "expert cache" not in out and "cleaning up before exit" in out, out[-2000:]
