"""llama-cpp-python on the patched libllama, and the expert cache's counters from Python.

The bindings are the pinned sdist's own `llama_cpp` package (the version in UPSTREAM, so its ctypes signatures
are the pinned llama.h's), installed without its C++ build (`./build.sh --bindings`:
``CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" pip install <the cached sdist>``), and pointed at the patched
build's libllama by llama-cpp-python's own variable LLAMA_CPP_LIB_PATH (read once, when `llama_cpp` is imported).
LLAMA_MOE_CACHE then configures the cache as for every other tool.

    LLAMA_CPP_LIB_PATH=vendor/llama.cpp-patched/build-cpu/bin LLAMA_MOE_CACHE=policy=quality,slots=25% python -c '
    from llama_cpp import Llama; from harness.tools.bindings import cache_metrics
    llm = Llama("models/tinymoe-f16.gguf"); llm("Once upon a time", max_tokens=16); print(cache_metrics(llm))'

`cache_metrics(llm)` returns the counters llama-server reports on /metrics (`llama_expert_cache_metrics()`, parsed
by harness.parsers.cache_metrics) and `cache_props(llm)` its /props object; both None when the context has no
expert cache (LLAMA_MOE_CACHE unset or mode=off).
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.core.project import Build
from harness.parsers.cache_metrics import CacheMetrics, parse_cache_metrics

LIB_PATH_VAR = "LLAMA_CPP_LIB_PATH"  # llama-cpp-python: the folder its libllama is loaded from
INSTALL_COMMAND = "./build.sh --bindings"


def bindings_env(build: Build) -> dict[str, str]:
    """The environment that makes `import llama_cpp` load `build`'s libllama."""
    if not (build.bin_dir / "libllama.so").is_file():
        raise HarnessError(f"the {build.name} build at {build.bin_dir} has no libllama.so: run ./build.sh")
    return {LIB_PATH_VAR: str(build.bin_dir)}


def _text(llm: Any, symbol: str) -> str:
    """One of libllama's snprintf-like expert cache texts for the context of a llama_cpp.Llama."""
    import llama_cpp

    lib = llama_cpp.llama_cpp._lib
    try:
        fn: Callable[..., int] = getattr(lib, symbol)
    except AttributeError:
        raise HarnessError(f"{lib._name} has no {symbol}: llama_cpp loaded a stock libllama; set "
                           f"{LIB_PATH_VAR} to the patched build's bin folder before importing llama_cpp") from None
    fn.restype = ctypes.c_int32  # type: ignore[attr-defined]
    fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]  # type: ignore[attr-defined]
    ctx = llm.ctx
    n = int(fn(ctx, None, 0))
    if n <= 0:
        return ""
    buf = ctypes.create_string_buffer(n + 1)
    fn(ctx, buf, n + 1)
    return buf.value.decode()


def cache_metrics(llm: Any) -> CacheMetrics | None:
    """The expert cache's counters (llama-server's /metrics rows) of a llama_cpp.Llama; None without a cache."""
    text = _text(llm, "llama_expert_cache_metrics")
    return parse_cache_metrics(text) if text else None


def cache_props(llm: Any) -> dict[str, Any] | None:
    """The expert cache's configuration (llama-server's /props "moe_cache" object); None without a cache."""
    text = _text(llm, "llama_expert_cache_props")
    if not text:
        return None
    props: dict[str, Any] = json.loads(text)
    return props


def installed_bindings() -> Path | None:
    """Where the llama_cpp package is installed, or None (without importing it: that would load a libllama)."""
    from importlib.util import find_spec

    spec = find_spec("llama_cpp")
    return Path(spec.origin).parent if spec is not None and spec.origin else None
