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


def test_compat_series_has_trailers() -> None:
    """patches/compat/: build-compatibility patches (applied to stock and patched alike), each saying why and when
    it goes; they change upstream lines only (no new file)."""
    for p in project.compat_series():
        text = p.read_text()
        assert "\nUpstream:" in text and "\nDrop-when:" in text, f"compat/{p.name}: trailers missing"
        assert "new file mode" not in text


def test_compat_applies_in_place_and_restores(tmp_path: Path) -> None:
    """scripts/patches.sh compat on a small stand-in tree: applies the series once (stamped, idempotent), and when
    the series changes restores the files the old one changed from the source package before applying the new."""
    import tarfile

    root = tmp_path / "proj"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "patches.sh", root / "scripts")
    (root / "patches" / "compat").mkdir(parents=True)
    tree = root / "vendor" / "llama.cpp"
    (tree / "lib").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("project(x)\n")
    original = "one\ntwo\nthree\n"
    (tree / "lib" / "a.c").write_text(original)
    # the source package, as the pin's sdist lays it out
    pkg = tmp_path / "pkg" / "llama_cpp_python-0" / "vendor" / "llama.cpp" / "lib"
    pkg.mkdir(parents=True)
    (pkg / "a.c").write_text(original)
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tmp_path / "pkg" / "llama_cpp_python-0", arcname="llama_cpp_python-0")

    def patch(new: str) -> str:
        return ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] x\n\n"
                "Upstream: no\nDrop-when: never\n---\n"
                "diff --git a/lib/a.c b/lib/a.c\n--- a/lib/a.c\n+++ b/lib/a.c\n@@ -1,3 +1,3 @@\n one\n-two\n"
                f"+{new}\n three\n")

    (root / "patches" / "compat" / "0001-x.patch").write_text(patch("TWO"))
    for _ in range(2):  # the second run finds the stamp and does nothing
        r = _run(root, "compat", str(sdist))
        assert r.returncode == 0, r.stderr
        assert (tree / "lib" / "a.c").read_text() == "one\nTWO\nthree\n"
    assert (tree / ".moe-subst-compat").read_text().splitlines()[1:] == ["lib/a.c"]
    (root / "patches" / "compat" / "0001-x.patch").write_text(patch("2"))
    r = _run(root, "compat")  # the old series must be undone: without the source package, one line
    assert r.returncode != 0 and "source package" in r.stderr and "lib/a.c" in r.stderr
    r = _run(root, "compat", str(sdist))
    assert r.returncode == 0, r.stderr
    assert (tree / "lib" / "a.c").read_text() == "one\n2\nthree\n"
    (root / "patches" / "compat" / "0001-x.patch").unlink()
    r = _run(root, "compat", str(sdist))
    assert r.returncode == 0, r.stderr
    assert (tree / "lib" / "a.c").read_text() == original
