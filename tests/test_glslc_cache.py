"""scripts/glslc_cache.cpp, the glslc wrapper of `./build.sh --vulkan`: a compile seen before is a copy, byte for byte
what glslc writes, and two compiles that differ in anything glslc reads (the shader, a define, an included file) are
two entries. Its first version keyed the input by a placeholder alone, so every shader of a folder compiled with the
same flags was one entry: a Vulkan build whose kernels were each other's (stock's perplexity 2.9e155 on the device)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SHADER = """#version 450
#include "common.glsl"
layout(local_size_x = 64) in;
layout(binding = 0) buffer B { float v[]; };
void main() { v[gl_GlobalInvocationID.x] = OP(v[gl_GlobalInvocationID.x]) + SCALE; }
"""


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None or shutil.which("glslc") is None:
        pytest.skip("no C++ compiler or no glslc (apt-get install glslc)")
    exe = tmp_path_factory.mktemp("glslc") / "glslc-cache"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", str(ROOT / "scripts" / "glslc_cache.cpp"),
                    "-o", str(exe)], check=True, capture_output=True, text=True)
    return exe


def _tree(root: Path) -> Path:
    d = root / "vulkan-shaders"
    d.mkdir(parents=True)
    (d / "common.glsl").write_text("#define OP(x) (x * 2.0)\n")
    (d / "a.comp").write_text(SHADER)
    (d / "b.comp").write_text(SHADER.replace("OP(v[gl_GlobalInvocationID.x])", "OP(v[gl_GlobalInvocationID.x]) * 3.0"))
    return d


def _compile(exe: Path, src: Path, out: Path, env: dict[str, str], *defines: str) -> None:
    args = [str(exe), "-fshader-stage=compute", "--target-env=vulkan1.2", str(src), "-o", str(out), "-O",
            "-MD", "-MF", str(out) + ".d", *defines]
    subprocess.run(args, check=True, env=env, capture_output=True, text=True, timeout=60)


def test_a_second_tree_is_copies_and_distinct_compiles_stay_distinct(wrapper: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "MOE_SUBST_GLSLC_CACHE": str(cache), "MOE_SUBST_GLSLC": shutil.which("glslc") or "glslc"}
    one, two = _tree(tmp_path / "one"), _tree(tmp_path / "two")
    out1, out2, real = tmp_path / "out1", tmp_path / "out2", tmp_path / "real"  # outputs beside, as in a build
    for d in (out1, out2, real):
        d.mkdir()

    def spv(exe: Path, d: Path, name: str, out_dir: Path, *defines: str) -> bytes:
        out = out_dir / f"{name}-{'-'.join(defines)}.spv"
        _compile(exe, d / f"{name}.comp", out, env, *defines)
        return out.read_bytes()

    variants = [("a", "-DSCALE=1.0"), ("b", "-DSCALE=1.0"), ("a", "-DSCALE=2.0")]
    first = [spv(wrapper, one, n, out1, d) for n, d in variants]
    assert len(set(first)) == 3  # three compiles, three different kernels
    assert len(list(cache.glob("*.spv"))) == 3
    # the second tree: copies (no new entry), each what glslc itself writes there
    second = [spv(wrapper, two, n, out2, d) for n, d in variants]
    assert len(list(cache.glob("*.spv"))) == 3
    glslc = Path(env["MOE_SUBST_GLSLC"])
    assert second == [spv(glslc, two, n, real, d) for n, d in variants] == first
    # the dependency file names this tree's files, not the first tree's
    dep = (out2 / "a--DSCALE=1.0.spv.d").read_text()
    assert str(two / "common.glsl") in dep and str(one) not in dep
    # an included file changed: a new compile
    (two / "common.glsl").write_text("#define OP(x) (x * 4.0)\n")
    assert spv(wrapper, two, "a", out2, "-DSCALE=1.0") != first[0]
    assert len(list(cache.glob("*.spv"))) == 4
    # a configure-time probe (-o -) runs glslc as it is
    r = subprocess.run([str(wrapper), "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "glslang" in r.stdout + r.stderr
