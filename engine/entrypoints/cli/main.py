"""The ``glassbox`` command line (vLLM twin: ``vllm/entrypoints/cli/main.py``).

Sub-commands register themselves in ``COMMANDS`` as they are built; running
``glassbox`` with none prints what exists.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import engine
from engine.entrypoints.cli import serve, trace, trace_export, tui
from engine.entrypoints.cli.benchmark import main as bench

# name -> (help, function(argparse namespace) -> exit code, add_arguments)
COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int], Callable]] = {
    "trace-export": (trace_export.HELP, trace_export.run, trace_export.add_arguments),
    "serve": (serve.HELP, serve.run, serve.add_arguments),
    "trace": (trace.HELP, trace.run, trace.add_arguments),
    "tui": (tui.HELP, tui.run, tui.add_arguments),
    "bench": (bench.HELP, bench.run, bench.add_arguments),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glassbox",
        description="Glassbox: an instrumented twin of the vLLM V1 engine.",
    )
    parser.add_argument("--version", action="version", version=f"glassbox {engine.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _, add_arguments) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        if not COMMANDS:
            print(
                "\nNo sub-commands are available in this build yet: the engine core "
                "(scheduler, KV cache, LLM loop) is usable from Python; model execution, "
                "`glassbox trace`, `glassbox serve` and the TUI are still to come."
            )
        return 0
    _, run, _ = COMMANDS[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
