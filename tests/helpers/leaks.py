"""What an engine may leave behind in the file system, for leak checks.

Tests run in parallel (pytest-xdist), so a file that appeared during a test may
belong to another test's live engine: these helpers count only files nobody
uses any more.
"""

from __future__ import annotations

import errno
import glob
import os
import socket
import stat
import tempfile
import time


def ipc_socket_files() -> set[str]:
    """The ipc:// socket files of Glassbox engines (EngineCore's sockets and
    the message queues' ``glassbox-mq-*``) in the temp folder."""
    found = set()
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "glassbox-*")):
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                found.add(path)
        except FileNotFoundError:
            pass
    return found


def _has_listener(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError as e:
            # ECONNREFUSED: the file exists but no socket is bound to it any more.
            return e.errno != errno.ECONNREFUSED
        return True


def stale_ipc_files(before: set[str], settle_s: float = 1.0) -> set[str]:
    """Socket files that appeared since ``before`` and that no process listens
    on, still there ``settle_s`` later (a process may be between closing its
    socket and removing the file)."""
    stale = {p for p in ipc_socket_files() - before if not _has_listener(p)}
    if stale:
        time.sleep(settle_s)
        stale = {p for p in stale if os.path.exists(p)}
    return stale
