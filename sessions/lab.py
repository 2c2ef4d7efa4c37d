"""Helpers shared by the session notebooks (sessions/NN_*/NN_*.ipynb).

Not part of the engine and with no vLLM twin: this is the notebooks' own
plumbing, kept in one place so the session notebooks build their reading tables
and show their figures the same way.

  * ``reading_table(files)``: the Markdown table at the top of each session --
    a vLLM symbol, its line in vLLM at 52a31cc as a permalink (from the index committed in
    ``docs/data/vllm_twins_52a31cc.json``), its Glassbox twin and our line,
    found by parsing our source as it is now.
  * ``vllm_line(path, dotted)`` / ``our_line(path, dotted)``: the two lookups.
  * ``vllm_url(path, line)``: the GitHub permalink to vLLM's file at 52a31cc.
  * ``show_vllm(path, name_or_line, n_lines)``: the cited lines of vLLM, inline,
    from the learner's own checkout when ``GLASSBOX_VLLM_SRC`` points at one;
    otherwise just the permalink.
  * ``show(fig)``: a matplotlib figure into the notebook as a PNG.

A notebook's working directory is its own folder (under Jupyter and under
nbval), so the notebooks put this folder on ``sys.path`` from the repository
root they find through ``engine``::

    import engine
    REPO = Path(engine.__file__).resolve().parent.parent
    sys.path.insert(0, str(REPO / "sessions"))
    from lab import reading_table

Importing this module imports neither the engine nor torch, so a notebook may
set environment variables the engine reads before or after it.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VLLM_COMMIT = "52a31cc"
# The full hash of VLLM_COMMIT: GitHub permalinks need all forty digits.
VLLM_SHA = "52a31ccecca203effd490a5b496dc5f8d9496654"
# vLLM path -> {"qualified": {"Class.method": line, ...}, ...}, extracted from
# vLLM at VLLM_COMMIT by scripts/gen_source_map.py.
VLLM_SYMBOLS: dict[str, Any] = json.loads((REPO / f"docs/data/vllm_twins_{VLLM_COMMIT}.json").read_text())


def vllm_line(path: str, dotted: str) -> int | None:
    """Line of ``NAME`` / ``Class.method`` / ``Class.method.inner`` in vLLM's ``path`` at 52a31cc."""
    return VLLM_SYMBOLS[path]["qualified"].get(dotted)


def vllm_url(path: str, line: int | None = None, end: int | None = None) -> str:
    """Permalink to vLLM's ``path`` (``vllm/...``) at 52a31cc, at ``line`` (to
    ``end``) if given."""
    anchor = f"#L{line}" if line else ""
    if line and end and end > line:
        anchor += f"-L{end}"
    return f"https://github.com/vllm-project/vllm/blob/{VLLM_SHA}/{path}{anchor}"


def our_line(path: str, dotted: str) -> int | None:
    """Line where ``NAME`` / ``Class.method`` (nested functions too) is defined in
    our ``path`` (relative to the repository root), now; None if it is not."""
    return _def_line((REPO / path).read_text(), dotted)


def _def_line(source: str, dotted: str) -> int | None:
    """Line where ``dotted`` is defined in Python ``source``; None if it is not."""
    body = ast.parse(source).body
    line = None
    for part in dotted.split("."):
        node = next(
            (
                n
                for n in body
                if (isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part)
                or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == part for t in n.targets))
            ),
            None,
        )
        if node is None:
            return None
        line, body = node.lineno, getattr(node, "body", [])
    return line


