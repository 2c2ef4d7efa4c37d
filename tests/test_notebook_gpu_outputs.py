"""The notebooks' GPU runs committed beside them (sessions/NN_*/gpu_outputs/NN_*.ipynb).

``scripts/gpu_run.sh notebooks-refresh`` runs every session notebook on the GPU machine
and brings the executed copies back (docs/gpu.md, "The notebooks on the GPU"); a learner
without a GPU reads the H200's numbers there, and ``gpu_run.sh notebooks`` checks them
with nbval on the next GPU run. These tests check every committed copy (README's
"Planned" list says which sessions have none yet) and fail when

* a copy's cells differ in type or source from its notebook (the notebook was edited
  after the GPU run: run it again), or a copy lies in a folder of no notebook;
* the copy does not say where and when it ran (``metadata.glassbox``: a CUDA device,
  the commit, the date, the wall time) or was not run on a GPU;
* a cell of the copy failed, or a cell nbval checks has no output;
* the copy is still paired with jupytext (a sync would overwrite the notebook's ``.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
COPIES = sorted((ROOT / "sessions").glob("*/gpu_outputs/*.ipynb"))
CHECK_MARKER = "# NBVAL_CHECK_OUTPUT"


def _notebook(copy: Path) -> Path:
    return copy.parent.parent / copy.name


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip("\n")) for c in nb.cells]


def test_some_gpu_copies_are_committed() -> None:
    assert COPIES, "no sessions/*/gpu_outputs/*.ipynb: the glob or the layout changed"


@pytest.mark.parametrize("copy", COPIES, ids=[p.stem for p in COPIES])
def test_gpu_copy_has_the_notebooks_cells(copy: Path) -> None:
    notebook_path = _notebook(copy)
    assert notebook_path.is_file(), f"{copy.relative_to(ROOT)}: no {notebook_path.name} beside"
    notebook = nbformat.read(notebook_path, as_version=4)
    ran = nbformat.read(copy, as_version=4)
    ours, theirs = _cells(notebook), _cells(ran)
    assert len(ours) == len(theirs), (
        f"{copy.name}: {len(theirs)} cells on the GPU, {len(ours)} in the notebook: run it again"
    )
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"{copy.name}: cell {i} changed since the GPU run: run it again"


@pytest.mark.parametrize("copy", COPIES, ids=[p.stem for p in COPIES])
def test_gpu_copy_ran_on_a_gpu_without_errors(copy: Path) -> None:
    ran = nbformat.read(copy, as_version=4)
    where = ran.metadata.get("glassbox", {})
    assert set(where) >= {"device", "commit", "date", "wall_s"}, f"{copy.name}: {where}"
    assert where["device"].startswith("NVIDIA"), f"{copy.name} ran on {where['device']!r}"
    assert "jupytext" not in ran.metadata, f"{copy.name} is paired with jupytext"
    for i, cell in enumerate(ran.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"{copy.name}: cell {i} failed: {errors[0].get('ename')}"
        if CHECK_MARKER in cell.source:
            assert cell.get("outputs"), f"{copy.name}: checked cell {i} has no output"
