"""The `harness` command: an adapter that parses arguments, calls one library function, renders.

No logic lives here. Every HarnessError becomes one line on stderr and its exit code; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from harness.errors import HarnessError

console = Console()
err_console = Console(stderr=True)

Handler = Callable[[argparse.Namespace], int]


def _cmd_doctor(args: argparse.Namespace) -> int:
    from harness import doctor, render

    diagnosis = doctor.diagnose()
    console.print(render.render_doctor(diagnosis))
    return 1 if diagnosis.problems else 0


def _cmd_info(args: argparse.Namespace) -> int:
    from harness import gguf_model, plan, render, sizes

    info = gguf_model.read_model_info(args.model)
    slot_plan = None
    if args.vram:
        reserve = sizes.parse_size(args.reserve, allow_percent=False).bytes if args.reserve else 0
        slot_plan = plan.plan_slots(info, sizes.parse_size(args.vram), reserve or 0)
    console.print(render.render_info(info, slot_plan))
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from harness import synth

    spec = synth.SynthSpec(arch=args.arch, n_layer=args.layers, n_expert=args.experts,
                           n_expert_used=args.top_k, n_embd=args.embd, n_ff_exp=args.ff,
                           dtype=args.dtype, seed=args.seed)
    path = synth.write_synth_model(spec, args.output)
    console.print(f"wrote {path} ({path.stat().st_size / 2**20:.2f} MiB): {spec}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harness", description=(
        "moe-subst: run MoE models bigger than VRAM with an expert cache in a patched llama.cpp, "
        "and measure it against stock llama.cpp."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("doctor", help="check builds, backend, GPU, versions, pin and patch series")
    d.set_defaults(func=_cmd_doctor)

    i = sub.add_parser("info", help="what a GGUF MoE model holds, and how many expert slots fit a budget")
    i.add_argument("model", type=Path, help="a .gguf file")
    i.add_argument("--vram", metavar="SIZE", help="device budget: 24G, 24GiB, 512M, or 25%% "
                   "(= non-expert weights + 25%% of the expert weights)")
    i.add_argument("--reserve", metavar="SIZE", help="part of the budget kept for the KV cache and compute "
                   "buffers (default 0)")
    i.set_defaults(func=_cmd_info)

    s = sub.add_parser("synth", help="write a small random-weight MoE GGUF (deterministic by seed)")
    s.add_argument("-o", "--output", type=Path, required=True, help="where to write the .gguf")
    s.add_argument("--arch", default="qwen3moe", help="architecture (qwen3moe, qwen2moe, ...)")
    s.add_argument("--layers", type=int, default=2)
    s.add_argument("--experts", type=int, default=16)
    s.add_argument("--top-k", type=int, default=4)
    s.add_argument("--embd", type=int, default=64)
    s.add_argument("--ff", type=int, default=32, help="expert FFN size")
    s.add_argument("--dtype", default="f32", help="f32, f16, q8_0, q4_k")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_cmd_synth)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Handler = args.func
    try:
        return func(args)
    except HarnessError as e:
        err_console.print(f"harness: error: {e}", highlight=False, soft_wrap=True)
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("harness: interrupted; finished results were kept")
        return 130


if __name__ == "__main__":
    sys.exit(main())
