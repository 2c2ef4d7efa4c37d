"""The ``glassbox`` command line (vLLM twin: ``vllm/entrypoints/cli/main.py``).

Sub-commands register themselves in ``COMMANDS`` as they are built; running
``glassbox`` with none prints what exists. Every sub-command's ``--help``
shows each option's default (``DefaultsHelpFormatter``, as vLLM's CLI does).
``command_name()`` is how the CLI names itself in the commands it suggests:
``make setup`` puts ``glassbox`` in ``.venv/bin``, which is on the PATH only
once the venv is activated.

The commands that start an engine (``ENGINE_COMMANDS``) first limit this
process to one torch thread (``limit_frontend_threads``): as a front end it
only tokenizes, serves and detokenizes, and its threads would compete with
EngineCore's for the same cores. When EngineCore runs in this process
(``glassbox trace``), the worker sizes the threads for it afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable

import engine
from engine.entrypoints.cli import serve, trace, trace_export, tui
from engine.entrypoints.cli.benchmark import main as bench
from engine.entrypoints.openai.cli_args import DefaultsHelpFormatter
from engine.utils.cpu_resource_utils import limit_frontend_threads

# name -> (help, function(argparse namespace) -> exit code, add_arguments)
COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int], Callable]] = {
    "trace-export": (trace_export.HELP, trace_export.run, trace_export.add_arguments),
    "serve": (serve.HELP, serve.run, serve.add_arguments),
    "trace": (trace.HELP, trace.run, trace.add_arguments),
    "tui": (tui.HELP, tui.run, tui.add_arguments),
    "bench": (bench.HELP, bench.run, bench.add_arguments),
}

# Sub-commands that start an engine: their process is a front end.
ENGINE_COMMANDS = ("serve", "trace", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glassbox",
        description="Glassbox: an instrumented twin of the vLLM V1 engine.",
    )
    parser.add_argument("--version", action="version", version=f"glassbox {engine.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _, add_arguments) in COMMANDS.items():
        add_arguments(
            sub.add_parser(
                name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter
            )
        )
    return parser


def command_name() -> str:
    """``glassbox`` when that name on the PATH is this program, else the path it
    was started by (``.venv/bin/glassbox`` from ``make run``), so a suggested
    command works when pasted."""
    started_as = sys.argv[0] if sys.argv else ""
    if os.path.basename(started_as) != "glassbox":
        return "glassbox"  # python -m ..., or a test
    on_path = shutil.which("glassbox")
    try:
        if on_path and os.path.samefile(on_path, started_as):
            return "glassbox"
    except OSError:
        pass
    relative = os.path.relpath(started_as)
    return started_as if relative.startswith("..") else relative


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
    if args.command in ENGINE_COMMANDS:
        try:
            limit_frontend_threads()
        except ValueError as e:
            print(f"glassbox {args.command}: error: {e}", file=sys.stderr)
            return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
