"""The patch series applies to a pristine tree, round-trips, and a broken patch is named in the error."""

import shutil
import subprocess
from pathlib import Path

import pytest

from harness.core import project

ROOT = project.project_root()
PRISTINE = ROOT / "vendor" / "llama.cpp"

needs_source = pytest.mark.skipif(not (PRISTINE / ".moe-subst-pin").is_file(),
                                  reason="vendor/llama.cpp is not unpacked: run ./build.sh")


def _sandbox(tmp_path: Path) -> Path:
    """A copy of the project's patch machinery whose vendor/llama.cpp points at the real pristine tree."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "patches.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "UPSTREAM", tmp_path)
    shutil.copytree(ROOT / "patches", tmp_path / "patches")
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "llama.cpp").symlink_to(PRISTINE)
    return tmp_path


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(root / "scripts" / "patches.sh"), *args], capture_output=True, text=True)


def test_series_has_patches_with_trailers() -> None:
    series = project.patch_series()
    assert series, "patches/ is empty"
    for p in series:
        text = p.read_text()
        assert text.startswith("From 0000000000000000000000000000000000000000 "), f"{p.name}: not --zero-commit"
        assert "\nUpstream:" in text and "\nDrop-when:" in text, f"{p.name}: trailers missing"


@needs_source
def test_series_applies_and_round_trips(tmp_path: Path) -> None:
    r = _run(_sandbox(tmp_path), "check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "round-trip" in r.stdout


@needs_source
def test_broken_patch_is_named(tmp_path: Path) -> None:
    root = _sandbox(tmp_path)
    first = sorted((root / "patches").glob("*.patch"))[0]
    text = first.read_text()
    # Damage a context line so the hunk no longer applies.
    broken = text.replace("#include <string>", "#include <strings_not_there>", 1)
    assert broken != text
    bad = root / "patches" / "9999-broken.patch"
    bad.write_text(broken)
    r = _run(root, "check")
    assert r.returncode != 0
    assert "9999-broken.patch does not apply" in r.stderr


def test_hash_matches_harness() -> None:
    r = _run(ROOT, "hash")
    assert r.returncode == 0
    assert r.stdout.strip() == project.patch_series_hash()


def test_no_llama_cpp_file_is_tracked() -> None:
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "vendor"], capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked in ([], ["vendor/README.md"])


def _added_upstream_lines() -> dict[str, int]:
    added: dict[str, int] = {}
    for p in project.patch_series():
        path = None
        for line in p.read_text().splitlines():
            if line.startswith("diff --git "):
                path = line.split()[3][2:]
            elif line.startswith("new file mode"):
                raise AssertionError(f"{p.name} creates {path}: our files belong in src/, not in a patch")
            elif path and line.startswith("+") and not line.startswith("+++"):
                added[path] = added.get(path, 0) + 1
    return added


def test_series_is_call_sites_only() -> None:
    """Our C++ lives in src/; the patches add at most 200 lines to upstream files, and no file."""
    added = _added_upstream_lines()
    total = sum(added.values())
    assert added and total <= 200, f"{total} upstream lines added: {sorted(added.items(), key=lambda kv: -kv[1])}"
    assert "src/llama-graph.cpp" in added and added["src/llama-graph.cpp"] <= 10, added


def test_our_cmake_names_every_source() -> None:
    """Every .cpp of src/ is compiled by src/moe-subst.cmake (or is a header-only or test file)."""
    cmake = (ROOT / "src" / "moe-subst.cmake").read_text()
    for cpp in sorted((ROOT / "src").rglob("*.cpp")):
        rel = cpp.relative_to(ROOT / "src").as_posix()
        assert "${MOE_SUBST_SRC}/" + rel in cmake, f"src/{rel} is not in src/moe-subst.cmake"
