"""The session notebooks (sessions/NN_*/NN_*.ipynb): paired, executed, checkable.

Each notebook has a jupytext ``py:percent`` twin with the same stem; the two
are edited together (``jupytext --sync``) and reviewed as the ``.py``. These
tests fail when

* a notebook has no ``.py`` twin, or the two disagree on any cell's type or
  source (one was edited without syncing the other);
* a notebook is not paired as ``ipynb,py:percent`` in its metadata;
* a notebook is committed without outputs, with an error output, or not run
  top to bottom in one go (execution counts must be 1, 2, 3, ...);
* a notebook has fewer than five cells that nbval checks (``# NBVAL_CHECK_OUTPUT``),
  or a checked cell has no stored output or prints to stderr (logging makes
  such a comparison flaky).

``make test`` runs the notebooks themselves through nbval; see sessions/README.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = ROOT / "sessions"
NOTEBOOKS = sorted(p for p in SESSIONS.glob("*/*.ipynb") if ".ipynb_checkpoints" not in p.parts)
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"
MIN_CHECKED_CELLS = 5


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip("\n")) for c in nb.cells]


def test_there_are_session_notebooks() -> None:
    assert NOTEBOOKS, "no session notebooks under sessions/*/"
    for d in sorted(p for p in SESSIONS.iterdir() if p.is_dir() and p.name[:2].isdigit()):
        found = [p for p in NOTEBOOKS if p.parent == d]
        assert len(found) == 1, (
            f"{d.relative_to(ROOT)} should hold exactly one .ipynb, has {len(found)}"
        )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_py_percent_twin_matches(notebook: Path) -> None:
    twin = notebook.with_suffix(".py")
    assert twin.is_file(), (
        f"{notebook.name} has no py:percent twin {twin.name} (run: jupytext --sync {notebook.name})"
    )
    assert "format_name: percent" in twin.read_text(encoding="utf-8"), (
        f"{twin.name} is not in py:percent format"
    )
    ipynb_cells = _cells(nbformat.read(notebook, as_version=4))
    py_cells = _cells(jupytext.read(twin))
    for i, (a, b) in enumerate(zip(ipynb_cells, py_cells)):
        assert a == b, (
            f"cell {i} differs between {notebook.name} and {twin.name}; "
            f"edit one, then run `jupytext --sync` on it\n"
            f"--- ipynb ({a[0]}):\n{a[1]}\n--- py ({b[0]}):\n{b[1]}"
        )
    assert len(ipynb_cells) == len(py_cells), (
        f"{notebook.name} has {len(ipynb_cells)} cells, {twin.name} has {len(py_cells)}; "
        "run `jupytext --sync`"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_paired_formats(notebook: Path) -> None:
    nb = nbformat.read(notebook, as_version=4)
    formats = nb.metadata.get("jupytext", {}).get("formats")
    assert formats == "ipynb,py:percent", (
        f"{notebook.name}: jupytext formats are {formats!r}; run "
        f"`jupytext --set-formats ipynb,py:percent {notebook.name}`"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_executed_top_to_bottom(notebook: Path) -> None:
    nb = nbformat.read(notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{notebook.name} has no code cells"
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{notebook.name} was not committed after one clean top-to-bottom run "
        f"(execution counts {counts}); run "
        f"`jupyter nbconvert --to notebook --execute --inplace {notebook.name}`"
    )
    for i, cell in enumerate(code):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, (
            f"{notebook.name}: code cell {i} was committed with an error: {errors[0].get('ename')}"
        )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_enough_checked_cells(notebook: Path) -> None:
    nb = nbformat.read(notebook, as_version=4)
    checked = [c for c in nb.cells if c.cell_type == "code" and CHECK_MARKER in c.source]
    assert len(checked) >= MIN_CHECKED_CELLS, (
        f"{notebook.name} has {len(checked)} cells marked {CHECK_MARKER!r}; "
        f"at least {MIN_CHECKED_CELLS} needed"
    )
    for cell in checked:
        outputs = cell.get("outputs", [])
        last_line = cell.source.strip().splitlines()[-1]
        assert outputs, (
            f"{notebook.name}: checked cell ending {last_line!r} has no stored output to compare"
        )
        stderr = [
            o for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"
        ]
        assert not stderr, (
            f"{notebook.name}: checked cell ending {last_line!r} writes to stderr; "
            "move the engine run or the logging out of the checked cell"
        )
