"""``glassbox tui TRACE.jsonl``: replay a recorded trace in the tracer TUI.

vLLM twin: none. Read it for the entry point only; the app is
``tui/app.py`` and the trace is opened by ``tui/session.py`` through
``engine.tracing``. A missing, empty, truncated or foreign trace is reported in one
clear sentence (exit code 2), never as a traceback: the cheap checks (the
file exists, is a file, is not empty) run before the app starts; anything found
while replaying is shown in the app and repeated on stderr when it closes.
``--summary`` prints the text summary ``glassbox trace --headless`` prints, for
any recorded trace. Without a terminal (stdin, stdout or stderr redirected)
the app is not started: it exits at once pointing at ``--summary``. A
truncated trace (a process killed, the file cut short) opens with a warning
on screen, at the top of the summary, and on stderr when the app closes.
Sessions: all.
"""

from __future__ import annotations

import argparse
import glob
import shlex
import sys

HELP = "Replay a recorded trace (JSONL) step by step in the tracer TUI."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE.jsonl", help="a trace written with trace_path=...")
    parser.add_argument(
        "--follow",
        metavar="REQUEST_ID",
        default=None,
        help=(
            "the request to follow: the id it was sent under, or the engine's internal id "
            "(default: the traced prompt, or the first)"
        ),
    )
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        help="the step to open at (default: where the followed request arrives)",
    )
    parser.add_argument(
        "--theme",
        default=None,
        choices=("textual-dark", "textual-light"),
        help="colour theme (t toggles it in the app)",
    )
    parser.add_argument(
        "--summary",
        action="store_true",
        help="print the followed request's lifecycle as text instead",
    )
    parser.add_argument(
        "--screenshot",
        metavar="OUT.svg",
        default=None,
        help="render the screen (no terminal needed) to an SVG file and exit",
    )
    parser.add_argument(
        "--size",
        metavar="WxH",
        default="120x36",
        help="terminal size for --screenshot (default 120x36)",
    )


def run(args: argparse.Namespace) -> int:
    from engine.tracing import merge_trace_parts
    from tui.session import TraceLoadError, check_trace_file, open_session
    from tui.terminal import missing_terminal

    if glob.glob(glob.escape(args.trace) + ".*.part"):
        # A multi-process run that did not shut down cleanly left its parts.
        merge_trace_parts(args.trace)
    try:
        check_trace_file(args.trace)
        if args.summary:
            session = open_session(args.trace)
    except TraceLoadError as e:
        print(f"glassbox tui: {e}", file=sys.stderr)
        return 2
    if args.summary:
        from tui.summary import request_summary

        follow = None if args.follow is None else session.resolve_request_id(args.follow)
        if args.follow is not None and follow is None:
            known = ", ".join(session.request_label(r) for r in session.request_ids) or "none"
            print(
                f"glassbox tui: --follow must be one of the trace's requests ({known}), "
                f"got {args.follow!r}",
                file=sys.stderr,
            )
            return 2
        print(request_summary(session, follow))
        return 0
    if args.step is not None and args.step < 0:
        print(f"glassbox tui: --step must be >= 0, got {args.step}", file=sys.stderr)
        return 2
    if not args.screenshot and (missing := missing_terminal()):
        from engine.entrypoints.cli.main import command_name

        print(
            f"glassbox tui: the TUI needs a terminal ({missing}). For text, run: "
            f"{command_name()} tui {shlex.quote(args.trace)} --summary (or --screenshot "
            "OUT.svg for a picture)",
            file=sys.stderr,
        )
        return 2
    from tui.app import TraceApp

    if args.screenshot:
        try:
            width, height = (int(v) for v in args.size.lower().split("x"))
        except ValueError:
            print(f"glassbox tui: --size must look like 120x36, got {args.size!r}", file=sys.stderr)
            return 2
        app = TraceApp(args.trace, follow=args.follow, step=args.step, theme=args.theme)
        app.run(headless=True, size=(width, height), auto_pilot=_screenshot_pilot(args.screenshot))
        if app.error is not None:
            print(f"glassbox tui: {app.error}", file=sys.stderr)
            return 2
        _warn_if_truncated(app)
        print(f"wrote {args.screenshot}")
        return 0

    # The app opens the trace in a worker thread (a long trace shows a
    # loading indicator at once); what it cannot read it shows, then we
    # repeat it here.
    app = TraceApp(args.trace, follow=args.follow, step=args.step, theme=args.theme)
    app.run()
    if app.error is not None:
        print(f"glassbox tui: {app.error}", file=sys.stderr)
        return 2
    _warn_if_truncated(app)
    return 0


def _warn_if_truncated(app) -> None:
    """Repeat the app's truncation warning once the screen is gone."""
    if app.session is not None and app.session.truncated:
        print(f"glassbox tui: warning: {app.session.truncated}", file=sys.stderr)


def _screenshot_pilot(out_path: str):
    """An auto-pilot: wait for the trace to open, save an SVG, quit."""
    import asyncio
    import os

    async def pilot(pilot) -> None:
        app = pilot.app
        for _ in range(3000):
            if app.ready or app.error is not None:
                break
            await asyncio.sleep(0.01)
        await pilot.pause()
        if app.error is None:
            folder, name = os.path.split(os.path.abspath(out_path))
            os.makedirs(folder, exist_ok=True)
            app.save_screenshot(filename=name, path=folder)
        app.exit()

    return pilot
