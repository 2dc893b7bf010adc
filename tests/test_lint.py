"""House style holds on every commit: ruff over the package, tests and scripts; mypy --strict on the package."""

import shutil
import subprocess
import sys

import pytest

from harness.core import project

ROOT = project.project_root()


def _tool(name: str) -> str:
    path = shutil.which(name) or str(ROOT / ".venv" / "bin" / name)
    if not shutil.which(path):
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return path


def test_ruff_clean() -> None:
    r = subprocess.run([_tool("ruff"), "check", "harness", "tests", "scripts"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]


def test_mypy_strict_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    if "No module named mypy" in r.stderr:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
