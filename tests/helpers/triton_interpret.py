"""A worker process where Triton kernels run in Triton's NumPy interpreter.

Used by the CPU checks of Triton kernels (``tests/v1/attention/test_triton_attn.py``,
``tests/model_executor/test_custom_ops.py``). Triton reads ``TRITON_INTERPRET``
when ``@triton.jit`` decorates a function -- its own ``tl.zeros``/``tl.max``
when triton is first imported, which in a full test run has already happened
in the test process (``import torch._dynamo`` imports triton) -- so the
interpreter needs a process that has the variable from the start. The variable
is set here only while the worker is spawned (a spawned child copies the
environment), so it never leaks into other tests. Checks sent to the worker
must be module-level functions (picklable); their assertion errors come back
with the worker's traceback.

Import with ``from tests.helpers.triton_interpret import interpreting_worker``
(and ``run_without_interpreter`` for the compile-for-sm90 checks).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TIMEOUT_S = 300
REPO_ROOT = Path(__file__).resolve().parents[2]


def worker_interprets_triton(module: str, kernel: str) -> bool:
    """Runs in the worker: were triton's own functions and ``module.kernel`` built for
    the interpreter?"""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    ours = getattr(importlib.import_module(module), kernel)
    return isinstance(tl.standard.zeros, InterpretedFunction) and isinstance(
        ours, InterpretedFunction
    )


@contextmanager
def interpreting_worker(module: str, kernel: str) -> Iterator[Callable[..., Any]]:
    """Yield ``run(check, *args)``, which runs ``check(*args)`` in an interpreting worker.

    ``module``/``kernel`` name one of the ``@triton.jit`` kernels under test;
    the worker must show it (and triton's own ``tl.zeros``) as interpreted
    before any check runs, so a compiled run can't pass for an interpreted one.
    """
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        assert pool.submit(worker_interprets_triton, module, kernel).result(timeout=TIMEOUT_S), (
            "worker is not interpreting"
        )
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    try:
        yield lambda check, *args: pool.submit(check, *args).result(timeout=TIMEOUT_S)
    finally:
        pool.shutdown()


def run_without_interpreter(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -c script`` from the repository root in a fresh process
    without ``TRITON_INTERPRET`` -- for compile-only checks (lowering kernels
    for a GPU target), which need compiled, not interpreted, kernels even
    where this process interprets them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
