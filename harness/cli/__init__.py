"""The `harness` command (console script `harness.cli:main`, `python -m harness`, `python -m harness.cli`)."""

from harness.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
