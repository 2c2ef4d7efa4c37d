#!/usr/bin/env python3
"""Generate docs/source_map.md: every Glassbox module beside its vLLM twin.

For each module under engine/ the twin is read from the module docstring
("vLLM twin: ``vllm/...``"). Each class / function / method we define whose
name also exists in the twin is listed with the line in vLLM at the pinned
commit 52a31cc, taken from the symbol index in ../shared/reference.

The symbols of the twin files are vendored into docs/data/vllm_twins_52a31cc.json
so that tests (tests/test_source_map.py) can check the map without the
reference folder. Run after changing a module:

    .venv/bin/python scripts/gen_source_map.py [--symbols ../shared/reference/vllm_symbols_52a31cc.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "52a31cc"
TWIN_RE = re.compile(r"vLLM twins?:\s*(.*?)(?:\n\s*\n|\.\s*\n)", re.S)
PATH_RE = re.compile(r"``(vllm/[\w/.\-]+?(?:\.py|/))``")
SESSION_RE = re.compile(r"Sessions?:\s*([^\n]*)")
SESSION_NAMES = {
    "01": "Session 01 — the engine loop",
    "02": "Session 02 — the scheduler",
    "03": "Session 03 — KV cache management",
    "04": "Session 04 — the worker",
    "05": "Session 05 — attention backends and sampling",
    "06": "Session 06 — advanced topics",
    "07": "Session 07 — the executor",
    "--": "Not tied to one session",
}


def module_twins(doc: str) -> list[str]:
    m = TWIN_RE.search((doc or "") + "\n\n")
    if not m:
        return []
    # A package (``vllm/tracing/``) means its __init__.py.
    return [p + "__init__.py" if p.endswith("/") else p for p in PATH_RE.findall(m.group(1))]


def vllm_name(name: str) -> str:
    """Our names swap "vllm" for "glassbox"; swap back to look up the twin."""
    return name.replace("Glassbox", "Vllm").replace("glassbox", "vllm")


def module_sessions(doc: str) -> list[str]:
    m = SESSION_RE.search((doc or "") + "\n")
    return re.findall(r"\b0[1-7]\b", m.group(1)) if m else []


def our_symbols(tree: ast.Module) -> list[tuple[str, str, int]]:
    """(qualified name, bare name, our line) for classes, functions, methods."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.name, node.name, node.lineno))
        elif isinstance(node, ast.ClassDef):
            out.append((node.name, node.name, node.lineno))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((f"{node.name}.{item.name}", item.name, item.lineno))
    return out


def twin_line(symbols: dict[str, list[int]], qual: str, name: str, class_lines: dict[str, int]) -> int | None:
    lines = symbols.get(name) or symbols.get(vllm_name(name))
    if not lines:
        return None
    if "." in qual:
        cls = qual.split(".")[0]
        start = class_lines.get(cls)
        if start is None:
            return None  # the class has no twin: a same-named method elsewhere would mislead
        after = [ln for ln in lines if ln > start]
        return min(after) if after else None
    return lines[0]


def build(symbols_path: Path | None) -> tuple[str, dict]:
    vendored_path = ROOT / "docs" / "data" / f"vllm_twins_{COMMIT}.json"
    if symbols_path is not None and symbols_path.exists():
        all_symbols = json.loads(symbols_path.read_text())
    else:
        all_symbols = json.loads(vendored_path.read_text())

    rows_by_session: dict[str, list[str]] = {}
    vendored: dict[str, dict] = {}
    modules = sorted(p for p in (ROOT / "engine").rglob("*.py") if "__pycache__" not in p.parts)
    missing_twin = []
    for path in modules:
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree) or ""
        twins = module_twins(doc)
        sessions = module_sessions(doc) or ["--"]
        if not twins:
            if path.name != "__init__.py" or doc:
                missing_twin.append(rel)
            continue
        twin = twins[0]
        entry = all_symbols.get(twin)
        summary = doc.strip().splitlines()[0] if doc else ""
        if entry is None:
            line = f"| `{rel}` | `{twin}` (not in vLLM at {COMMIT}) | {summary} | |"
        else:
            vendored[twin] = entry
            syms = entry["symbols"]
            class_lines = {}
            for qual, name, _ in our_symbols(tree):
                twin_name = name if name in syms else vllm_name(name)
                if "." not in qual and twin_name in syms:
                    class_lines[name] = syms[twin_name][0]
            matched = []
            for qual, name, ours in our_symbols(tree):
                ln = twin_line(syms, qual, name, class_lines)
                if ln is not None and not name.startswith("__"):
                    matched.append(f"`{qual}` :{ln}")
            shown = ", ".join(matched[:14]) + (" …" if len(matched) > 14 else "")
            line = f"| `{rel}` | `{twin}` ({entry['lines']} lines) | {summary} | {shown} |"
        for s in sessions[:1]:
            rows_by_session.setdefault(s, []).append(line)

    out = [
        "# Source map: Glassbox ↔ vLLM",
        "",
        f"Every module of `engine/` beside its twin in vLLM at commit `{COMMIT}` (2026-05-27).",
        "The last column lists the classes and functions that carry the same name in both,",
        "with the line where vLLM defines it, so you can jump straight there",
        "(`git show 52a31cc:<path>` in a vLLM clone, or the GitHub blob at that commit).",
        "Where a Glassbox module is simpler, its docstring says how and why.",
        "",
        "Generated by `scripts/gen_source_map.py`; `tests/test_source_map.py` checks it is current.",
        "",
    ]
    for key in ["01", "02", "03", "04", "05", "06", "07", "--"]:
        rows = rows_by_session.get(key)
        if not rows:
            continue
        out += [f"## {SESSION_NAMES[key]}", "", "| Glassbox | vLLM twin | What it is | Shared names (vLLM line) |",
                "| --- | --- | --- | --- |", *rows, ""]
    if missing_twin:
        out += ["## Glassbox-only modules", "",
                "These have no vLLM twin named in their docstring:", ""]
        out += [f"- `{m}`" for m in missing_twin]
        out.append("")
    return "\n".join(out), vendored


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--symbols", type=Path,
                        default=ROOT.parent / "shared" / "reference" / f"vllm_symbols_{COMMIT}.json")
    parser.add_argument("--check", action="store_true", help="fail if docs/source_map.md is stale")
    args = parser.parse_args()
    text, vendored = build(args.symbols if not args.check else None)
    target = ROOT / "docs" / "source_map.md"
    if args.check:
        current = target.read_text() if target.exists() else ""
        if current != text:
            print("docs/source_map.md is stale: run scripts/gen_source_map.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    data = ROOT / "docs" / "data" / f"vllm_twins_{COMMIT}.json"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps(vendored, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target.relative_to(ROOT)} ({len(vendored)} twin files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
