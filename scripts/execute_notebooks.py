"""Run session notebooks top to bottom and keep their outputs, with where they ran.

    python scripts/execute_notebooks.py --out DIR [--allow-errors] [NOTEBOOK ...]

Each notebook (default: every ``sessions/NN_*/NN_*.ipynb``) runs in a fresh kernel of
this interpreter, in its own folder (as under Jupyter and nbval), and is written to
``DIR/<name>.ipynb`` with ``metadata.glassbox``: the device, the commit, the date and
the wall time. ``scripts/gpu_run.sh notebooks`` uses it on the GPU machine; the copies
it brings back become ``sessions/NN_*/gpu_outputs/`` (docs/gpu.md, "The notebooks on
the GPU"), which nbval then checks on the next GPU run. With ``--allow-errors`` a
failing cell is recorded and the notebook goes on, so one run shows every failure.

Prints one line per notebook (wall time, errors) and exits 1 if any cell failed.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results_store import commit_id  # noqa: E402  ($GLASSBOX_COMMIT, else HEAD)


def device_name() -> str:
    """The GPU's name, or "cpu" (asked in a child: this process stays CUDA-free)."""
    probe = (
        "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def errors_of(nb) -> list[str]:
    """``cell N: Ename: value`` for every cell whose outputs hold an error."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                found.append(f"cell {i}: {out.get('ename')}: {str(out.get('evalue'))[:200]}")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="folder for the executed copies")
    ap.add_argument("--allow-errors", action="store_true", help="go on past a failing cell")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    args = ap.parse_args()
    notebooks = args.notebooks or sorted(REPO.glob("sessions/[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))
    args.out.mkdir(parents=True, exist_ok=True)
    device, sha = device_name(), commit_id()
    failed = 0
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(
            nb,
            timeout=args.timeout,
            kernel_name="python3",
            allow_errors=args.allow_errors,
            resources={"metadata": {"path": str(path.resolve().parent)}},
        )
        start = time.perf_counter()
        try:
            client.execute()
        except Exception as exc:  # noqa: BLE001 -- keep what ran, say what stopped it
            last_line = (str(exc).splitlines() or [""])[-1][:200]  # some carry no message
            print(f"{path.name}: stopped: {type(exc).__name__}: {last_line}", flush=True)
        wall = time.perf_counter() - start
        errors = errors_of(nb)
        failed += bool(errors)
        # Not a jupytext pair: the copy must never be synced back over its .py.
        nb.metadata.pop("jupytext", None)
        nb.metadata["glassbox"] = {
            "device": device,
            "commit": sha,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(wall, 1),
        }
        nbformat.write(nb, args.out / path.name)
        print(f"{path.name}: {wall:.1f} s on {device}, {len(errors)} error(s)", flush=True)
        for line in errors:
            print(f"  {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
