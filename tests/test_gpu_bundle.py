"""The GPU machine's path, as far as a CPU allows: it has no network, so scripts/gpu_bundle.sh packs the two trees
(.gpu/trees.tar.xz, carried there), scripts/gpu_check.sh unpacks them into a checkout without vendor/ and builds
with ./build.sh --offline --share-ggml (no pip, no download; ggml compiled once), and the harness runs from the
checkout with the pinned tree's gguf-py instead of an installed gguf package.

Here: bundle, unpack into a fresh copy of the checkout, build llama-bench offline (CPU backend; ccache makes it
quick), run both builds on a generated model, and generate that model (Q4_K_M, by the bundle build's llama-quantize)
with gguf taken from the bundle's gguf-py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core import project
from harness.core.project import Build

ROOT = project.project_root()


def _copy_checkout(dst: Path) -> None:
    """The tracked files (what travels to the GPU machine), without vendor/ trees, build/ or .venv."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    for rel in files.decode().split("\0"):
        if not rel or rel.startswith("models/"):
            continue
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


# --share-ggml builds the stock tree against the patched tree's installed ggml: other include paths than the main
# build's, so ccache shares nothing and the build costs ~6.5 minutes on 2 cores (measured 2026-12-01: 384 s of a
# 6.5-minute test). CI runs the bundle path with the usual two trees (ccache shares the objects of ./build.sh);
# MOE_SUBST_TEST_SHARE_GGML=1 runs the --share-ggml variant too (gpu_check.sh's build, on the GPU machine).
SHARE_GGML = [False] + ([True] if os.environ.get("MOE_SUBST_TEST_SHARE_GGML") == "1" else [])


@pytest.mark.build
@pytest.mark.parametrize("share_ggml", SHARE_GGML, ids=lambda v: "share-ggml" if v else "two-trees")
def test_bundle_builds_offline_and_runs(tmp_path: Path, stock_build: Build, patched_build: Build,
                                        share_ggml: bool) -> None:
    if shutil.which("xz") is None:
        pytest.skip("xz is not installed")
    bundle = tmp_path / "gpu"
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bundle.sh"), "--out", str(bundle)],
                         capture_output=True, text=True, timeout=900)
    if "uncommitted changes" in res.stderr or "not the current series" in res.stderr:
        pytest.skip("vendor/llama.cpp-patched holds work that is not exported: " + res.stderr.strip())
    assert res.returncode == 0, res.stderr
    size = (bundle / "trees.tar.xz").stat().st_size
    assert 1 << 20 < size < 24 << 20, size  # small enough to travel with the checkout (64 MiB in all)

    work = tmp_path / "checkout"
    _copy_checkout(work)
    subprocess.run(["tar", "-C", str(work), "-xJf", str(bundle / "trees.tar.xz")], check=True, timeout=300)
    patched = work / "vendor" / "llama.cpp-patched"
    assert (patched / ".moe-subst-bundle").is_file() and not (patched / ".git").exists()
    assert not (work / "vendor" / "llama.cpp" / "models" / "ggml-vocab-llama-bpe.gguf").exists()

    # no network, no pip: a python3 on PATH that is not the .venv's proves nothing extra here, so the build's
    # helpers run with this interpreter; --offline must neither create .venv nor download anything
    env = {**os.environ, "MOE_SUBST_CACHE": str(tmp_path / "no-cache")}
    res = subprocess.run(["bash", str(work / "build.sh"), "--offline", "--cpu", "--targets",
                          "llama-bench llama-quantize", *(["--share-ggml"] if share_ggml else []), "--jobs", "2"],
                         capture_output=True, text=True, timeout=1800, env=env, cwd=work)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "from a bundle of the current series" in res.stdout
    ldd = subprocess.run(["ldd", str(work / "vendor" / "llama.cpp" / "build-cpu" / "bin" / "llama-bench")],
                         capture_output=True, text=True, timeout=60).stdout
    ggml_libs = [line for line in ldd.splitlines() if "libggml" in line]
    if share_ggml:
        # the stock tools run on the ggml built once in the patched tree (its ggml/ is the stock one)
        assert ggml_libs and all("llama.cpp-patched/build-cpu/ggml-install/" in line for line in ggml_libs), ldd
    else:
        assert ggml_libs and all("vendor/llama.cpp/build-cpu/bin/" in line for line in ggml_libs), ldd
    assert not (work / ".venv").exists()
    assert not (tmp_path / "no-cache" / "llama_cpp_python-0.3.36.tar.gz").exists()

    # the harness from the checkout, gguf from the bundle's gguf-py (first on the path, as gpu_check.sh sets it)
    gguf_py = work / "vendor" / "llama.cpp" / "gguf-py"
    env_py = {**os.environ, "PYTHONPATH": f"{work}:{gguf_py}"}
    model = tmp_path / "m.gguf"
    res = subprocess.run([sys.executable, "-c", "import gguf, harness; print(gguf.__file__); print(harness.__file__)"],
                         capture_output=True, text=True, env=env_py, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(gguf_py / "gguf" / "__init__.py"), str(work / "harness" / "__init__.py")]
    # a Q4_K_M model, as gpu_check.sh makes it: f16, then the bundle build's llama-quantize (from its builds.json)
    res = subprocess.run([sys.executable, "-m", "harness", "synth", "-o", str(model), "--arch", "qwen3moe",
                          "--layers", "2", "--experts", "32", "--top-k", "4", "--embd", "256", "--ff", "256",
                          "--quantize", "Q4_K_M"],
                         capture_output=True, text=True, env=env_py, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Q4_K_M" in res.stdout and not (tmp_path / "m-f16.gguf").exists()

    stats = tmp_path / "stats.json"
    for tree, spec in (("llama.cpp", None),
                       ("llama.cpp-patched", f"mode=engine,policy=quality,slots=50%,async=thread,stats={stats}")):
        run_env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
        if spec:
            run_env["LLAMA_MOE_CACHE"] = spec
        res = subprocess.run([str(work / "vendor" / tree / "build-cpu" / "bin" / "llama-bench"), "-m", str(model),
                              "-p", "0", "-n", "8", "-r", "1", "-t", "2", "--repack", "0", "-o", "jsonl"],
                             capture_output=True, text=True, env=run_env, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert '"avg_ts"' in res.stdout
    e = json.loads(stats.read_text())["engine"]
    assert e["async"] is True and e["bank_bytes"] > 0