def reading_table(files: dict[str, list[str]]) -> str:
    """Markdown rows for ``{vLLM path: [qualified names]}``; our twin of
    ``vllm/X`` is ``engine/X``. A name missing on either side shows as —."""
    rows = ["| vLLM file | name | vLLM line | Glassbox twin | our line |", "|---|---|--:|---|--:|"]
    for vpath, names in files.items():
        gpath = "engine/" + vpath.removeprefix("vllm/")
        for name in names:
            v, g = vllm_line(vpath, name), our_line(gpath, name)
            vcell = f"[{v}]({vllm_url(vpath, v)})" if v else "—"
            rows.append(f"| [`{vpath}`]({vllm_url(vpath)}) | `{name}` | {vcell} | `{gpath}` | {g or '—'} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------
# vLLM's own lines, inline
# ---------------------------------------------------------------------------
VLLM_SRC_ENV = "GLASSBOX_VLLM_SRC"


@functools.lru_cache(maxsize=8)
def _checkout_commit(src: str) -> str | None:
    """HEAD of the git checkout whose top folder is ``src``; None if ``src`` is
    not one (a folder inside some other repository does not count)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", src, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(src).resolve():
        return None
    return git("rev-parse", "HEAD")


def vllm_source(path: str, where: str | int, n_lines: int = 12, src: str | None = None) -> str:
    """What ``show_vllm`` prints: a header, the permalink, and -- when ``src``
    (default: ``$GLASSBOX_VLLM_SRC``) is a vLLM checkout -- ``n_lines`` lines of
    ``src/path`` from ``where``.

    ``where`` is a line number, or a name (``Class.method``) looked up in the
    index of vLLM at 52a31cc (``vllm_line``). A checkout at another commit gets
    a warning, and a name is then looked up in its own source instead: the
    line the index gives would point into other code."""
    src = os.environ.get(VLLM_SRC_ENV) if src is None else src
    src = os.path.expanduser(src) if src else src
    if isinstance(where, int):
        line, name = where, None
    else:
        line, name = VLLM_SYMBOLS.get(path, {}).get("qualified", {}).get(where), where
        if line is None:
            raise KeyError(f"{where!r} is not in the index of {path} at {VLLM_COMMIT}; pass a line number")
    head = f"{path}:{line}" + (f"  {name}" if name else "")
    link = vllm_url(path, line, line + n_lines - 1)  # always 52a31cc's lines
    if not src:
        return f"{head}\n{link}"
    out = [head]
    file = Path(src) / path
    if not file.is_file():
        out.append(f"(no {path} under ${VLLM_SRC_ENV}={src}; read it at the link)")
        out.append(link)
        return "\n".join(out)
    text = file.read_text(encoding="utf-8", errors="replace")
    commit = _checkout_commit(src)
    if commit is None:
        out.append(f"(${VLLM_SRC_ENV} is not a git checkout: its commit is not checked)")
    elif commit != VLLM_SHA:
        out.append(f"warning: ${VLLM_SRC_ENV} is at {commit[:7]}, not {VLLM_COMMIT}: "
                   "these lines may differ from the ones this notebook cites")
        if name is not None:
            try:
                found = _def_line(text, name)
            except SyntaxError:
                found = None
            if found is None:
                out.append(f"({name} is not defined in this checkout's {path}; showing line {line})")
            else:
                line = found
    out.append(link)
    lines = text.splitlines()[line - 1 : line - 1 + n_lines]
    width = len(str(line + len(lines)))
    out += [f"{n:>{width}}  {code}" for n, code in enumerate(lines, line)]
    return "\n".join(out)


def show_vllm(path: str, where: str | int, n_lines: int = 12) -> None:
    """Print vLLM's ``path`` at ``where`` (a name or a line): the lines
    themselves from ``$GLASSBOX_VLLM_SRC`` when that points at a vLLM checkout
    (ideally at 52a31cc), else the permalink alone. See ``vllm_source``."""
    print(vllm_source(path, where, n_lines))


def show(fig: Any) -> None:
    """Display a matplotlib figure as a PNG (100 dpi) and close it.

    The notebooks draw with the off-screen ``Agg`` backend, so the PNG is
    the same under Jupyter and under nbval."""
    import io

    import matplotlib.pyplot as plt
    from IPython.display import Image, display

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    display(Image(data=buffer.getvalue()))
