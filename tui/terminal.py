"""Whether the TUI can run here: it needs a terminal to draw on and read keys from.

vLLM twin: none. Textual reads keys from stdin and draws on stderr; without a
terminal on either it does not fail, it spins (about 90% of a core, for as
long as nobody stops it). ``glassbox tui`` and ``glassbox trace`` check first
and exit at once, naming the text output to use instead. stdout is checked
too: a run whose output is redirected wants text, not a screen. The same
spin starts when the terminal goes away under a running app (its window
closed, its tmux session killed) while the process lives on -- under
``make run``, make takes the hangup signal and waits for its child -- so
the app watches for that too (``terminal_hung_up``) and quits.
Sessions: all.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import TextIO


def missing_terminal(streams: dict[str, TextIO | None] | None = None) -> str | None:
    """Which standard streams are not a terminal, as a clause (``"stdin is
    not a terminal"``, ``"stdin and stdout are not terminals"``); None when
    all are. ``streams``: name -> stream (default: the process's own
    ``sys.__stdin__``, ``__stdout__`` and ``__stderr__``, which Textual uses)."""
    if streams is None:
        streams = {"stdin": sys.__stdin__, "stdout": sys.__stdout__, "stderr": sys.__stderr__}
    missing = [name for name, stream in streams.items() if not _isatty(stream)]
    if not missing:
        return None
    if len(missing) == 1:
        return f"{missing[0]} is not a terminal"
    return ", ".join(missing[:-1]) + f" and {missing[-1]} are not terminals"


def _isatty(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):  # a closed or detached stream
        return False


def terminal_hung_up(stream: TextIO | None = None) -> bool:
    """True once the terminal behind ``stream`` (default ``sys.__stdin__``)
    has hung up: the kernel then answers every terminal request on it with
    EIO (and reads with end-of-file, which Textual's input thread loops on)."""
    stream = sys.__stdin__ if stream is None else stream
    try:
        os.tcgetpgrp(stream.fileno())
    except OSError as e:
        return e.errno == errno.EIO
    except (AttributeError, ValueError):  # no stream, or a closed one
        return False
    return False
