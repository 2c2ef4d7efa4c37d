"""scripts/execute_notebooks.py keeps what a notebook ran when the run stops early (the
GPU machine's call limit kills the kernel; nbclient then raises errors with no message)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "execute_notebooks.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("execute_notebooks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _KernelDiesHalfway:
    """Stands in for nbclient's NotebookClient: the first cell ran, then the kernel died."""

    def __init__(self, nb, **_kwargs):
        self.nb = nb

    def execute(self):
        self.nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="ran\n")]
        raise AssertionError()  # what nbclient's cleanup raises after a dead kernel


@pytest.mark.parametrize("error_cell", [False, True])
def test_a_stopped_run_still_writes_its_copy(tmp_path, monkeypatch, capsys, error_cell):
    script = _load_script()
    monkeypatch.setattr(script, "NotebookClient", _KernelDiesHalfway)
    monkeypatch.setattr(script, "device_name", lambda: "cpu")
    monkeypatch.setenv("GLASSBOX_COMMIT", "abc1234")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('ran')")])
    if error_cell:
        nb.cells.append(nbformat.v4.new_code_cell("1 / 0"))
        nb.cells[1].outputs = [
            nbformat.v4.new_output(
                "error", ename="ZeroDivisionError", evalue="division by zero", traceback=[]
            )
        ]
    src = tmp_path / "01_demo.ipynb"
    nbformat.write(nb, src)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["execute_notebooks.py", "--out", str(out), str(src)])

    assert script.main() == (1 if error_cell else 0)

    printed = capsys.readouterr().out
    assert "01_demo.ipynb: stopped: AssertionError: \n" in printed
    copy = nbformat.read(out / "01_demo.ipynb", as_version=4)
    assert copy.cells[0].outputs[0]["text"] == "ran\n"
    assert copy.metadata["glassbox"]["commit"] == "abc1234"
    assert copy.metadata["glassbox"]["device"] == "cpu"
    assert ("cell 1: ZeroDivisionError: division by zero" in printed) is error_cell
