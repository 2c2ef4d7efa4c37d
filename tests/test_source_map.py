"""docs/source_map.md is current, and every twin it names is a real vLLM file.

The map is generated from the module docstrings ("vLLM twin: ``vllm/...``")
and vLLM's symbol index at the pinned commit (vendored under docs/data), so a
stale map or a twin path that does not exist in vLLM fails here.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = json.loads((ROOT / "docs" / "data" / "vllm_twins_52a31cc.json").read_text())


def test_source_map_is_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_source_map.py"), "--check"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr


def test_every_module_opens_with_a_docstring():
    missing = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if path.stat().st_size > 0 and not ast.get_docstring(tree):
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"modules without a docstring: {missing}"


def test_named_twin_symbols_exist_at_the_pinned_commit():
    text = (ROOT / "docs" / "source_map.md").read_text()
    # Key twins a reader of the seven sessions needs, with vLLM's own names.
    for twin, names in {
        "vllm/v1/core/sched/scheduler.py": ["Scheduler", "schedule", "update_from_output", "_preempt_request"],
        "vllm/v1/core/kv_cache_manager.py": ["KVCacheManager", "get_computed_blocks", "allocate_slots", "free"],
        "vllm/v1/core/block_pool.py": ["BlockPool", "get_new_blocks", "free_blocks", "touch"],
        "vllm/v1/core/kv_cache_utils.py": ["KVCacheBlock", "FreeKVCacheBlockQueue", "get_request_block_hasher"],
    }.items():
        assert twin in DATA, twin
        for name in names:
            assert name in DATA[twin]["symbols"], (twin, name)
        assert f"`{twin}`" in text
