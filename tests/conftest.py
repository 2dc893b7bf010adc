"""Shared fixtures: generated models (harness.tools.synth) and the builds made by ./build.sh.

- `synth_models`: dict arch -> path of a default-sized random-weight MoE GGUF (f32), one per arch in
  harness.tools.synth.ARCHS, written once per session.
- `dense_model`: a tiny dense (non-MoE) qwen3 GGUF.
- `synth_text_file`: about 6 KB of deterministic English-looking text for llama-perplexity.
- `stock_build` / `patched_build`: harness.core.project.Build objects; the test is skipped (with the reason)
  when build/builds.json or the binaries are missing.
- `policy_sources`: the model-free C++ sources (spec, rules, policy, profile, budget, machine, auto) that the C++ unit
  tests compile alone, read from MOE_SUBST_POLICY_SOURCES in src/moe-subst.cmake (the one place the list is written).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from harness.core.errors import HarnessError
from harness.core.project import Build, read_builds, with_log_drain
from harness.tools.synth import ARCHS, SynthSpec, synth_text, write_dense_model, write_synth_model

# Every llama.cpp tool a test starts gets the log-drain library (see scripts/log_drain_preload.c): without it
# the stock build loses its last log lines in about half of the short runs (upstream issue 22142).
with_log_drain(os.environ)


def read_policy_sources() -> list[Path]:
    """MOE_SUBST_POLICY_SOURCES of src/moe-subst.cmake, as paths."""
    src = Path(__file__).resolve().parents[1] / "src"
    m = re.search(r"set\(MOE_SUBST_POLICY_SOURCES\s+([^)]*)\)", (src / "moe-subst.cmake").read_text())
    assert m, "src/moe-subst.cmake has no set(MOE_SUBST_POLICY_SOURCES ...)"
    paths = [src / p.replace("${MOE_SUBST_SRC}/", "") for p in m.group(1).split()]
    assert paths and all(p.is_file() for p in paths), paths
    return paths


@pytest.fixture(scope="session")
def policy_sources() -> list[Path]:
    return read_policy_sources()


@pytest.fixture(scope="session")
def synth_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("synth")
    return {arch: write_synth_model(SynthSpec(arch=arch), out / f"{arch}.gguf") for arch in ARCHS}


@pytest.fixture(scope="session")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dense_model(tmp_path_factory.mktemp("dense") / "dense-qwen3.gguf", seed=0)


@pytest.fixture(scope="session")
def synth_text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "synth.txt"
    path.write_text(synth_text(6000, seed=0))
    return path


def _build(name: str) -> Build:
    try:
        builds = read_builds()
    except HarnessError as e:
        pytest.skip(f"no usable {name} build: {e}")
    build = builds.get(name)
    if build is None:
        pytest.skip(f"the {name} build is not in build/builds.json: run ./build.sh")
    if not build.present():
        pytest.skip(f"the {name} build at {build.bin_dir} lacks some binaries: run ./build.sh")
    return build


@pytest.fixture(scope="session")
def stock_build() -> Build:
    return _build("stock")


@pytest.fixture(scope="session")
def patched_build() -> Build:
    override = _patched_override()
    return override if override is not None else _build("patched")


# ---- developer override (not used by CI) -----------------------------------------------------------
# MOE_SUBST_PATCHED_BIN=/path/to/build/bin points the `patched_build` fixture at another patched build
# (e.g. a work-in-progress clone of the patched tree) instead of the one in build/builds.json.


def _patched_override() -> Build | None:
    import os

    path = os.environ.get("MOE_SUBST_PATCHED_BIN")
    if not path:
        return None
    build = Build(name="patched", backend="cpu", bin_dir=Path(path))
    if not build.present():
        pytest.skip(f"MOE_SUBST_PATCHED_BIN={path} lacks some binaries")
    return build
