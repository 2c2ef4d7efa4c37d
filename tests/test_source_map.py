"""docs/source_map.md is current, and everything it cites is real.

The map is generated from the module docstrings and vLLM's symbol index at the
pinned commit (vendored under docs/data by scripts/gen_source_map.py). These
tests read the markdown back and check it against the code and the data
independently of the generator:

* every Glassbox path it cites exists, and every Glassbox name it cites is
  defined in that file at the line given;
* every vLLM path it cites exists at 52a31cc, and every vLLM name is defined
  in that file at the line given (and the line is one the symbol index lists);
* each row of the seeds' stale-path table is really stale in the way its
  status says;
* every module under engine/ has an entry, and the tracing package's modules
  one each, in its own section;
* a name shown as Glassbox's own (``name 12/–``) in a row with a twin is not
  defined in that twin;
* the links from docs/architecture.md into the map land on an anchor.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = json.loads((ROOT / "docs" / "data" / "vllm_twins_52a31cc.json").read_text())
VLLM_PATHS = set((ROOT / "docs" / "data" / "vllm_paths_52a31cc.txt").read_text().split())
MAP = (ROOT / "docs" / "source_map.md").read_text()

ROW_START = re.compile(r"^\| (?:<a id=\"[^\"]+\"></a>)?`(engine/[\w/.]+\.py)` \| ")
# `name 12/34`, `name 12/–`, or `name 12/34 (vLLM: `OtherClass.name`)` when vLLM's
# name differs (a method of another class in the twin).
NAME_LINES = re.compile(r"`([\w.]+)` (\d+)/(\d+|–)(?: \(vLLM: `([\w.]+)`\))?")
CITATION = re.compile(r"`((?:vllm|engine)/[\w/.\-]+\.py):(\d+) ([\w.]+)`")
OLD_CLAIM = re.compile(r"^`(vllm/[\w/.\-]+)`(?: · `([\w.]+)`)?(?: ~(\d+))?$")


def defined_at(source: str, qualname: str) -> int | None:
    """The line that defines ``qualname`` (``Class.method``, ``func.inner``,
    ``NAME``, ``Class.CONST``) at module level / in class and function bodies."""
    body: list[ast.stmt] = ast.parse(source).body
    line = None
    for part in qualname.split("."):
        found = None
        for node in body:
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and node.name == part
            ):
                found = node
                break
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
                    break
        if found is None:
            return None
        line = found.lineno
        body = getattr(found, "body", [])
    return line


def vllm_name(name: str) -> str:
    return name.replace("Glassbox", "Vllm").replace("glassbox", "vllm")


def table_rows(section: str) -> list[list[str]]:
    """Cells of every table row under the ``## section`` heading."""
    start = MAP.index(f"## {section}")
    end = MAP.find("\n## ", start + 1)
    rows = []
    for line in MAP[start : end if end != -1 else None].splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def check_vllm_citation(path: str, name: str, line: int) -> str | None:
    entry = DATA.get(path)
    if entry is None:
        return f"{path} is not a vLLM file at 52a31cc"
    actual = entry["qualified"].get(name)
    if actual != line:
        return f"{path}: {name} is defined at {actual}, the map says {line}"
    bare = name.rsplit(".", 1)[-1]
    if bare in entry["symbols"] and line not in entry["symbols"][bare]:
        return f"{path}: the symbol index has {bare} at {entry['symbols'][bare]}, not {line}"
    return None


def test_source_map_is_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_source_map.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_every_module_opens_with_a_docstring():
    missing = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if path.stat().st_size > 0 and not ast.get_docstring(tree):
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"modules without a docstring: {missing}"


def test_every_engine_module_has_an_entry():
    cited = set(re.findall(r"`(engine/[\w/.]+\.py)`", MAP))
    missing = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.stat().st_size == 0 or "__pycache__" in path.parts:
            continue
        if rel not in cited:
            missing.append(rel)
    assert not missing, f"modules missing from docs/source_map.md: {missing}"


