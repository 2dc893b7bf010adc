"""Probes of this machine for `harness doctor`: the GPUs nvidia-smi lists, nvcc, a build's version line."""

from __future__ import annotations

import shutil
import subprocess

from harness.core import project


def run_probe(argv: list[str], timeout: float = 20) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (r.stdout + r.stderr).strip()


def detect_gpus() -> tuple[str, ...]:
    if not shutil.which("nvidia-smi"):
        return ()
    out = run_probe(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    return tuple(line.strip() for line in out.splitlines() if line.strip() and "failed" not in line.lower())


def build_version(build: project.Build) -> str:
    """The first 'version:' line a tool prints (patched builds say 'moe-subst patched build')."""
    if not (build.bin_dir / "llama-cli").is_file():
        return ""
    out = run_probe([str(build.bin_dir / "llama-cli"), "--version"])
    for line in out.splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return out.splitlines()[-1] if out else ""


def nvcc_version() -> str:
    """The last line of `nvcc --version`, or "" without nvcc."""
    return run_probe(["nvcc", "--version"]).splitlines()[-1] if shutil.which("nvcc") else ""
