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
