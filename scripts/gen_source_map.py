#!/usr/bin/env python3
"""Generate docs/source_map.md: every Glassbox module beside its vLLM twin.

What goes into the map, and where it comes from:

* **Modules.** Every ``engine/**/*.py``. Its twin is read from the module
  docstring (``vLLM twin: ``vllm/...````; a package path ``vllm/x/`` means its
  ``__init__.py``); its sessions from the docstring's ``Sessions:`` line. A
  module whose docstring names no twin can be given one in ``TWIN_OVERRIDES``
  below; otherwise it is listed as Glassbox-only.
* **Shared names.** Each class, method, function (and capitalised module-level
  name such as ``BlockHash``) defined in both files under the same qualified
  name (``Class.method``; "Glassbox" read as "Vllm"), with the line on each
  side; ``NAME_TWINS`` pairs a name with a vLLM name of another class in the
  twin (``IncrementalDetokenizer.update`` with ``BaseIncrementalDetokenizer.update``).
  Our lines come from parsing ``engine/``; vLLM's from the symbol index
  ``../shared/reference/vllm_symbols_52a31cc.json``, with class membership
  (which ``forward`` belongs to which class) taken from vLLM's source at the
  pinned commit (a git mirror, ``--vllm-repo``) and cross-checked against the
  index.
* **Glassbox's own names.** In a module with a twin, each class, function or
  method whose docstring says "Glassbox's own" (a name vLLM does not have),
  with our line only.
* **The tracing package** (``engine/tracing/``) is listed once, in a section of
  its own, whatever sessions its modules name.
* **The seeds' stale paths and symbols** (``STALE`` below): what the reading
  plan says, and where it lives at 52a31cc. Each entry is checked here and
  again by ``tests/test_source_map.py``.
* **What Glassbox simplifies**: a short summary (``SIMPLIFICATIONS``) and, per
  module, the first sentence of its docstring's "Simpler than vLLM" note.

Everything the map cites from vLLM is vendored into ``docs/data/`` so the test
can check the map without ../shared or the mirror:

* ``docs/data/vllm_twins_52a31cc.json``: ``{path: {"lines", "symbols", "qualified"}}``
  for every vLLM file the map cites (``symbols``: name -> lines, as in the
  index; ``qualified``: ``Class.method`` -> line);
* ``docs/data/vllm_paths_52a31cc.txt``: every ``.py`` path under ``vllm/`` at 52a31cc.

Run after adding or changing a module (other modules need no edit here):

    .venv/bin/python scripts/gen_source_map.py            # regenerate map + data
    .venv/bin/python scripts/gen_source_map.py --check    # fail if the map is stale

Without the reference folder or the mirror the generator reuses the vendored
data for files it has seen and warns about any new twin it cannot resolve.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "52a31cc"
COMMIT_DATE = "2026-05-27"
DATA_DIR = ROOT / "docs" / "data"
DATA_SYMBOLS = DATA_DIR / f"vllm_twins_{COMMIT}.json"
DATA_PATHS = DATA_DIR / f"vllm_paths_{COMMIT}.txt"
DEFAULT_REFERENCE = ROOT.parent / "shared" / "reference"
DEFAULT_MIRROR = Path(
    os.environ.get("GLASSBOX_VLLM_REPO", "/work/.mirror/local-inference-lab+vllm/repo")
)

# Modules whose docstring does not name a twin (or names it in a form the
# parser misses) can be mapped here: "engine/<path>.py": (["vllm/<path>.py"], ["04"]).
# Leave the session list empty to keep the docstring's sessions.
TWIN_OVERRIDES: dict[str, tuple[list[str], list[str]]] = {
    # The docstring names the package; the function's twin is in registry.py.
    "engine/transformers_utils/tokenizer.py": (["vllm/tokenizers/registry.py"], []),
}

# A name whose twin is a name of another class in the twin module:
# (Glassbox module, our qualified name) -> vLLM's qualified name.
NAME_TWINS: dict[tuple[str, str], str] = {
    # vLLM's IncrementalDetokenizer is the no-op base; the work is in its subclass.
    (
        "engine/v1/engine/detokenizer.py",
        "IncrementalDetokenizer.update",
    ): "BaseIncrementalDetokenizer.update",
    (
        "engine/v1/engine/detokenizer.py",
        "IncrementalDetokenizer.get_next_output_text",
    ): "BaseIncrementalDetokenizer.get_next_output_text",
}

# The package listed once, in its own section.
TRACING = "engine/tracing/"
# A docstring containing this marks a name vLLM does not have.
OWN_MARK = re.compile(r"Glassbox['’]s own")

TWIN_RE = re.compile(r"vLLM twins?:\s*(.*?)(?:\n\s*\n|\.\s*\n)", re.S)
PATH_RE = re.compile(r"``(vllm/[\w/.\-]+?(?:\.py|/))``")
SESSION_RE = re.compile(r"Sessions?:\s*([^\n]*)")
SIMPLER_RE = re.compile(r"Simpler than vLLM:?\s*(.*?)(?:\n\s*\n|\Z)", re.S | re.I)
# A behaviour that differs from vLLM's on purpose, with the reason (the whole paragraph).
DIFFERS_RE = re.compile(r"Differs from vLLM on purpose:?\s*(.*?)(?:\n\s*\n|\Z)", re.S | re.I)
# vLLM features Glassbox leaves out for good (not "not yet": those are issues), each with
# vLLM's home, what Glassbox does when asked for it, and why. Rendered in the "differs on
# purpose" section beside the per-module paragraphs.
SCOPE_DIFFERENCES: list[tuple[str, str, str, str]] = [
    (
        "Pooling and embedding models",
        "`vllm/pooling_params.py`, `vllm/v1/pool/`",
        "`Request.pooling_params` must be None; a value is a `ValueError` naming the field",
        "Glassbox follows one generated token from prompt to sampler; a pooling "
        "request never reaches the sampler, so it would teach none of the seven sessions",
    ),
    (
        "Multimodal inputs and the encoder cache",
        "`vllm/multimodal/`, `vllm/v1/core/encoder_cache_manager.py`",
        "`Request.mm_features` must be empty; the scheduler has no encoder budget",
        "the supported models (Llama, Qwen2, Qwen3) are text-only; an encoder budget "
        "would add a second resource to every scheduling decision the notebooks explain",
    ),
    (
        "Prompt embeddings",
        "`Request.prompt_embeds`, `vllm/v1/worker/gpu_model_runner.py`",
        "`Request.prompt_embeds` must be None",
        "prompts are token ids everywhere, so block hashing and the runner's inputs "
        "stay one tensor of ids",
    ),
    (
        "Encoder-decoder models",
        "`vllm/v1/core/sched/scheduler.py` (`is_encoder_decoder`)",
        "no such model is registered",
        "no supported model needs cross-attention",
    ),
    (
        "KV connectors, disaggregated prefill, KV offloading, EC connectors",
        "`vllm/distributed/kv_transfer/`, `vllm/distributed/ec_transfer/`",
        "`RequestStatus.WAITING_FOR_REMOTE_KVS` exists (the skipped-waiting queue "
        "handles it) but nothing sets it",
        "one engine owns its whole KV cache; remote KV needs a second engine and a "
        "transport, outside what one machine of the course runs",
    ),
    (
        "Data, pipeline, context and expert parallelism",
        "`vllm/v1/engine/coordinator.py`, `vllm/distributed/`",
        "`ParallelConfig` has no pipeline, data, context or expert parallel sizes",
        "one model replica on one host; tensor parallelism is the parallelism session 07 teaches",
    ),
    (
        "Hybrid, sliding-window and Mamba KV cache groups",
        "`vllm/v1/core/single_type_kv_cache_manager.py`, `vllm/v1/core/kv_cache_coordinator.py`",
        "one full-attention group (`UnitaryKVCacheCoordinator`)",
        "the supported models use full attention in every layer",
    ),
    (
        "Streaming input sessions (resumable requests)",
        "`vllm/v1/request.py` (`StreamingUpdate`)",
        "`RequestStatus.WAITING_FOR_STREAMING_REQ` exists but nothing sets it",
        "a request's prompt is complete when it arrives, as in the OpenAI API",
    ),
    (
        "KV cache events, KV metrics sampling, OpenTelemetry spans",
        "`vllm/distributed/kv_events.py`, `vllm/v1/core/kv_cache_metrics.py`, `vllm/tracing/`",
        "none; the Glassbox trace records the same moments (Prometheus metrics are kept)",
        "one trace file serves the TUI, the notebooks and Perfetto; a second "
        "event stream would duplicate it",
    ),
    (
        "Pickle fallback in serialization",
        "`vllm/v1/serial_utils.py`",
        "a value msgpack cannot express is a `TypeError` naming its type",
        "only Glassbox's own msgspec structs cross the process hop",
    ),
]

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
MAX_NAMES_SHOWN = 16


# ---------------------------------------------------------------------------
# Symbols of a Python file: qualified name -> line
# ---------------------------------------------------------------------------
def qualified_symbols(source: str) -> dict[str, int]:
    """``Class``, ``Class.method``, ``func``, ``func.inner``, capitalised
    module-level names (``BlockHash = NewType(...)``) and upper-case class
    constants (``RequestStatus.WAITING``), each with the line it is defined on
    (the ``def`` / ``class`` line, not a decorator's)."""
    out: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        out.setdefault(name, line)

    def walk(body: list[ast.stmt], prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + node.name
                add(name, node.lineno)
                walk(node.body, name + ".", isinstance(node, ast.ClassDef))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if not isinstance(t, ast.Name) or len(t.id) < 2:
                        continue
                    if (not prefix and t.id[0].isupper()) or (in_class and t.id.isupper()):
                        add(prefix + t.id, node.lineno)

    walk(ast.parse(source).body, "", False)
    return out


def vllm_name(name: str) -> str:
    """Our names swap "vllm" for "glassbox"; swap back to find the twin."""
    return name.replace("Glassbox", "Vllm").replace("glassbox", "vllm")


# ---------------------------------------------------------------------------
# vLLM data: reference index (+ mirror for class membership), or the vendored copy
# ---------------------------------------------------------------------------
class VllmData:
    def __init__(self, reference: Path | None, mirror: Path | None) -> None:
        self.vendored: dict[str, dict] = (
            json.loads(DATA_SYMBOLS.read_text()) if DATA_SYMBOLS.exists() else {}
        )
        self.index: dict[str, dict] | None = None
        self.paths: set[str] | None = None
        self.mirror = mirror if mirror is not None and (mirror / "HEAD").exists() else None
        self.warnings: list[str] = []
        if reference is not None and (reference / f"vllm_symbols_{COMMIT}.json").exists():
            self.index = json.loads((reference / f"vllm_symbols_{COMMIT}.json").read_text())
            files = (reference / f"vllm_files_{COMMIT}.txt").read_text().split()
            self.paths = {p for p in files if p.endswith(".py")}
        elif DATA_PATHS.exists():
            self.paths = set(DATA_PATHS.read_text().split())
        self.used: dict[str, dict] = {}

    def exists(self, path: str) -> bool:
        if path in self.vendored or (self.index is not None and path in self.index):
            return True
        return self.paths is not None and path in self.paths

    def package_exists(self, prefix: str) -> bool:
        assert prefix.endswith("/")
        return self.paths is not None and any(p.startswith(prefix) for p in self.paths)

    def files_under(self, prefix: str) -> list[str]:
        return sorted(p for p in (self.paths or ()) if p.startswith(prefix))

    def entry(self, path: str) -> dict | None:
        """{lines, symbols, qualified} of a vLLM file, recorded as used."""
        if path in self.used:
            return self.used[path]
        entry = None
        if self.index is not None and path in self.index:
            base = self.index[path]
            qualified = self._qualified(path, base)
            entry = {"lines": base["lines"], "symbols": base["symbols"], "qualified": qualified}
        elif path in self.vendored:
            entry = self.vendored[path]
        if entry is not None:
            self.used[path] = entry
        return entry

    def _qualified(self, path: str, base: dict) -> dict[str, int]:
        source = None
        if self.mirror is not None:
            try:
                source = subprocess.run(
                    ["git", "-C", str(self.mirror), "show", f"{COMMIT}:{path}"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            except subprocess.CalledProcessError:
                source = None
        if source is None:
            old = self.vendored.get(path, {}).get("qualified")
            if old is not None:
                return old
            self.warnings.append(
                f"{path}: no vLLM source (mirror) to place methods in classes; top-level names only"
            )
            return {}
        qualified = qualified_symbols(source)
        # The index lists defs and classes; every one we place must agree with it.
        for qual, line in list(qualified.items()):
            bare = qual.rsplit(".", 1)[-1]
            is_def = line in base["symbols"].get(bare, [])
            if bare in base["symbols"] and not is_def:
                self.warnings.append(
                    f"{path}: {qual} at :{line} is not in the symbol index; dropped"
                )
                del qualified[qual]
        return qualified


# ---------------------------------------------------------------------------
# Glassbox modules
# ---------------------------------------------------------------------------
@dataclass
class Module:
    rel: str
    doc: str
    twins: list[str]
    sessions: list[str]
    symbols: dict[str, int]
    summary: str
    simpler: str | None
    differs: str | None = None
    # Names whose docstring marks them as Glassbox's own, in definition order.
    own: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)


def module_twins(doc: str) -> list[str]:
    m = TWIN_RE.search((doc or "") + "\n\n")
    if not m or m.group(1).lower().startswith("none"):
        return []  # "vLLM twin: none (... ``vllm/x/`` ...)" names a path but no twin
    return [p + "__init__.py" if p.endswith("/") else p for p in PATH_RE.findall(m.group(1))]


def module_sessions(doc: str) -> list[str]:
    m = SESSION_RE.search((doc or "") + "\n")
    if not m:
        return []
    found = re.findall(r"\b0[1-7]\b", m.group(1))
    return found or (["all"] if re.search(r"\ball\b", m.group(1)) else [])


def first_sentence(text: str) -> str:
    text = " ".join(text.split()).lstrip("-* ")
    m = re.match(r"(.+?[.;])(\s|$)", text)
    return (m.group(1) if m else text).rstrip(";").rstrip(".") + "."


def load_modules() -> list[Module]:
    modules = []
    for path in sorted(p for p in (ROOT / "engine").rglob("*.py") if "__pycache__" not in p.parts):
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        doc = ast.get_docstring(ast.parse(source)) or ""
        twins = module_twins(doc)
        sessions = module_sessions(doc)
        if rel in TWIN_OVERRIDES:
            twins, override_sessions = TWIN_OVERRIDES[rel]
            sessions = override_sessions or sessions
        simpler = SIMPLER_RE.search(doc)
        differs = DIFFERS_RE.search(doc)
        modules.append(
            Module(
                rel=rel,
                doc=doc,
                twins=twins,
                sessions=sessions or ["--"],
                symbols=qualified_symbols(source),
                summary=" ".join(doc.strip().split("\n\n")[0].split()) if doc else "",
                simpler=first_sentence(simpler.group(1))
                if simpler and simpler.group(1).strip()
                else None,
                differs=" ".join(differs.group(1).split()) if differs else None,
                own=own_names(source),
            )
        )
    return modules


def own_names(source: str) -> list[str]:
    """Classes, functions and methods (``Class.method``) whose docstring marks
    them as Glassbox's own."""
    found: list[str] = []

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + node.name
                if OWN_MARK.search(ast.get_docstring(node) or ""):
                    found.append(name)
                if isinstance(node, ast.ClassDef):
                    walk(node.body, name + ".")

    walk(ast.parse(source).body, "")
    return found


def anchor(rel: str) -> str:
    """The HTML anchor of a module's row:
    engine/v1/core/block_pool.py -> engine-v1-core-block_pool-py."""
    return re.sub(r"[/.]", "-", rel)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def session_cell(mod: Module) -> str:
    return ", ".join(s for s in mod.sessions if s != "--") or "—"


def our_names(mod: Module, limit: int = 8) -> str:
    """A module's main top-level names with our lines (``name 12/–``)."""
    top = [q for q in mod.symbols if "." not in q and not q.startswith("_") and not q.isupper()][
        :limit
    ]
    return ", ".join(f"`{q}` {mod.symbols[q]}/–" for q in top) or "—"


def module_rows(mod: Module, data: VllmData) -> list[str]:
    rows = []
    sessions = session_cell(mod)
    for i, twin in enumerate(mod.twins):
        entry = data.entry(twin)
        glassbox = f"`{mod.rel}`" if i else f'<a id="{anchor(mod.rel)}"></a>`{mod.rel}`'
        if entry is None:
            data.warnings.append(f"{mod.rel}: its twin {twin} does not exist in vLLM at {COMMIT}")
            rows.append(
                f"| {glassbox} | `{twin}` — **not in vLLM at {COMMIT}** | {sessions} | "
                f"{_cell(mod.summary)} | |"
            )
            continue
        theirs = entry["qualified"]
        shared = []
        for qual, ours in mod.symbols.items():
            if qual.rsplit(".", 1)[-1].startswith("__"):
                continue
            alias = NAME_TWINS.get((mod.rel, qual))
            if alias is not None:
                if alias not in theirs:
                    data.warnings.append(f"{mod.rel}: NAME_TWINS names {alias}, not in {twin}")
                    continue
                shared.append(f"`{qual}` {ours}/{theirs[alias]} (vLLM: `{alias}`)")
                continue
            line = theirs.get(qual, theirs.get(vllm_name(qual)))
            if line is not None:
                if qual in mod.own:
                    data.warnings.append(
                        f"{mod.rel}: {qual} is marked Glassbox's own; {twin} has it"
                    )
                shared.append(f"`{qual}` {ours}/{line}")
        if not shared and i == 0:
            # No shared names: show our main names so the row still points somewhere.
            shown = our_names(mod)
        elif not shared:
            shown = "—"
        else:
            shown = ", ".join(shared[:MAX_NAMES_SHOWN])
            if len(shared) > MAX_NAMES_SHOWN:
                shown += f", … (+{len(shared) - MAX_NAMES_SHOWN})"
        own = [q for q in mod.own if q not in theirs and vllm_name(q) not in theirs]
        own = [q for q in own if f"`{q}` " not in shown]
        if own and i == 0:
            shown += "; Glassbox's own: " + ", ".join(f"`{q}` {mod.symbols[q]}/–" for q in own)
        rows.append(
            f"| {glassbox} | `{twin}` ({entry['lines']} lines) | {sessions} | "
            f"{_cell(mod.summary)} | {shown} |"
        )
    return rows


# ---------------------------------------------------------------------------
# The seeds' stale paths and symbols
# ---------------------------------------------------------------------------
# status: what the check asserts about the seed's claim at 52a31cc
#   removed / renamed / moved / restructured -- the old path (or the old
#       qualified name in the old file, or anywhere under an old package) is gone;
#   lines moved -- the name is there, more than 10 lines from the seed's "~line";
#   detail -- the seed's wording is loose; "now" says exactly where it happens.
# old: (path or package/, qualified name or None, approximate line or None)
# now: [(vLLM path, qualified name)]; lines are looked up, never typed in.
STALE: list[dict] = [
    dict(
        seed="000",
        old=("vllm/v1/engine/engine_core.py", None, None),
        status="renamed",
        now=[
            ("vllm/v1/engine/core.py", "EngineCore"),
            ("vllm/v1/engine/core.py", "EngineCoreProc"),
        ],
        note="The engine core lives in `core.py`.",
    ),
    dict(
        seed="001 · 1",
        old=("vllm/v1/engine/core.py", "run_engine_core", None),
        status="restructured",
        now=[("vllm/v1/engine/core.py", "EngineCoreProc.run_engine_core")],
        note=(
            "A staticmethod of `EngineCoreProc` (the target of the engine-core process), not "
            "a module-level function."
        ),
    ),
    dict(
        seed="001 · 1",
        old=("vllm/v1/engine/async_llm.py", "AsyncLLM.generate", 315),
        status="lines moved",
        now=[("vllm/v1/engine/async_llm.py", "AsyncLLM.generate")],
        note="",
    ),
    dict(
        seed="001 · 1",
        old=("vllm/v1/engine/async_llm.py", "AsyncLLM.output_handler", 366),
        status="restructured",
        now=[
            ("vllm/v1/engine/async_llm.py", "AsyncLLM._run_output_handler"),
            ("vllm/v1/engine/async_llm.py", "AsyncLLM._run_output_handler.output_handler"),
        ],
        note="A coroutine defined inside `_run_output_handler` and started as a background task.",
    ),
    dict(
        seed="001 · 1",
        old=("vllm/v1/engine/core_client.py", "EngineCoreClient.get_output_async", None),
        status="detail",
        now=[
            ("vllm/v1/engine/core_client.py", "EngineCoreClient.get_output_async"),
            ("vllm/v1/engine/core_client.py", "AsyncMPClient.get_output_async"),
            ("vllm/v1/engine/core_client.py", "AsyncMPClient.add_request_async"),
        ],
        note="Abstract on `EngineCoreClient`; the ZMQ implementation is `AsyncMPClient`.",
    ),
    dict(
        seed="001 · 2",
        old=("vllm/v1/core/sched/scheduler.py", "Scheduler.schedule", 361),
        status="lines moved",
        now=[("vllm/v1/core/sched/scheduler.py", "Scheduler.schedule")],
        note=(
            "The seed's range ~361–438 is now the running-requests loop; the method spans "
            "about 600 lines."
        ),
    ),
    dict(
        seed="001 · 2",
        old=("vllm/v1/core/sched/scheduler.py", "Scheduler._try_schedule_new_request", None),
        status="removed",
        now=[
            ("vllm/v1/core/sched/scheduler.py", "Scheduler.schedule"),
            ("vllm/v1/core/sched/scheduler.py", "Scheduler._preempt_request"),
        ],
        note=(
            "Admission is inline in `schedule()`'s waiting loop; preemption (running loop "
            "only) is `_preempt_request`."
        ),
    ),
    dict(
        seed="001 · 2",
        old=("vllm/v1/request.py", "RequestStatus.FINISHED", None),
        status="renamed",
        now=[
            ("vllm/v1/request.py", "RequestStatus.FINISHED_STOPPED"),
            ("vllm/v1/request.py", "RequestStatus.FINISHED_LENGTH_CAPPED"),
            ("vllm/v1/request.py", "RequestStatus.FINISHED_ABORTED"),
            ("vllm/v1/request.py", "RequestStatus.is_finished"),
        ],
        note="One status per finish reason; every status after `PREEMPTED` counts as finished.",
    ),
    dict(
        seed="001 · 3",
        old=("vllm/v1/core/kv_cache_manager.py", "KVCacheManager.get_computed_blocks", 157),
        status="lines moved",
        now=[("vllm/v1/core/kv_cache_manager.py", "KVCacheManager.get_computed_blocks")],
        note="",
    ),
    dict(
        seed="001 · 3",
        old=(
            "vllm/v1/core/single_type_kv_cache_manager.py",
            "SingleTypeKVCacheManager.find_longest_cache_hit",
            236,
        ),
        status="lines moved",
        now=[
            (
                "vllm/v1/core/single_type_kv_cache_manager.py",
                "SingleTypeKVCacheManager.find_longest_cache_hit",
            ),
            (
                "vllm/v1/core/single_type_kv_cache_manager.py",
                "FullAttentionManager.find_longest_cache_hit",
            ),
        ],
        note=(
            "Abstract on the base class; the full-attention version is the one a dense model uses."
        ),
    ),
    dict(
        seed="001 · 3",
        old=("vllm/v1/core/kv_cache_manager.py", None, None),
        status="detail",
        now=[
            ("vllm/v1/core/kv_cache_coordinator.py", "KVCacheCoordinator"),
            ("vllm/v1/core/kv_cache_coordinator.py", "UnitaryKVCacheCoordinator"),
        ],
        note="`KVCacheManager` no longer talks to `SingleTypeKVCacheManager` directly: a "
        "coordinator sits in between, one manager per KV cache group.",
    ),
    dict(
        seed="001 · 3",
        old=("vllm/v1/core/kv_cache_utils.py", "BlockHashType", None),
        status="renamed",
        now=[
            ("vllm/v1/core/kv_cache_utils.py", "BlockHash"),
            ("vllm/v1/core/kv_cache_utils.py", "BlockHashWithGroupId"),
        ],
        note="A `NewType` over bytes; the prefix-cache key appends the KV cache group id.",
    ),
    dict(
        seed="001 · 3",
        old=("vllm/v1/core/kv_cache_utils.py", "hash_request_tokens", None),
        status="removed",
        now=[
            ("vllm/v1/core/kv_cache_utils.py", "get_request_block_hasher"),
            ("vllm/v1/core/kv_cache_utils.py", "hash_block_tokens"),
            ("vllm/v1/request.py", "Request.update_block_hashes"),
        ],
        note="Hashes are computed incrementally as a request's blocks fill, not all at once.",
    ),
    dict(
        seed="000",
        old=("vllm/v1/core/kv_cache_utils.py", "BlockHashToBlockMap", None),
        status="moved",
        now=[("vllm/v1/core/block_pool.py", "BlockHashToBlockMap")],
        note="",
    ),
    dict(
        seed="001 · 4",
        old=("vllm/v1/worker/gpu_worker.py", "Worker.initialize_cache", None),
        status="renamed",
        now=[("vllm/v1/worker/gpu_worker.py", "Worker.initialize_from_config")],
        note="",
    ),
    dict(
        seed="001 · 4",
        old=("vllm/v1/worker/gpu_model_runner.py", None, None),
        status="detail",
        now=[
            ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner"),
            ("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner"),
            ("vllm/v1/worker/gpu/model_runner.py", "GPUModelRunner.prepare_inputs"),
        ],
        note="There are two runners: V1 (the seed's file) and V2 under `worker/gpu/`, the "
        "default for dense Qwen3 since 2026-05. Glassbox mirrors V1.",
    ),
    dict(
        seed="001 · 4",
        old=("vllm/v1/worker/gpu_model_runner.py", None, None),
        status="detail",
        now=[
            (
                "vllm/v1/worker/gpu_model_runner.py",
                "GPUModelRunner._determine_batch_execution_and_padding",
            ),
            ("vllm/v1/cudagraph_dispatcher.py", "CudagraphDispatcher.dispatch"),
        ],
        note="Where padding to a captured size is decided (the session's exercise).",
    ),
    dict(
        seed="001 · 4",
        old=("vllm/v1/attention/backend.py", "AttentionMetadata", None),
        status="detail",
        now=[
            ("vllm/v1/attention/backend.py", "AttentionMetadata"),
            ("vllm/v1/attention/backend.py", "CommonAttentionMetadata"),
            ("vllm/v1/attention/backend.py", "AttentionMetadataBuilder.build"),
        ],
        note="`AttentionMetadata` is an empty base class; block tables and slot mappings travel in "
        "`CommonAttentionMetadata`, which each backend's builder turns into its own metadata.",
    ),
    dict(
        seed="001 · lifecycle",
        old=("vllm/v1/executor/abstract.py", None, None),
        status="detail",
        now=[
            ("vllm/v1/executor/abstract.py", "Executor.execute_model"),
            ("vllm/v1/executor/abstract.py", "Executor.sample_tokens"),
        ],
        note="Two phases: `execute_model` runs the forward and returns nothing; "
        "`sample_tokens` returns the `ModelRunnerOutput`.",
    ),
    dict(
        seed="001 · lifecycle",
        old=("vllm/v1/core/sched/output.py", None, None),
        status="detail",
        now=[
            ("vllm/v1/core/sched/output.py", "SchedulerOutput"),
            ("vllm/v1/core/sched/output.py", "NewRequestData"),
            ("vllm/v1/core/sched/output.py", "CachedRequestData"),
            ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner._prepare_inputs"),
        ],
        note="`SchedulerOutput` carries token counts and *new* block ids per request, not "
        "positions or whole block tables; the runner derives those in `_prepare_inputs`.",
    ),
    dict(
        seed="001 · lifecycle",
        old=("vllm/v1/engine/output_processor.py", None, None),
        status="detail",
        now=[
            ("vllm/v1/engine/__init__.py", "EngineCoreOutputs"),
            ("vllm/v1/engine/output_processor.py", "OutputProcessor.process_outputs"),
            ("vllm/v1/engine/output_processor.py", "RequestOutputCollector"),
        ],
        note=(
            "The core sends `EngineCoreOutputs`; `RequestOutput`s are made in the front end, "
            "and detokenised there."
        ),
    ),
    dict(
        seed="000",
        old=("vllm/v1/outputs.py", "ModelOutput", None),
        status="renamed",
        now=[("vllm/v1/outputs.py", "ModelRunnerOutput")],
        note="",
    ),
    dict(
        seed="000",
        old=("vllm/model_executor/layers/attention/attention.py", "RadixAttention", None),
        status="renamed",
        now=[("vllm/model_executor/layers/attention/attention.py", "Attention")],
        note="`RadixAttention` is SGLang's layer; vLLM's is `Attention`.",
    ),
    dict(
        seed="000",
        old=("vllm/quantization/", None, None),
        status="moved",
        now=[("vllm/model_executor/layers/quantization/base_config.py", "QuantizationConfig")],
        note="",
    ),
    dict(
        seed="001 · 5",
        old=("vllm/v1/sample/logits_processor.py", None, None),
        status="moved",
        now=[
            ("vllm/v1/sample/logits_processor/interface.py", "LogitsProcessor"),
            ("vllm/v1/sample/logits_processor/__init__.py", "build_logitsprocs"),
        ],
        note="Now a package.",
    ),
    dict(
        seed="001 · 5",
        old=("vllm/v1/attention/backends/flash_attn.py", "FlashAttentionBackend.forward", None),
        status="moved",
        now=[("vllm/v1/attention/backends/flash_attn.py", "FlashAttentionImpl.forward")],
        note="Backends are classes of static methods; the kernel call is on the `Impl`.",
    ),
    dict(
        seed="001 · 6",
        old=("vllm/v1/spec_decode/eagle.py", "EagleProposer.propose_draft_tokens", None),
        status="removed",
        now=[
            ("vllm/v1/spec_decode/eagle.py", "EagleProposer"),
            ("vllm/v1/spec_decode/llm_base_proposer.py", "SpecDecodeBaseProposer.propose"),
        ],
        note="`EagleProposer` is a short subclass; drafting is in the shared base class.",
    ),
    dict(
        seed="001 · 6",
        old=("vllm/v1/structured_output/", "Grammar", None),
        status="renamed",
        now=[
            ("vllm/v1/structured_output/backend_types.py", "StructuredOutputGrammar"),
            ("vllm/v1/structured_output/__init__.py", "StructuredOutputManager"),
            ("vllm/v1/structured_output/utils.py", "apply_grammar_bitmask"),
        ],
        note=(
            "The bitmask is applied by the model runner (`GPUModelRunner.sample_tokens` calls "
            "`apply_grammar_bitmask`) before the sampler runs, not by the sampler or a logits "
            "processor as the plan says."
        ),
    ),
    dict(
        seed="001 · 7",
        old=("vllm/v1/executor/ray_distributed_executor.py", None, None),
        status="removed",
        now=[("vllm/v1/executor/ray_executor.py", "RayDistributedExecutor")],
        note="Removed 2026-04.",
    ),
    dict(
        seed="001",
        old=("vllm/core/", None, None),
        status="removed",
        now=[],
        note="V0 is gone (with `vllm/worker/`, `vllm/executor/`, `BlockSpaceManagerV1/V2`).",
    ),
    dict(seed="001", old=("vllm/worker/", None, None), status="removed", now=[], note=""),
    dict(
        seed="§5",
        old=("vllm/v1/engine/processor.py", None, None),
        status="renamed",
        now=[("vllm/v1/engine/input_processor.py", "InputProcessor")],
        note="",
    ),
    dict(
        seed="§5",
        old=("vllm/tracing.py", None, None),
        status="moved",
        now=[("vllm/tracing/__init__.py", None)],
        note="Now a package (OpenTelemetry spans).",
    ),
    dict(
        seed="§5",
        old=("vllm/attention/", None, None),
        status="moved",
        now=[
            ("vllm/v1/attention/backend.py", "AttentionBackend"),
            ("vllm/model_executor/layers/attention/attention.py", "Attention"),
        ],
        note="",
    ),
]

OLD_CELL_RE = re.compile(r"`(vllm/[\w/.\-]+)`(?: · `([\w.]+)`)?(?: ~(\d+))?")


def cite(path: str, qual: str | None, line: int | None) -> str:
    """The one citation form the test parses: `path:line Name` (or just `path`)."""
    return f"`{path}:{line} {qual}`" if qual else f"`{path}`"


def our_twin_of(vllm_path: str, qual: str | None, modules: list[Module]) -> list[str]:
    out = []
    for mod in modules:
        if vllm_path not in mod.twins or qual is None:
            continue
        for ours, line in mod.symbols.items():
            if ours == qual or vllm_name(ours) == qual:
                out.append(cite(mod.rel, ours, line))
                break
    return out


def stale_rows(data: VllmData, modules: list[Module]) -> list[str]:
    rows = []
    for item in STALE:
        path, qual, approx = item["old"]
        status = item["status"]
        problem = check_old_claim(data, path, qual, approx, status)
        if problem:
            data.warnings.append(f"STALE entry {path} {qual}: {problem}")
        said = f"`{path}`" + (f" · `{qual}`" if qual else "") + (f" ~{approx}" if approx else "")
        now, ours = [], []
        for npath, nqual in item["now"]:
            entry = data.entry(npath)
            if entry is None:
                data.warnings.append(f"STALE entry: {npath} does not exist at {COMMIT}")
                continue
            if nqual is None:
                now.append(cite(npath, None, None))
                continue
            line = entry["qualified"].get(nqual)
            if line is None:
                data.warnings.append(f"STALE entry: {nqual} not found in {npath}")
                continue
            now.append(cite(npath, nqual, line))
            ours += our_twin_of(npath, nqual, modules)
        note = item["note"]
        rows.append(
            f"| {item['seed']} | {said} | {status} | {'<br>'.join(now) or '—'} | "
            f"{'<br>'.join(dict.fromkeys(ours)) or '—'} | {_cell(note)} |"
        )
    return rows


def check_old_claim(
    data: VllmData, path: str, qual: str | None, approx: int | None, status: str
) -> str | None:
    """None when the seed's claim is indeed stale in the way ``status`` says."""
    if status == "detail":
        return None
    if path.endswith("/"):
        if qual is None:
            return "the package still exists" if data.package_exists(path) else None
        for p in data.files_under(path):
            entry = data.entry(p)
            if entry and qual in entry["qualified"]:
                return f"{qual} still exists in {p}"
        return None
    if not data.exists(path):
        return None if status != "lines moved" else "the file is gone"
    if qual is None:
        return "the file still exists"
    entry = data.entry(path)
    line = entry["qualified"].get(qual) if entry else None
    if status == "lines moved":
        if line is None:
            return "the name is gone"
        return None if abs(line - approx) > 10 else "the line has not moved"
    return f"{qual} still exists at :{line}" if line is not None else None


# ---------------------------------------------------------------------------
# What Glassbox simplifies
# ---------------------------------------------------------------------------
SIMPLIFICATIONS = """\
Glassbox keeps vLLM's structure (the same files, classes, methods and message
types) and drops what a reader of one request's path does not need. The
larger cuts, and why:

* **One KV cache group, one attention type.** Only full attention, so the
  coordinator is the unitary one and there is one `FullAttentionManager`; the
  hybrid / sliding-window / Mamba managers would triple session 03's reading
  without changing how a prefix hit or an eviction works.
* **No speculative decoding, structured output, LoRA, multimodal or pooling
  yet.** Each adds fields to `Request`, `SchedulerOutput` and the runner; they
  arrive with sessions 05–06, in their own modules.
* **FULL_DECODE_ONLY CUDA graphs, no torch.compile.** Piecewise graphs need
  vLLM's compiler backend; full decode graphs show capture sizes, padding and
  persistent buffers (session 04) on their own.
* **One worker (tensor parallel size 1), no pipeline or data parallelism.**
  The executor interface is vLLM's, so a multi-process executor can be added
  behind it (session 07).
* **Plain-torch layers and CPU attention.** Kernels are readable torch (or
  Triton on GPU) instead of custom CUDA ops, so every step also runs on a
  laptop CPU — which is what the notebooks and CI use.
* **A trace instead of metrics-only observability.** Every scheduling
  decision, block move and sampled token is an event (`engine/tracing/`), so
  the notebooks answer their exercises from what actually happened.

Each module's docstring says what it leaves out; the first sentence of each:
"""


# ---------------------------------------------------------------------------
# The document
# ---------------------------------------------------------------------------
def build(data: VllmData) -> str:
    modules = load_modules()
    rows_by_session: dict[str, list[str]] = {}
    glassbox_only = []
    tracing_rows = []
    for mod in modules:
        if mod.rel.startswith(TRACING):
            tracing_rows += module_rows(mod, data) if mod.twins else [glassbox_only_row(mod)]
            continue
        if not mod.twins:
            if mod.doc or mod.rel.rsplit("/", 1)[-1] != "__init__.py":
                glassbox_only.append(mod)
            continue
        key = mod.sessions[0] if mod.sessions[0] in SESSION_NAMES else "--"
        rows_by_session.setdefault(key, []).extend(module_rows(mod, data))

    out = [
        "# Source map: Glassbox ↔ vLLM",
        "",
        f"Every module of `engine/` beside its twin in vLLM at commit `{COMMIT}` ({COMMIT_DATE}),",
        "the sessions that read it, and the names both define. In the last column",
        "`name 120/345` means Glassbox defines `name` at line 120 of its module and vLLM at line",
        f"345 of the twin (`git show {COMMIT}:<path>` in a vLLM clone, or the GitHub blob at that",
        "commit); `name 120/–` marks a Glassbox name with no counterpart (after \"Glassbox's",
        'own:", the names whose docstring says so). A module with two twins has two rows.',
        "",
        "Generated by `scripts/gen_source_map.py` from the module docstrings and vLLM's symbol",
        "index; `tests/test_source_map.py` checks every path, name and line cited here against",
        f"`engine/` and against the vendored vLLM data in `docs/data/` (extracted at {COMMIT}).",
        "",
        "Contents: [modules by session](#modules-by-session) ·",
        "[the tracing package](#the-tracing-package-enginetracing) ·",
        "[the seeds' stale paths and symbols](#the-seeds-stale-paths-and-symbols) ·",
        "[what Glassbox simplifies and why](#what-glassbox-simplifies-and-why) ·",
        "[Glassbox-only modules](#glassbox-only-modules)",
        "",
        "## Modules by session",
        "",
    ]
    for key in ["01", "02", "03", "04", "05", "06", "07", "--"]:
        rows = rows_by_session.get(key)
        if not rows:
            continue
        out += [
            f"### {SESSION_NAMES[key]}",
            "",
            "| Glassbox | vLLM twin | Sessions | What it is "
            "| Shared names (Glassbox line/vLLM line) |",
            "| --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]

    out += [
        "## The tracing package (`engine/tracing/`)",
        "",
        *tracing_intro(data),
        "",
        "| Glassbox | vLLM twin | Sessions | What it is | Names (Glassbox line/vLLM line) |",
        "| --- | --- | --- | --- | --- |",
        *tracing_rows,
        "",
        "## The seeds' stale paths and symbols",
        "",
        "The reading plan (seed 001, by session; seed 000, the subsystem index) was written",
        "against an older vLLM. Where a path or name it gives is gone, renamed or far from the",
        f"line it quotes, this table says where it is at `{COMMIT}`; *detail* rows pin down a",
        "loose description. Rows marked §5 come from the wider list in the layout notes",
        "(`vllm_layout.md` §5). The test re-checks each row: the old name really is absent (or,",
        "for *lines moved*, more than 10 lines away), and every citation on the right exists at",
        "the line given.",
        "",
        f"| Seed · session | The seed says | Status | At {COMMIT} | Glassbox | Note |",
        "| --- | --- | --- | --- | --- | --- |",
        *stale_rows(data, modules),
        "",
        "## What Glassbox simplifies and why",
        "",
        SIMPLIFICATIONS.rstrip(),
        "",
        "<details><summary>Per module</summary>",
        "",
        "| Module | Simpler than vLLM |",
        "| --- | --- |",
    ]
    for mod in modules:
        if mod.simpler:
            target = f"[`{mod.rel}`](#{anchor(mod.rel)})" if mod.twins else f"`{mod.rel}`"
            out.append(f"| {target} | {_cell(mod.simpler)} |")
    out += ["", "</details>", ""]
    out += [
        "## Where Glassbox differs from vLLM on purpose",
        "",
        "Behaviours vLLM defines that Glassbox does differently, each with its reason (the",
        'module docstring\'s "Differs from vLLM on purpose" paragraph).',
        "",
        "| Module | Difference and reason |",
        "| --- | --- |",
    ]
    for mod in modules:
        if mod.differs:
            target = f"[`{mod.rel}`](#{anchor(mod.rel)})" if mod.twins else f"`{mod.rel}`"
            out.append(f"| {target} | {_cell(mod.differs)} |")
    out += [
        "",
        "vLLM features Glassbox leaves out for good (features still to come, such as",
        "speculative decoding, structured outputs or LoRA, are open issues, not choices):",
        "",
        "| Feature | vLLM | What Glassbox does | Why |",
        "| --- | --- | --- | --- |",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in SCOPE_DIFFERENCES),
        "",
    ]
    out += [
        "## C++ kernels (`csrc/`)",
        "",
        "Compiled on first use by `engine/_cpu_ops.py` (and by `make setup`); each file names its",
        "vLLM twin in its header comment.",
        "",
        "| Glassbox | vLLM twin | What it is |",
        "| --- | --- | --- |",
        *csrc_rows(),
        "",
    ]
    out += [
        "## Glassbox-only modules",
        "",
        "No vLLM twin (none named in the docstring or in `TWIN_OVERRIDES`): for example the CLI's",
        "trace and TUI commands and the embedded default model have no counterpart in vLLM (the",
        "tracing package has [its own section](#the-tracing-package-enginetracing)).",
        "",
        "| Glassbox | vLLM twin | Sessions | What it is | Names (Glassbox line/–) |",
        "| --- | --- | --- | --- | --- |",
    ]
    out += [glassbox_only_row(mod) for mod in glassbox_only]
    out.append("")
    return "\n".join(out)


def glassbox_only_row(mod: Module) -> str:
    return (
        f'| <a id="{anchor(mod.rel)}"></a>`{mod.rel}` | — | {session_cell(mod)} '
        f"| {_cell(mod.summary)} | {our_names(mod)} |"
    )


def tracing_intro(data: VllmData) -> list[str]:
    """What the tracing package is beside vLLM, citing the collector its pattern follows."""
    path, name = "vllm/v1/core/kv_cache_metrics.py", "KVCacheMetricsCollector"
    entry = data.entry(path)
    line = entry["qualified"].get(name) if entry else None
    if line is None:
        data.warnings.append(f"{name} is not in {path} at {COMMIT}")
    collector = cite(path, name, line) if line else f"`{name}`"
    return [
        "Every module of the package, listed once. vLLM's `vllm/tracing/` exports OpenTelemetry",
        "spans per request to a collector; it is the twin only of the package as a whole",
        "(`__init__.py`). The rest is Glassbox's own: one typed event per scheduling decision,",
        "KV block move and sampled token, written as JSON lines so that a run can be replayed",
        "step by step (`docs/trace_format.md`). The subsystems receive trace objects",
        "(`core_trace.py`, `engine_trace.py`, `worker_trace.py`) the way vLLM's `BlockPool`",
        f"receives its {collector} and calls it at a few points.",
    ]


def csrc_rows() -> list[str]:
    """One row per csrc/**/*.cpp: its ``// vLLM twin:`` path and its first comment line."""
    rows = []
    for path in sorted((ROOT / "csrc").rglob("*.cpp")):
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("//"):
                break
            header.append(line[2:].strip())
        twin_line = next((h for h in header if h.startswith("vLLM twin:")), "")
        twin = re.search(r"(csrc/\S+?)[,.;)]?(\s|$)", twin_line)
        rows.append(
            f"| `{path.relative_to(ROOT)}` | {'`' + twin.group(1) + '`' if twin else '—'} | "
            f"{_cell(header[0])} |"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reference",
        type=Path,
        default=DEFAULT_REFERENCE,
        help="folder with vllm_symbols_52a31cc.json and vllm_files_52a31cc.txt",
    )
    parser.add_argument(
        "--vllm-repo",
        type=Path,
        default=DEFAULT_MIRROR,
        help="a git clone or mirror of vLLM holding commit 52a31cc",
    )
    parser.add_argument("--check", action="store_true", help="fail if docs/source_map.md is stale")
    args = parser.parse_args()
    if args.check:
        # Only the vendored data: the check must not depend on ../shared or the mirror.
        data = VllmData(None, None)
    else:
        data = VllmData(args.reference, args.vllm_repo)
    text = build(data)
    target = ROOT / "docs" / "source_map.md"
    for w in data.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.check:
        current = target.read_text() if target.exists() else ""
        if current != text:
            print("docs/source_map.md is stale: run scripts/gen_source_map.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    used = {p: data.used[p] for p in sorted(data.used)}
    DATA_SYMBOLS.write_text(json.dumps(used, indent=1, sort_keys=True) + "\n")
    if data.index is not None and data.paths is not None:
        DATA_PATHS.write_text("\n".join(sorted(data.paths)) + "\n")
    print(
        f"wrote {target.relative_to(ROOT)} ({len(used)} vLLM files cited, "
        f"{len(data.warnings)} warnings)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
