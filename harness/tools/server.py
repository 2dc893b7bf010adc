"""llama-server as a tool: started on loopback with a cache spec (or none: the stock way), waited for until
healthy, its Prometheus /metrics read, stopped by its PID (SIGTERM, then SIGKILL) however the caller leaves.

`ServerMetrics` holds llama-server's own counters (prompt tokens processed and reused from its prompt cache,
prompt and generation seconds, tokens generated) and the expert cache's rows (harness.parsers.cache_metrics),
so that a client can take per-request deltas: what a turn of a chat cost.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.parsers.cache_metrics import PREFIX, CacheMetrics, parse_cache_metrics

_ROW = re.compile(r"^llamacpp:([a-z_]+) (\S+)$")
SERVER_COUNTERS = ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                   "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total")


@dataclass(frozen=True)
class ServerMetrics:
    server: dict[str, float]  # SERVER_COUNTERS (those the server printed)
    cache: CacheMetrics | None  # None: no expert cache in this server (stock, or the cache off)


def parse_server_metrics(text: str) -> ServerMetrics:
    """llama-server's /metrics text: its own counters and the expert cache's rows."""
    server: dict[str, float] = {}
    cache_rows = []
    for line in text.splitlines():
        if line.startswith(PREFIX):
            cache_rows.append(line)
            continue
        m = _ROW.match(line.strip())
        if m and m.group(1) in SERVER_COUNTERS:
            server[m.group(1)] = float(m.group(2))
    return ServerMetrics(server, parse_cache_metrics("\n".join(cache_rows)) if cache_rows else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen  # type: ignore[type-arg]
    base: str  # http://127.0.0.1:PORT
    log_path: Path

    def metrics(self, timeout: float = 30) -> ServerMetrics:
        try:
            with urllib.request.urlopen(self.base + "/metrics", timeout=timeout) as r:
                return parse_server_metrics(r.read().decode())
        except urllib.error.URLError as e:
            raise HarnessError(f"llama-server's /metrics did not answer ({e}): {self.log_tail()}") from None

    def health(self, timeout: float = 10) -> tuple[int, str]:
        """/health's status code and body (503 with the cache's line once an expert cache failed for good)."""
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=timeout) as r:
                return int(r.status), r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode(errors="replace")
        except urllib.error.URLError as e:
            raise HarnessError(f"llama-server's /health did not answer ({e}): {self.log_tail()}") from None

    def log(self) -> str:
        """The server's whole log so far (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def log_tail(self, n: int = 2000) -> str:
        return self.log()[-n:]

    def _request(self, path: str, doc: dict[str, Any]) -> urllib.request.Request:
        return urllib.request.Request(self.base + path, data=json.dumps(doc).encode(),
                                      headers={"Content-Type": "application/json"})

    def _post(self, path: str, doc: dict[str, Any], timeout: float = 60) -> Any:
        try:
            with urllib.request.urlopen(self._request(path, doc), timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.URLError as e:
            raise HarnessError(f"llama-server's {path} did not answer ({e}): {self.log_tail()}") from None

    def truncate(self, text: str, n_tokens: int) -> str:
        """The text cut to its first n_tokens tokens of the server's model (/tokenize, /detokenize): a prompt of a
        given length whatever the model's vocabulary."""
        tokens = self._post("/tokenize", {"content": text})["tokens"]
        if len(tokens) < n_tokens:
            raise HarnessError(f"the text has {len(tokens)} tokens of this model, fewer than the {n_tokens} asked for")
        return str(self._post("/detokenize", {"tokens": tokens[:n_tokens]})["content"])

    def complete(self, prompt: str = "one two three", n_predict: int = 16, timeout: float = 180) -> str:
        """One greedy /completion of exactly n_predict tokens (the end-of-sequence token does not end it, the prompt
        cache is not used): the answer's content prefixed with "ok: ", or the body of a failed request (a request
        the cache aborted answers "Compute aborted.")."""
        req = self._request("/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                            "cache_prompt": False, "ignore_eos": True})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return "ok: " + str(json.loads(r.read())["content"])
        except urllib.error.HTTPError as e:
            return e.read().decode(errors="replace")


@contextmanager
def llama_server(binary: Path, model: Path, log_path: Path, *, spec: str | None = None, ctx: int = 2048,
                 threads: int | None = None, extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 ready_timeout: float = 300, preexec: Callable[[], None] | None = None) -> Iterator[Server]:
    """llama-server on 127.0.0.1 with /metrics, `--moe-cache SPEC` when a spec is given (LLAMA_MOE_CACHE is removed
    from its environment either way), healthy before this yields; stopped at the end. A server that exits or does
    not become healthy in `ready_timeout` seconds is a one-line HarnessError with its log's tail. `preexec` runs in
    the child before exec (harness.tools.cgroup.MemoryCgroup.preexec: the server inside a memory limit)."""
    if not binary.is_file():
        raise HarnessError(f"no llama-server at {binary}: run ./build.sh")
    port = free_port()
    base_env = {k: v for k, v in (env if env is not None else os.environ).items() if k != "LLAMA_MOE_CACHE"}
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx), "--metrics",
           *(["-t", str(threads)] if threads else []), *extra, *(["--moe-cache", spec] if spec else [])]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=base_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=preexec)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                with urllib.request.urlopen(server.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                raise HarnessError(f"llama-server exited with status {proc.returncode} before it was ready: "
                                   + server.log_tail(600).strip().replace("\n", " | "))
            if time.monotonic() > deadline:
                raise HarnessError(f"llama-server was not ready after {ready_timeout:.0f} s: "
                                   + server.log_tail(600).strip().replace("\n", " | "))
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
