"""`harness doctor`: what is built, with what, from which pin and patches, and what hardware is here."""

from __future__ import annotations

import platform

import psutil

from harness.core import project
from harness.domain.results import BuildStatus, Diagnosis
from harness.tools.host import build_version, detect_gpus, nvcc_version


def diagnose() -> Diagnosis:
    root = project.project_root()
    pin = project.read_pin(root)
    builds = project.read_builds(root)
    problems: list[str] = []
    statuses = []
    for name in project.BUILD_NAMES:
        b = builds.get(name)
        if b is None or not b.present():
            statuses.append(BuildStatus(name, False, b.backend if b else "-", str(b.bin_dir) if b else "-", "", False))
            problems.append(f"the {name} build is missing: run ./build.sh")
            continue
        version = build_version(b)
        patched = "moe-subst" in version
        statuses.append(BuildStatus(name, True, b.backend, str(b.bin_dir), version, patched))
        if (name == "patched") != patched:
            problems.append(f"the {name} build identifies itself as {'patched' if patched else 'stock'}: "
                            "run ./build.sh again")
    for name in ("stock-vulkan", "patched-vulkan"):  # ./build.sh --vulkan, next to the others; optional
        b = builds.get(name)
        if b is None:
            continue
        if not b.present():
            statuses.append(BuildStatus(name, False, b.backend, str(b.bin_dir), "", False))
            problems.append(f"the {name} build lacks some binaries: run ./build.sh --vulkan")
            continue
        version = build_version(b)
        statuses.append(BuildStatus(name, True, b.backend, str(b.bin_dir), version, "moe-subst" in version))
    unpacked = (root / "vendor" / "llama.cpp" / ".moe-subst-pin").is_file()
    if unpacked:
        got = (root / "vendor" / "llama.cpp" / ".moe-subst-pin").read_text().split()
        if got != [pin.name, pin.sha256]:
            problems.append("vendor/llama.cpp is from another pin than UPSTREAM: run ./build.sh")
    gpus = detect_gpus()
    if gpus and any(s.present and s.backend != "cuda" for s in statuses):
        problems.append("an NVIDIA GPU is present but the builds are CPU-only: run ./build.sh --cuda")
    nvcc = nvcc_version()
    return Diagnosis(
        pin=pin.name, pin_sha256=pin.sha256, patch_series=project.patch_series_hash(root),
        n_patches=len(project.patch_series(root)), source_unpacked=unpacked, builds=tuple(statuses),
        gpus=gpus, nvcc=nvcc, python=platform.python_version(),
        host_ram_bytes=psutil.virtual_memory().total, cpu_count=psutil.cpu_count() or 0,
        problems=tuple(problems))
