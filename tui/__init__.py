"""The Glassbox tracer: watch one request travel through the engine.

vLLM twin: none (vLLM has no step-by-step viewer). ``glassbox trace "PROMPT"``
records a run with tracing on and opens ``TraceApp`` following that prompt's
request; ``glassbox tui TRACE.jsonl`` replays any recorded trace. The TUI
reads runs only through ``engine.tracing`` (``load_trace_checked``,
``TraceReplay``).

Modules: ``session.py`` (a trace opened for viewing: replay, per-request
lifecycles, view cache), ``summary.py`` (the ``--headless`` text summary),
``app.py`` (the Textual app), ``widgets/`` (one panel per subsystem),
``terminal.py`` (whether there is a terminal to run the app in).
Sessions: all.
"""
