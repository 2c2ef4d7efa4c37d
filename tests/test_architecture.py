"""Architecture rules: which package may import which.

* engine/v1/core (scheduler, KV cache) is pure Python: it imports with torch
  made unimportable.
* engine/tracing is a leaf: it imports no other engine subsystem.
* tui/ uses engine.tracing's public names only, from the package itself.
* An engine process does not load the replay model or the Perfetto export.
* engine/tracing/__init__.py only re-exports.

The import checks run in a subprocess, so that what this test process has
already imported cannot hide a missing import.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import engine.tracing

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
TRACING = ENGINE / "tracing"
TUI = ROOT / "tui"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of every import in ``tree``, a module of
    ``package`` (relative imports resolved); ``names`` is empty for ``import x``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


CORE_MODULES = sorted(_module_name(p) for p in (ENGINE / "v1" / "core").rglob("*.py"))


def test_engine_v1_core_imports_without_torch():
    """The scheduler and the KV cache are pure Python: every module of
    engine/v1/core imports while ``import torch`` fails."""
    assert {
        "engine.v1.core.sched.scheduler",
        "engine.v1.core.kv_cache_manager",
        "engine.v1.core.block_pool",
        "engine.v1.core.kv_cache_utils",
    } <= set(CORE_MODULES)
    code = (
        "import importlib, json, sys\n"
        "sys.modules['torch'] = None  # any import of torch now raises ImportError\n"
        f"for name in {CORE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m, mod in sys.modules.items() if mod is not None)))\n"
    )
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout))
    assert set(CORE_MODULES) <= loaded
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "transformers")}


def test_the_check_above_would_see_torch():
    """The subprocess really refuses torch (else the test above proves nothing)."""
    out = _run_python("import sys\nsys.modules['torch'] = None\nimport torch\n")
    assert out.returncode != 0 and "import of torch halted" in out.stderr


TRACING_MODULES = sorted(TRACING.glob("*.py"))


def _lazy_module_names(tree: ast.AST) -> list[ast.Constant]:
    """String constants that name a module to import later: arguments of
    ``import_module`` / ``__import__`` and values of a name -> module table."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(
            ("import_module", "__import__")
        ):
            found += node.args
        elif isinstance(node, ast.Dict):
            found += node.values
    return [n for n in found if isinstance(n, ast.Constant) and isinstance(n.value, str)]


@pytest.mark.parametrize("path", TRACING_MODULES, ids=lambda p: p.name)
def test_engine_tracing_imports_no_other_engine_subsystem(path):
    """engine/tracing is a leaf: every import of ``engine...`` it makes, also
    the lazy ones (``importlib.import_module("engine....")``), stays in
    ``engine.tracing``."""
    tree = ast.parse(path.read_text())
    bad = []
    for line, module, names in _imported_modules(tree, "engine.tracing"):
        if module == "engine":
            bad += [f"{line}: from engine import {n}" for n in names if n != "tracing"]
        elif module.startswith("engine.") and not module.startswith("engine.tracing"):
            bad.append(f"{line}: {module}")
    for node in _lazy_module_names(tree):
        if re.fullmatch(r"engine(\.\w+)+", node.value) and not node.value.startswith(
            "engine.tracing"
        ):
            bad.append(f"{node.lineno}: lazy import of {node.value!r}")
    assert not bad, f"{path.name} imports outside engine.tracing: {bad}"


def test_importing_engine_tracing_loads_no_other_engine_module():
    code = "import json, sys\nimport engine.tracing\nprint(json.dumps(sorted(sys.modules)))\n"
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    engine_modules = [m for m in json.loads(out.stdout) if m.split(".")[0] == "engine"]
    assert [m for m in engine_modules if not m.startswith("engine.tracing")] == ["engine"]


PUBLIC_TRACING_NAMES = set(engine.tracing.__all__)


