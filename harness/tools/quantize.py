"""K-quant test models: a synthetic f16 model (harness.tools.synth) quantized by the pinned tree's llama-quantize.

The gguf package can write F32/F16/Q8_0/Q4_0 but cannot quantize to K-quants, so `write_kquant_model` writes
the model in f16 and runs `llama-quantize` (a build target of ./build.sh, in both trees) on it. K-quants pack
256 weights per super-block, so every quantized matrix row (n_embd, n_ff_exp, n_ff_shexp) must be a multiple of
256; otherwise llama-quantize would quietly fall back to other types for those tensors, and the model would not
be the K-quant it is named after, so such a spec is refused.

Q4_K_M mixes types per tensor (llama-quantize's rules, `llama_tensor_get_type`): gate/up experts in Q4_K, the
down experts of some layers (the last eighth, every third) in Q6_K, attn_v and output in Q6_K: a test of
banks that copy each tensor in its own type. Q6_K is one type for every matrix.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.project import Build, read_builds
from harness.tools.synth import SynthSpec, check_output, write_synth_model

QUANTIZE_TOOL = "llama-quantize"
KQUANTS: tuple[str, ...] = ("Q4_K_M", "Q6_K")  # llama-quantize's type names
QK_K = 256  # weights per K-quant super-block (ggml's QK_K)


def find_quantize(builds: dict[str, Build] | None = None) -> Path:
    """llama-quantize from build/builds.json: the stock build's, else the patched build's (with the cache off the
    patched library is stock, and quantizing runs no cache)."""
    builds = read_builds() if builds is None else builds
    for name in ("stock", "patched"):
        build = builds.get(name)
        if build is not None and (build.bin_dir / QUANTIZE_TOOL).is_file():
            return build.bin_dir / QUANTIZE_TOOL
    raise HarnessError(f"no {QUANTIZE_TOOL} in the builds of build/builds.json: run ./build.sh (it builds "
                       f"{QUANTIZE_TOOL}), or ./build.sh --targets \"... {QUANTIZE_TOOL}\"")


def quantize_command(tool: Path, src: Path, dst: Path, qtype: str, threads: int = 2) -> list[str]:
    return [str(tool), str(src), str(dst), qtype, str(threads)]


def check_kquant_spec(spec: SynthSpec, qtype: str) -> None:
    """Raise a HarnessError with a one-line message when `spec` cannot be made into a `qtype` model."""
    if qtype not in KQUANTS:
        raise HarnessError(f"quantize: unknown type {qtype!r}; choose one of {', '.join(KQUANTS)}")
    rows = {"n_embd": spec.n_embd, "n_ff_exp": spec.n_ff_exp}
    if spec.has_shared_expert and spec.shared_ff != spec.n_ff_exp:  # deepseek2, glm4moe: of the experts' size
        rows["n_ff_shexp"] = spec.shared_ff
    for name, n in rows.items():
        if n % QK_K:
            raise HarnessError(f"quantize: {qtype} packs {QK_K} weights per block: {name}={n} must be a multiple of "
                               f"{QK_K} (llama-quantize would fall back to another type for those tensors)")


def quantize_model(tool: Path, src: Path, dst: Path, qtype: str, *, threads: int | None = None,
                   timeout: float = 3600) -> Path:
    """Run llama-quantize src -> dst (written atomically) on `threads` threads (default: every CPU); a failure
    raises a HarnessError with its last lines."""
    dst = Path(dst)
    if threads is None:
        threads = os.cpu_count() or 2
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    res = subprocess.run(quantize_command(tool, src, tmp, qtype, threads), capture_output=True, text=True,
                         timeout=timeout, env={k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"})
    if res.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        last = "\n".join((res.stdout + res.stderr).strip().splitlines()[-8:])
        raise HarnessError(f"quantize: {tool} {qtype} failed (exit {res.returncode}):\n{last}")
    tmp.replace(dst)
    return dst


def write_kquant_model(spec: SynthSpec, qtype: str, path: str | Path, tool: Path | None = None, *,
                       replace: bool = True) -> Path:
    """Write `spec` (its dtype ignored) as f16 next to `path` (PATH.f16.part, removed after), quantize it to `qtype`
    at `path`, return the path. `replace=False`: an existing file at `path` is refused (synth.check_output)."""
    check_kquant_spec(spec, qtype)
    path = Path(path)
    check_output(path, replace=replace)
    f16 = path.with_name(path.name + ".f16.part")  # a name of its own: no user's file is overwritten, then removed
    write_synth_model(dataclasses.replace(spec, dtype="f16"), f16)
    try:
        return quantize_model(find_quantize() if tool is None else tool, f16, path, qtype)
    finally:
        f16.unlink(missing_ok=True)