def test_module_rows_cite_real_paths_names_and_lines():
    rows = [r for r in MAP.splitlines() if ROW_START.match(r)]
    assert len(rows) > 80, "the module tables went missing"
    problems = []
    sources: dict[str, str] = {}
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        ours = ROW_START.match(row).group(1)
        twin_cell, names_cell = cells[1], cells[4]
        if not (ROOT / ours).is_file():
            problems.append(f"{ours} does not exist")
            continue
        source = sources.setdefault(ours, (ROOT / ours).read_text())
        if twin_cell == "—":  # a Glassbox-only module: our names only
            for name, our_line, their_line, _ in NAME_LINES.findall(names_cell):
                if their_line != "–" or defined_at(source, name) != int(our_line):
                    problems.append(f"{ours}: {name} is not defined at line {our_line}")
            continue
        twin = re.match(r"`(vllm/[\w/.\-]+\.py)`", twin_cell).group(1)
        if twin not in DATA or twin not in VLLM_PATHS or "not in vLLM" in twin_cell:
            problems.append(f"{ours}: its twin {twin} does not exist at 52a31cc")
            continue
        m = re.search(r"\((\d+) lines\)", twin_cell)
        if m is None or int(m.group(1)) != DATA[twin]["lines"]:
            problems.append(
                f"{ours}: {twin} has {DATA[twin]['lines']} lines, the map says {twin_cell}"
            )
        for name, our_line, their_line, alias in NAME_LINES.findall(names_cell):
            if defined_at(source, name) != int(our_line):
                problems.append(f"{ours}: {name} is not defined at line {our_line}")
            qualified = DATA[twin]["qualified"]
            if their_line == "–":  # Glassbox's own: vLLM's twin must not define it
                if name in qualified or vllm_name(name) in qualified:
                    problems.append(f"{ours}: {name} is shown as Glassbox's own; {twin} has it")
                continue
            theirs = alias or (name if name in qualified else vllm_name(name))
            problem = check_vllm_citation(twin, theirs, int(their_line))
            if problem:
                problems.append(problem)
    assert not problems, "\n".join(problems)


def test_stale_table_rows_are_stale_and_their_citations_real():
    rows = table_rows("The seeds' stale paths and symbols")[1:]  # skip the header
    assert len(rows) >= 25
    problems = []
    for seed, said, status, now, ours, _note in rows:
        m = OLD_CLAIM.match(said)
        assert m, f"unparsable claim {said!r}"
        old_path, old_name, approx = m.group(1), m.group(2), m.group(3)
        if status != "detail":
            problem = _old_claim_problem(
                old_path, old_name, int(approx) if approx else None, status
            )
            if problem:
                problems.append(f"{seed} {said}: {problem}")
        for path, line, name in CITATION.findall(now):
            problem = check_vllm_citation(path, name, int(line))
            if problem:
                problems.append(problem)
        for path, line, name in CITATION.findall(ours):
            if defined_at((ROOT / path).read_text(), name) != int(line):
                problems.append(f"{path}: {name} is not defined at line {line}")
        for path in re.findall(r"`(vllm/[\w/.\-]+\.py)`", now):
            if path not in VLLM_PATHS:
                problems.append(f"{path} does not exist at 52a31cc")
    assert not problems, "\n".join(problems)


def _old_claim_problem(path: str, name: str | None, approx: int | None, status: str) -> str | None:
    if path.endswith("/"):
        files = [p for p in VLLM_PATHS if p.startswith(path)]
        if name is None:
            return f"{path} still exists" if files else None
        for p in files:
            if p in DATA and name in DATA[p]["qualified"]:
                return f"{name} is still in {p}"
        unchecked = [p for p in files if p not in DATA]
        return f"files under {path} missing from the data: {unchecked}" if unchecked else None
    if path not in VLLM_PATHS:
        return (
            "the file is gone, but the status says lines moved" if status == "lines moved" else None
        )
    if name is None:
        return f"{path} still exists"
    line = DATA[path]["qualified"].get(name)
    if status == "lines moved":
        if line is None:
            return "the name is gone"
        return None if abs(line - approx) > 10 else f"still near line {approx} (at {line})"
    return f"{name} still exists at line {line}" if line is not None else None