def test_tui_imports_only_public_names_of_engine_tracing():
    """tui/ takes from the engine only names of ``engine.tracing.__all__``,
    imported from the package itself (not a submodule), none private; where
    it binds the package to a name, it reads only those names from it."""
    assert {"load_trace", "TraceReplay", "SchedStep"} <= PUBLIC_TRACING_NAMES
    assert not [n for n in PUBLIC_TRACING_NAMES if n.startswith("_")]
    paths = sorted(TUI.rglob("*.py"))
    assert paths
    bad = []
    imported = 0
    for path in paths:
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT)
        aliases = set()  # expressions that stand for the engine.tracing package
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "engine.tracing":
                        aliases.add(alias.asname or alias.name)
                    elif alias.name.split(".")[0] == "engine":
                        bad.append(f"{where}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                module = node.module or ""
                if module.split(".")[0] != "engine":
                    continue
                for alias in node.names:
                    name = alias.name
                    if module == "engine" and name == "tracing":
                        aliases.add(alias.asname or name)
                    elif module != "engine.tracing":
                        bad.append(f"{where}:{node.lineno}: from {module} import {name}")
                    elif name == "*" or name.startswith("_") or name not in PUBLIC_TRACING_NAMES:
                        bad.append(f"{where}:{node.lineno}: from engine.tracing import {name}")
                    else:
                        imported += 1
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in aliases:
                if node.attr not in PUBLIC_TRACING_NAMES:
                    bad.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert imported > 0  # the TUI does read the trace through engine.tracing
    assert not bad, bad


ENGINE_PROCESS_MODULES = ["engine.v1.engine.core", "engine.v1.engine.llm_engine"]
OFFLINE_ONLY = ["engine.tracing.replay", "engine.tracing.replay_state", "engine.tracing.perfetto"]


def test_an_engine_process_does_not_load_the_replay_model_or_the_perfetto_export():
    code = (
        "import importlib, json, sys\n"
        f"for name in {ENGINE_PROCESS_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout))
    assert set(ENGINE_PROCESS_MODULES) <= loaded and "engine.tracing" in loaded
    assert not loaded & set(OFFLINE_ONLY)


def test_the_lazy_names_of_engine_tracing_load_their_modules_on_first_use():
    """The other half of the rule above: the replay and export names are
    still reachable from the package (the TUI and the CLI use them)."""
    code = (
        "import json, sys\n"
        "import engine.tracing as t\n"
        "before = sorted(m for m in sys.modules if m.startswith('engine.tracing.'))\n"
        "t.TraceReplay, t.export_perfetto\n"
        "after = sorted(m for m in sys.modules if m.startswith('engine.tracing.'))\n"
        "print(json.dumps([before, after]))\n"
    )
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout)
    assert not set(before) & set(OFFLINE_ONLY)
    assert set(OFFLINE_ONLY) <= set(after)


def test_engine_tracing_init_only_re_exports():
    """engine/tracing/__init__.py holds its docstring, imports, ``__all__``,
    the table of lazily imported names and the ``__getattr__`` that reads it:
    nothing is defined there."""
    tree = ast.parse((TRACING / "__init__.py").read_text())
    body = list(tree.body)
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    assert isinstance(body[0].value.value, str)  # the docstring
    bad = []
    lazy_tables = []
    for node in body[1:]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names == ["__all__"]:
                continue
            value = node.value
            if (
                len(names) == 1
                and isinstance(value, ast.Dict)
                and all(isinstance(k, ast.Constant) for k in value.keys)
                and all(isinstance(v, ast.Constant) for v in value.values)
            ):
                lazy_tables.append(names[0])  # name -> module, read by __getattr__
                continue
        bad.append(f"{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    assert not bad, bad
    assert len(lazy_tables) <= 1
    # Every exported name resolves, and is the object of the module that defines it.
    for name in engine.tracing.__all__:
        obj = getattr(engine.tracing, name)
        module = getattr(obj, "__module__", None)
        if module is not None and isinstance(obj, type):
            assert module.startswith("engine.tracing."), (name, module)
