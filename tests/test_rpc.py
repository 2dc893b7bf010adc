"""The expert cache with layers on another host through llama.cpp's RPC backend (ggml-rpc: `ggml-rpc-server` and
`--rpc`; issue 24 item 4), with `ggml-rpc-server` on 127.0.0.1. Skips only when the build lacks RPC (build.sh builds
it in both trees).

- engine mode refuses in one line naming the remote device (its banks would be on it: every fetch a network round
  trip);
- `--moe-cache auto` stays off, says why naming the device, and the output is the stock graph's (the same logits as
  the same run without the cache);
- emulate mode (no banks, no copies) runs, and takes the same decisions as on the local CPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness.core.project import Build
from harness.tools.server import free_port
from harness.tools.synth import SynthSpec, write_synth_model

RPC_SERVER = "ggml-rpc-server"


@contextmanager
def rpc_server(build: Build, log: Path) -> Iterator[str]:
    """ggml-rpc-server on loopback (its CPU device, 2 threads); yields host:port once it accepts connections."""
    exe = build.bin_dir / RPC_SERVER
    if not exe.is_file():
        pytest.skip(f"the {build.name} build has no {RPC_SERVER} (built without GGML_RPC: run ./build.sh)")
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", "2"], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.time() < deadline, "ggml-rpc-server did not listen: " + log.read_text()[-3000:]
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run(build: Build, model: Path, text: Path, tmp: Path, spec: str | None, *extra: str) -> tuple[int, str, bytes]:
    logits = tmp / "logits.bin"
    logits.unlink(missing_ok=True)
    args = [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "128", "-b", "128",
            "--chunks", "2", "-t", "2", "-ub", "1", "--kl-divergence-base", str(logits), *extra]
    if spec is not None:
        args += ["--moe-cache", spec]
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_MOE_CACHE", "LLAMA_MOE_CACHE_MACHINE_ROOT")}
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    return res.returncode, res.stdout + res.stderr, logits.read_bytes() if logits.exists() else b""


@pytest.mark.build
def test_the_cache_with_layers_on_an_rpc_device(patched_build: Build, synth_text_file: Path, tmp_path: Path) -> None:
    model = write_synth_model(SynthSpec(n_layer=2, n_expert=16, n_expert_used=2), tmp_path / "m.gguf")
    with rpc_server(patched_build, tmp_path / "rpc.log") as endpoint:
        remote = ["--rpc", endpoint, "-ngl", "99"]
        rc, out, stock = _run(patched_build, model, synth_text_file, tmp_path, None, *remote, "-lv", "4")
        assert rc == 0 and stock, out[-3000:]
        assert f"RPC0[{endpoint}] model buffer size" in out, out[-3000:]  # the layers went to the RPC device

        # engine: one line naming the device; with the experts kept in RAM (--cpu-moe) too
        for extra in ([], ["--cpu-moe"]):
            rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path, "mode=engine,policy=quality,slots=8",
                              *remote, *extra)
            lines = [ln for ln in out.splitlines() if "does not serve layers on a remote device" in ln]
            assert rc != 0 and lines, out[-3000:]
            assert endpoint in lines[0] and "(ggml-rpc)" in lines[0] and "mode=off" in lines[0], lines[0]

        # auto: off, naming the device; the stock graph's logits
        rc, out, logits = _run(patched_build, model, synth_text_file, tmp_path, "auto", *remote, "--cpu-moe")
        assert rc == 0, out[-3000:]
        auto = [ln for ln in out.splitlines() if "llama_expert_cache: auto: " in ln]
        assert len(auto) == 1 and "auto: off: MoE layers are on RPC" in auto[0] and endpoint in auto[0], out[-3000:]
        rc, out, stock_cpu_moe = _run(patched_build, model, synth_text_file, tmp_path, None, *remote, "--cpu-moe")
        assert rc == 0 and logits == stock_cpu_moe

        # emulate: runs on the remote layers, the same decisions as on the local CPU
        stats = tmp_path / "rpc.json"
        spec = "mode=emulate,policy=quality,slots=8"
        rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path, f"{spec},stats={stats}", *remote)
        assert rc == 0, out[-3000:]
    local = tmp_path / "local.json"
    rc, out, _ = _run(patched_build, model, synth_text_file, tmp_path, f"{spec},stats={local}")
    assert rc == 0, out[-3000:]
    got, want = json.loads(stats.read_text())["total"], json.loads(local.read_text())["total"]
    assert got["token_layers"] > 0 and got["misses"] > 0
    for key in ("token_layers", "hits", "misses", "substitutions", "fetches"):
        assert got[key] == want[key], (key, got, want)
