"""``glassbox trace-export TRACE -o OUT.json``: a trace as a Perfetto timeline.

vLLM twin: none (vLLM's CLI has no trace tools; its traces go to an
OpenTelemetry collector). The sub-command reads a Glassbox JSONL trace (the
``trace_path`` of ``LLM(..., trace_path=...)`` or ``glassbox serve
--trace-path``) and writes Chrome/Perfetto trace-event JSON with
``engine.tracing.export_perfetto``; open the result in ui.perfetto.dev.
Unmerged part files of a multi-process run (``TRACE.<role>-<pid>.part``) are
merged into TRACE first.
Sessions: all.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from engine.tracing import export_perfetto, load_trace, merge_trace_parts

HELP = "Convert a Glassbox trace (JSONL) to Chrome/Perfetto trace-event JSON."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE", help="the JSONL trace written by the engine")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT.json",
        help="where to write the trace-event JSON (open it in ui.perfetto.dev)",
    )


def run(args: argparse.Namespace) -> int:
    trace = args.trace
    if glob.glob(glob.escape(trace) + ".*.part"):
        merge_trace_parts(trace)
    if not os.path.isfile(trace):
        print(f"glassbox trace-export: no trace at {trace}", file=sys.stderr)
        return 2
    try:
        events = load_trace(trace)
    except ValueError as e:
        print(f"glassbox trace-export: {e}", file=sys.stderr)
        return 2
    if not events:
        print(f"glassbox trace-export: {trace} holds no events", file=sys.stderr)
        return 2
    doc = export_perfetto(events, args.output)
    print(
        f"wrote {len(doc['traceEvents'])} trace events from {len(events)} engine events "
        f"to {args.output}"
    )
    return 0
