"""Where things are: the project root, the pin (UPSTREAM), the patch series, the builds made by build.sh."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from harness.core.errors import BuildMissingError, HarnessError

BUILD_NAMES = ("stock", "patched")
TOOLS = ("llama-cli", "llama-server", "llama-perplexity", "llama-bench")


def project_root() -> Path:
    """The checkout this package was installed from (editable install), or MOE_SUBST_ROOT."""
    env = os.environ.get("MOE_SUBST_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parents[2]  # harness/core/project.py -> the checkout
    if (here / "UPSTREAM").is_file():
        return here
    raise HarnessError("cannot find the moe-subst checkout: set MOE_SUBST_ROOT to it")


@dataclass(frozen=True)
class Pin:
    version: str
    sha256: str

    @property
    def name(self) -> str:
        return f"llama-cpp-python-{self.version}"


def read_pin(root: Path | None = None) -> Pin:
    """Parse UPSTREAM (shell-style KEY=VALUE lines, # comments)."""
    path = (root or project_root()) / "UPSTREAM"
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise HarnessError(f"{path}: not a KEY=VALUE line: {line!r}")
        values[key.strip()] = value.strip()
    try:
        return Pin(values["LLAMA_CPP_PYTHON_VERSION"], values["LLAMA_CPP_PYTHON_SHA256"])
    except KeyError as e:
        raise HarnessError(f"{path}: missing {e.args[0]}") from None


def patch_series(root: Path | None = None) -> list[Path]:
    return sorted(((root or project_root()) / "patches").glob("*.patch"))


def compat_series(root: Path | None = None) -> list[Path]:
    """patches/compat/: build-compatibility patches applied to the stock and the patched tree alike."""
    return sorted(((root or project_root()) / "patches" / "compat").glob("*.patch"))


def patch_series_hash(root: Path | None = None) -> str:
    """The same hash scripts/patches.sh prints: sha256 of the concatenated compat series, the series and then of our
    C++ sources (src/, every file in byte order of its path), 16 hex digits: what the patched tree's code is made of."""
    files = compat_series(root) + patch_series(root)
    if not files:
        return "none"
    src = (root or project_root()) / "src"
    files += sorted((p for p in src.rglob("*") if p.is_file()), key=str)
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Build:
    name: str
    backend: str
    bin_dir: Path

    def tool(self, name: str) -> Path:
        path = self.bin_dir / name
        if not path.is_file():
            raise BuildMissingError(f"the {self.name} build has no {name} at {path}: run ./build.sh")
        return path

    def present(self) -> bool:
        return all((self.bin_dir / t).is_file() for t in TOOLS)


def read_builds(root: Path | None = None) -> dict[str, Build]:
    """The builds listed in build/builds.json (written by build.sh); empty when there are none."""
    path = (root or project_root()) / "build" / "builds.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {name: Build(name, b["backend"], Path(b["bin"])) for name, b in data.get("builds", {}).items()}
    except (ValueError, KeyError, TypeError) as e:
        raise HarnessError(f"{path} is damaged ({e}): run ./build.sh again") from None


def get_build(name: str, root: Path | None = None) -> Build:
    builds = read_builds(root)
    if name not in builds or not builds[name].present():
        how = "./build.sh --vulkan" if name.endswith("-vulkan") else "./build.sh"
        raise BuildMissingError(f"the {name} build is missing: run {how}")
    return builds[name]


def file_sha256(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:limit] if limit else h.hexdigest()


def log_drain_preload(root: Path | None = None) -> Path | None:
    """build/liblogdrain.so (built by build.sh from scripts/log_drain_preload.c), if present: preloaded into
    the tools so that the stock build's last log lines are not lost at exit (upstream issue 22142)."""
    path = (root or project_root()) / "build" / "liblogdrain.so"
    return path if path.is_file() else None


def with_log_drain(env: MutableMapping[str, str], root: Path | None = None) -> MutableMapping[str, str]:
    """`env` with the log-drain library added to LD_PRELOAD (unchanged when it was not built)."""
    shim = log_drain_preload(root)
    if shim is not None and str(shim) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(x for x in (str(shim), env.get("LD_PRELOAD", "")) if x)
    return env
