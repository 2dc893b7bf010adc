"""`harness report RESULTS`: re-read a results folder of `compare`, `sweep` or `frontier` and render it again
(terminal and report.md). Nothing is run; every statistic is recomputed from the raw records and NLL dumps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Group

from harness.core.errors import HarnessError
from harness.core.records import ResultsFile
from harness.orchestration.compare import reload_compare
from harness.orchestration.frontier import reload_frontier
from harness.orchestration.serialise import read_meta
from harness.orchestration.sweep import reload_sweep
from harness.report.markdown import render_compare_markdown, render_frontier_markdown, render_sweep_markdown
from harness.report.terminal import render_compare, render_sweep


@dataclass(frozen=True)
class Rerendered:
    command: str
    terminal: Group
    markdown: str
    report_path: Path
    plots: tuple[Path, ...] = ()
    notes: tuple[str, ...] = ()


def rerender(out: Path, *, model: Path | None = None, plots: bool = False) -> Rerendered:
    """Re-render a results folder; with `plots`, also draw a sweep's or a frontier's figures into its plots/
    folder."""
    path = out / "results.jsonl" if out.is_dir() else out
    if not path.is_file():
        raise HarnessError(f"no results at {path}: pass the --out folder of a compare or sweep run")
    if path.suffix != ".jsonl":
        raise HarnessError(f"{out} is {_what_file(out)}, not a results folder: harness report takes the --out folder "
                           "of a compare, sweep or frontier run (or the results.jsonl in it)")
    folder = path.parent
    meta = next((r for r in ResultsFile(path).read() if r.get("kind") == "meta"), None)
    command = str(meta.get("command")) if meta else ""
    if plots and command not in ("sweep", "frontier"):
        raise HarnessError(f"{folder} is a {command or 'non-sweep'} folder: plots need a sweep folder "
                           "(harness sweep --out DIR) or a frontier folder, as they show the policies of a sweep")
    figures: tuple[Path, ...] = ()
    notes: tuple[str, ...] = ()
    if command == "compare":
        c = reload_compare(folder, model=model)
        terminal, md = render_compare(c), render_compare_markdown(c)
    elif command == "sweep":
        s = reload_sweep(folder, model=model)
        terminal, md = render_sweep(s), render_sweep_markdown(s)
        if plots:
            from harness.report.plots import write_sweep_plots

            figures, notes = write_sweep_plots(s, folder / "plots")
    elif command == "frontier":
        from rich.markdown import Markdown

        from harness.report.markdown import frontier_summary_lines

        f = reload_frontier(folder, model=model)
        md = render_frontier_markdown(f)
        terminal = Group(Markdown("\n".join(frontier_summary_lines(f))))
        if plots:
            from harness.report.plots import write_frontier_plots

            figures = write_frontier_plots(f, folder / "plots")
    else:
        read_meta(ResultsFile(path), "compare")  # raises with the reason
        raise HarnessError(f"{path}: unknown command {command!r}")
    report = folder / "report.md"
    report.write_text(md)
    return Rerendered(command, terminal, md, report, figures, notes)


def _what_file(path: Path) -> str:
    """'a GGUF model (pass it as --model)' or 'a file', from the file's first bytes."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError:
        magic = b""
    return "a GGUF model (a moved model goes with --model FILE)" if magic == b"GGUF" else "a file"
