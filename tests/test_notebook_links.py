"""Every vLLM file a session notebook names is linked, at least once, by a
permalink at the pinned commit 52a31cc with a line anchor (the guide's rule: a
learner clicks through to the exact code the notebook talks about, not to a
moving branch).

Checked on the notebooks' py:percent twins (the same text as the .ipynb;
test_notebooks_sync.py keeps the two equal). Generated reading tables count
too: ``sessions/lab.py`` renders them with ``vllm_url``, a line link per name.

Also here: ``lab.show_vllm``, which prints the cited lines from the learner's
own vLLM checkout (``$GLASSBOX_VLLM_SRC``) or else the permalink, tested on
fake checkouts and, when a vLLM git directory is at hand, on vLLM's source at
52a31cc; and that every session notebook uses it at least once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sessions"))
import lab  # noqa: E402
from lab import VLLM_SHA, reading_table, show_vllm, vllm_line, vllm_source, vllm_url  # noqa: E402

TWINS = sorted(p for p in (ROOT / "sessions").glob("[0-9][0-9]_*/[0-9][0-9]_*.py"))
# A vLLM source path as the notebooks write it: `vllm/v1/engine/core.py`.
VLLM_PATH = re.compile(r"(?<![\w/.])vllm/[\w/]+\.py\b")
PERMALINK = re.compile(
    r"https://github\.com/vllm-project/vllm/blob/([0-9a-f]+)/(vllm/[\w/]+\.py)(#L\d+)?"
)


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
    wrong = sorted({sha for sha, _, _ in links if sha != VLLM_SHA})
    assert not wrong, f"{twin.name}: vLLM links at other commits {wrong}; use sessions/lab.vllm_url"
    # Paths inside a permalink are the links themselves; every other mention needs one.
    bare = set(VLLM_PATH.findall(PERMALINK.sub("", text)))
    # Files the notebook's reading table renders (SESSION_FILES keys) are linked at run time.
    rendered = set(re.findall(r'^\s*"(vllm/[\w/]+\.py)": \[', text, flags=re.M))
    linked = {path for _, path, _ in links} | rendered
    missing = sorted(bare - linked)
    assert not missing, f"{twin.name} names vLLM files without a 52a31cc permalink: {missing}"
    # And each file at least once at a line, not only at its top.
    anchored = {path for _, path, anchor in links if anchor} | rendered
    unanchored = sorted(({path for _, path, _ in links} | bare) - anchored)
    assert not unanchored, f"{twin.name} links vLLM files only without a line (#L...): {unanchored}"


# ---------------------------------------------------------------------------
# show_vllm: vLLM's cited lines inline, from $GLASSBOX_VLLM_SRC when set
# ---------------------------------------------------------------------------
CORE = "vllm/v1/engine/core.py"
# A vLLM git directory that holds 52a31cc (bare is fine), to check the index
# against the real source; the test that needs one is skipped without it.
VLLM_GIT_CANDIDATES = [
    os.environ.get("GLASSBOX_VLLM_GIT"),
    "/work/.mirror/local-inference-lab+vllm/repo",
]
# `show_vllm("vllm/...py", "Name"` as the notebooks call it.
SHOW_CALL = re.compile(r'show_vllm\(\s*"(vllm/[\w/]+\.py)",\s*"([\w.]+)"')


def _fake_checkout(root: Path, body: str) -> Path:
    """A folder laid out like vLLM with one file, core.py, holding ``body``."""
    file = root / CORE
    file.parent.mkdir(parents=True)
    file.write_text(body)
    return root


def _git(root: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


def _vllm_git() -> str | None:
    if shutil.which("git") is None:
        return None
    for candidate in VLLM_GIT_CANDIDATES:
        if not candidate:
            continue
        check = ["git", "-C", candidate, "cat-file", "-e", f"52a31cc:{CORE}"]
        if subprocess.run(check, capture_output=True).returncode == 0:
            return candidate
    return None


def test_show_vllm_without_a_checkout_prints_only_the_permalink(monkeypatch, capsys) -> None:
    monkeypatch.delenv("GLASSBOX_VLLM_SRC", raising=False)
    line = vllm_line(CORE, "EngineCore.step")
    show_vllm(CORE, "EngineCore.step", 5)
    assert capsys.readouterr().out.splitlines() == [
        f"{CORE}:{line}  EngineCore.step",
        vllm_url(CORE, line, line + 4),
    ]
    assert vllm_source(CORE, 40, 3, src="").splitlines()[1].endswith("#L40-L42")
    with pytest.raises(KeyError, match="not in the index"):
        vllm_source(CORE, "EngineCore.no_such_method")


def test_show_vllm_reads_the_lines_from_a_checkout(tmp_path, monkeypatch, capsys) -> None:
    lines = ["# one", "# two", "x = 3", "y = 4", "z = 5", "w = 6"]
    monkeypatch.setenv("GLASSBOX_VLLM_SRC", str(_fake_checkout(tmp_path, "\n".join(lines) + "\n")))
    show_vllm(CORE, 3, 2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{CORE}:3"
    assert "not a git checkout" in out[1]  # a plain folder: nothing to check the commit against
    assert out[2] == vllm_url(CORE, 3, 4)
    assert out[3:] == ["3  x = 3", "4  y = 4"]
    # A file the checkout lacks: say so, and fall back to the link.
    text = vllm_source("vllm/v1/engine/async_llm.py", "AsyncLLM.generate", src=str(tmp_path))
    assert "no vllm/v1/engine/async_llm.py under" in text and text.splitlines()[-1].startswith(
        "https://"
    )


def test_show_vllm_warns_when_the_checkout_is_at_another_commit(tmp_path) -> None:
    # At another commit the index's line would point into other code, so a
    # name is looked up in the checkout's own source.
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    body = "import os\n\n\nclass EngineCore:\n    def step(self):\n        return 1\n"
    root = _fake_checkout(tmp_path, body)
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "not vLLM")
    head = _git(root, "rev-parse", "HEAD")
    lab._checkout_commit.cache_clear()
    text = vllm_source(CORE, "EngineCore.step", 2, src=str(root)).splitlines()
    assert text[1].startswith(f"warning: $GLASSBOX_VLLM_SRC is at {head[:7]}, not 52a31cc")
    assert text[-2:] == ["5      def step(self):", "6          return 1"]
    line = vllm_line(CORE, "EngineCore.step")  # the link stays on 52a31cc's lines
    assert text[2] == vllm_url(CORE, line, line + 1)
    # The same checkout taken for the pinned commit: no warning, the index's line.
    lab._checkout_commit.cache_clear()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(lab, "VLLM_SHA", head)
        quiet = vllm_source(CORE, 4, 1, src=str(root)).splitlines()
    assert not any("warning" in s for s in quiet) and quiet[-1] == "4  class EngineCore:"
    lab._checkout_commit.cache_clear()


def test_show_vllm_on_the_real_source_at_52a31cc(tmp_path) -> None:
    """Every name a notebook shows with show_vllm is defined on the line the
    index gives, in vLLM's own file at 52a31cc (read out of a vLLM git
    directory with `git show`, no worktree needed)."""
    git_dir = _vllm_git()
    if git_dir is None:
        pytest.skip("no vLLM git directory holding 52a31cc (set GLASSBOX_VLLM_GIT)")
    calls = sorted(
        {c for twin in TWINS for c in SHOW_CALL.findall(twin.read_text(encoding="utf-8"))}
    )
    assert calls, "no notebook calls show_vllm with a name"
    for path, name in calls:
        file = tmp_path / path
        if not file.exists():
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(
                subprocess.run(
                    ["git", "-C", git_dir, "show", f"52a31cc:{path}"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            )
        text = vllm_source(path, name, 1, src=str(tmp_path)).splitlines()
        short = name.rsplit(".", 1)[-1]
        assert re.match(rf"\d+\s+(async )?(def|class) {short}\b", text[-1].strip()), (
            path,
            name,
            text[-1],
        )


@pytest.mark.parametrize(
    "twin",
    [t for t in TWINS if t.name[:2] in {"01", "02", "03", "04", "05", "07"}],
    ids=lambda t: t.name,
)
def test_sessions_show_vllm_source_inline(twin: Path) -> None:
    assert "show_vllm(" in twin.read_text(encoding="utf-8"), (
        f"{twin.name} never calls lab.show_vllm: show at least one cited passage inline"
    )


# A reading-table row as ``lab.reading_table`` renders it into a notebook's output.
READING_ROW = re.compile(r"\| `([\w.]+)` \| [^|\n]* \| `(engine/[\w/.]+)` \| (\d+|—) \|")
NOTEBOOKS = sorted(p for p in (ROOT / "sessions").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_reading_tables_give_our_lines_as_they_are_now(notebook: Path) -> None:
    """The committed outputs cite our own line numbers: after an edit that moves
    a cited definition, the notebook must be run again (nbval does not compare
    these cells)."""
    import json

    stale = []
    for cell in json.loads(notebook.read_text())["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("data", {}).get("text/markdown", "")) + "".join(
                output.get("text", "")
            )
            for name, path, line in READING_ROW.findall(text):
                now = lab.our_line(path, name) if (ROOT / path).exists() else None
                if str(now or "—") != line:
                    stale.append(f"{path} {name}: notebook says {line}, now {now or '—'}")
    assert not stale, "run the notebook again:\n" + "\n".join(stale)
