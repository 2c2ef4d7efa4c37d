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
import json
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


def vllm_url(path: str, line: int | None = None) -> str:
    """Permalink to vLLM's ``path`` (``vllm/...``) at 52a31cc, at ``line`` if given."""
    anchor = f"#L{line}" if line else ""
    return f"https://github.com/vllm-project/vllm/blob/{VLLM_SHA}/{path}{anchor}"


def our_line(path: str, dotted: str) -> int | None:
    """Line where ``NAME`` / ``Class.method`` (nested functions too) is defined in
    our ``path`` (relative to the repository root), now; None if it is not."""
    body = ast.parse((REPO / path).read_text()).body
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
