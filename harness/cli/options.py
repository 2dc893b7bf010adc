"""Argparse options that several commands share, defined once: model, text, the perplexity settings, threads,
output folder, seed, policies; and the conversions from their values. Each helper adds one option (so every
command keeps its options in its own order) with the help text most commands use, or the one passed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.core import project
from harness.core.errors import HarnessError
from harness.domain.catalogue import DEFAULT_POLICIES, KNOWN_POLICIES

MODEL_HELP = "a .gguf MoE model (default: the project's trained model in models/)"
TEXT_HELP = "text for perplexity (default: eval/data/heldout.txt)"


def add_model(p: argparse.ArgumentParser, help: str = MODEL_HELP, *, required: bool = False) -> None:
    p.add_argument("--model", type=Path, required=required, help=help)


def add_text(p: argparse.ArgumentParser, help: str = TEXT_HELP) -> None:
    p.add_argument("--text", type=Path, help=help)


def add_ctx(p: argparse.ArgumentParser, default: int, help: str = "perplexity context (default: %(default)s)") -> None:
    p.add_argument("--ctx", type=int, default=default, help=help)


def add_chunks(p: argparse.ArgumentParser, default: int,
               help: str = "perplexity chunks, 0 = all (default: %(default)s)") -> None:
    p.add_argument("--chunks", type=int, default=default, help=help)


def add_threads(p: argparse.ArgumentParser, help: str = "CPU threads (default: llama.cpp's)") -> None:
    p.add_argument("--threads", type=int, help=help)


def add_out(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--out", type=Path, help=help)


def add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")


def add_policies(p: argparse.ArgumentParser, help: str | None = None, *, note: str = "") -> None:
    """--policies, default DEFAULT_POLICIES; the help lists the catalogue unless `help` replaces it."""
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=help or f"comma-separated, from: {', '.join(KNOWN_POLICIES)} (default: %(default)s{note})")


def add_warm(p: argparse.ArgumentParser) -> None:
    """--warm-from FILE and --cold: the cached runs' initial residency (harness.orchestration.warmstart)."""
    p.add_argument("--warm-from", type=Path, metavar="FILE",
                   help="calibration text whose routing profile is every cached run's initial residency, never "
                   "the evaluated tokens (default: eval/data/heldout-docs.txt, or heldout.txt for that text)")
    p.add_argument("--cold", action="store_true",
                   help="start every cache from experts 0..n-1 instead (the engine's default); refused for a policy "
                   "that never fetches (substitute-all), which would keep that residency for the whole run")


def perplexity_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The PerplexitySettings fields of a command's options from --text, --ctx, --chunks (0 = all), --threads, and
    where the command has them, --warm-from and --cold."""
    out = {"text": args.text, "n_ctx": args.ctx, "chunks": args.chunks or None, "threads": args.threads}
    if hasattr(args, "cold"):
        if args.cold and args.warm_from is not None:
            raise HarnessError("--cold and --warm-from: pass one of them")
        from harness.orchestration.warmstart import default_calibration

        out["warm_from"] = None if args.cold else (args.warm_from or default_calibration(args.text))
    return out


def out_dir(args: argparse.Namespace, name: str) -> Path:
    """--out, or results/NAME in the checkout."""
    out: Path | None = args.out
    return out or project.project_root() / "results" / name


def words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise HarnessError(f"not a comma-separated list of numbers: {text!r}") from None


def ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise HarnessError(f"{what}: not a comma-separated list of integers: {text!r}") from None


def percent(text: str, what: str) -> float:
    """A percentage as typed: "1%", "1" or "0.5%"."""
    try:
        return float(text.strip().removesuffix("%"))
    except ValueError:
        raise HarnessError(f"{what}: not a percentage: {text!r} (e.g. 1%)") from None
