"""Every vLLM file a session notebook names is linked, at least once, by a
permalink at the pinned commit 52a31cc (the guide's rule: a learner clicks
through to the exact code the notebook talks about, not to a moving branch).

Checked on the notebooks' py:percent twins (the same text as the .ipynb;
test_notebooks_sync.py keeps the two equal). Generated reading tables count
too: ``sessions/lab.py`` renders them with ``vllm_url``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sessions"))
from lab import VLLM_SHA, reading_table, vllm_url  # noqa: E402

TWINS = sorted(p for p in (ROOT / "sessions").glob("[0-9][0-9]_*/[0-9][0-9]_*.py"))
# A vLLM source path as the notebooks write it: `vllm/v1/engine/core.py`.
VLLM_PATH = re.compile(r"(?<![\w/.])vllm/[\w/]+\.py\b")
PERMALINK = re.compile(r"https://github\.com/vllm-project/vllm/blob/([0-9a-f]+)/(vllm/[\w/]+\.py)")


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def test_vllm_sha_is_the_pinned_commit() -> None:
    assert len(VLLM_SHA) == 40 and VLLM_SHA.startswith("52a31cc")
    assert vllm_url("vllm/v1/engine/core.py", 7).endswith(f"{VLLM_SHA}/vllm/v1/engine/core.py#L7")


def test_reading_table_links_every_file_and_line() -> None:
    table = reading_table({"vllm/v1/engine/core.py": ["EngineCore.step"]})
    assert vllm_url("vllm/v1/engine/core.py") in table
    assert re.search(r"\[\d+\]\(https://github\.com/.+/vllm/v1/engine/core\.py#L\d+\)", table)


@pytest.mark.parametrize("twin", TWINS, ids=_ids(TWINS))
def test_every_cited_vllm_file_has_a_permalink(twin: Path) -> None:
    text = twin.read_text(encoding="utf-8")
    links = PERMALINK.findall(text)
    wrong = sorted({sha for sha, _ in links if sha != VLLM_SHA})
    assert not wrong, f"{twin.name}: vLLM links at other commits {wrong}; use sessions/lab.vllm_url"
    # Paths inside a permalink are the links themselves; every other mention needs one.
    bare = set(VLLM_PATH.findall(PERMALINK.sub("", text)))
    # Files the notebook's reading table renders (SESSION_FILES keys) are linked at run time.
    rendered = set(re.findall(r'^\s*"(vllm/[\w/]+\.py)": \[', text, flags=re.M))
    linked = {path for _, path in links} | rendered
    missing = sorted(bare - linked)
    assert not missing, f"{twin.name} names vLLM files without a 52a31cc permalink: {missing}"
