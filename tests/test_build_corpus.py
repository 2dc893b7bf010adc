"""scripts/build_corpus.py keeps a committed evaluation text that this machine's packages would change (every figure
was measured on the committed bytes): the new text goes to <name>.new, unless --refresh-eval."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import build_corpus as bc  # noqa: E402


def _docs() -> dict[str, list[tuple[str, str, str]]]:
    return {"code": [("code", "a.py", "x = 1\n")], "prose": [("prose", "b.1", "Some words.\n")]}


def test_a_different_held_out_text_is_kept_and_the_new_one_set_aside(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    text, manifest = tmp_path / "h.txt", tmp_path / "h.json"
    text.write_text("committed bytes\n")
    manifest.write_text("[]\n")
    monkeypatch.setattr(bc, "REFRESH_EVAL", False)
    bc.write_held_out(_docs(), {"code": 100, "prose": 100}, text, manifest, "h")
    assert text.read_text() == "committed bytes\n" and manifest.read_text() == "[]\n"
    assert (tmp_path / "h.txt.new").read_text() == "x = 1\n\nSome words.\n"

    monkeypatch.setattr(bc, "REFRESH_EVAL", True)
    bc.write_held_out(_docs(), {"code": 100, "prose": 100}, text, manifest, "h")
    assert text.read_text() == "x = 1\n\nSome words.\n"
    assert '"source": "b.1"' in manifest.read_text()


def test_a_missing_held_out_text_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bc, "REFRESH_EVAL", False)
    bc.write_held_out(_docs(), {"code": 100, "prose": 100}, tmp_path / "h.txt", tmp_path / "h.json", "h")
    assert (tmp_path / "h.txt").read_text() == "x = 1\n\nSome words.\n" and not (tmp_path / "h.txt.new").exists()