def test_named_twin_symbols_exist_at_the_pinned_commit():
    # Key twins a reader of the seven sessions needs, with vLLM's own names.
    for twin, names in {
        "vllm/v1/core/sched/scheduler.py": [
            "Scheduler",
            "Scheduler.schedule",
            "Scheduler.update_from_output",
            "Scheduler._preempt_request",
        ],
        "vllm/v1/core/kv_cache_manager.py": [
            "KVCacheManager",
            "KVCacheManager.get_computed_blocks",
            "KVCacheManager.allocate_slots",
            "KVCacheManager.free",
        ],
        "vllm/v1/core/block_pool.py": [
            "BlockPool",
            "BlockPool.get_new_blocks",
            "BlockPool.free_blocks",
            "BlockPool.touch",
        ],
        "vllm/v1/core/kv_cache_utils.py": [
            "KVCacheBlock",
            "FreeKVCacheBlockQueue",
            "get_request_block_hasher",
        ],
    }.items():
        assert twin in DATA, twin
        for name in names:
            assert name in DATA[twin]["qualified"], (twin, name)
        assert f"`{twin}`" in MAP


def test_the_checks_catch_a_wrong_line():
    # The row checks above must be able to fail: a shifted line is reported.
    entry = DATA["vllm/v1/core/block_pool.py"]
    line = entry["qualified"]["BlockPool.get_new_blocks"]
    assert (
        check_vllm_citation("vllm/v1/core/block_pool.py", "BlockPool.get_new_blocks", line) is None
    )
    assert check_vllm_citation("vllm/v1/core/block_pool.py", "BlockPool.get_new_blocks", line + 1)
    src = (ROOT / "engine" / "v1" / "core" / "block_pool.py").read_text()
    assert defined_at(src, "BlockPool.get_new_blocks") is not None
    assert defined_at(src, "BlockPool.no_such_method") is None


def _anchors(markdown: str) -> set[str]:
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', markdown))
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("doc", ["architecture.md"])
def test_links_into_the_source_map_resolve(doc):
    text = (ROOT / "docs" / doc).read_text()
    links = re.findall(r"source_map\.md#([\w\-]+)", text)
    assert links, f"docs/{doc} links nowhere into the source map"
    anchors = _anchors(MAP)
    missing = sorted(set(links) - anchors)
    assert not missing, f"docs/{doc} links to anchors the map lacks: {missing}"


def test_architecture_timings_match_the_committed_trace():
    # The table in docs/architecture.md is computed from docs/data/architecture_trace.jsonl.
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_architecture_diagram.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (ROOT / "docs" / "images" / "architecture.svg").is_file()


def test_every_vllm_citation_in_the_map_is_real():
    # `vllm/...py:123 Name` anywhere (stale table, section notes): the name is defined there.
    citations = set(re.findall(r"`(vllm/[\w/.\-]+\.py):(\d+) ([\w.]+)`", MAP))
    assert citations
    problems = [check_vllm_citation(path, name, int(line)) for path, line, name in citations]
    assert not any(problems), "\n".join(p for p in problems if p)


def test_the_tracing_package_is_listed_once_in_its_own_section():
    section = MAP[MAP.index("## The tracing package") :]
    section = section[: section.index("\n## ")]
    modules = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "engine" / "tracing").glob("*.py")
        if p.stat().st_size > 0
    )
    for rel in modules:
        rows = [r for r in MAP.splitlines() if ROW_START.match(r) and ROW_START.match(r)[1] == rel]
        assert len(rows) == 1, f"{rel} has {len(rows)} rows in the module tables"
        assert rows[0] in section, f"{rel} is listed outside the tracing section"


def test_names_vllm_defines_in_another_class_or_file_point_there():
    # vLLM's IncrementalDetokenizer is a no-op base; its subclass does the work.
    detok = next(r for r in MAP.splitlines() if "`engine/v1/engine/detokenizer.py` |" in r)
    base = DATA["vllm/v1/engine/detokenizer.py"]["qualified"]
    for method in ("update", "get_next_output_text"):
        line = base[f"BaseIncrementalDetokenizer.{method}"]
        assert f"/{line} (vLLM: `BaseIncrementalDetokenizer.{method}`)" in detok, method
    tok = next(r for r in MAP.splitlines() if "`engine/transformers_utils/tokenizer.py` |" in r)
    line = DATA["vllm/tokenizers/registry.py"]["qualified"]["get_tokenizer"]
    assert "`vllm/tokenizers/registry.py`" in tok and f"`get_tokenizer` 12/{line}" in tok
