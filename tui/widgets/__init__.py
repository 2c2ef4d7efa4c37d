"""The tracer TUI's panels (one module each); see ``tui/app.py`` for the layout.

vLLM twin: none. Sessions: all.
"""
