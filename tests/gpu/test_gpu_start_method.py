"""The default start method on a CUDA machine: a learner's unguarded script
with the device left to ``auto`` forks EngineCore, and the child can use CUDA
because the front end never touched the CUDA runtime (it guessed the device
from NVML's count). CPU twin: tests/utils/test_system_utils.py."""

from __future__ import annotations

import ast

import pytest

from tests.utils.test_system_utils import model_dir, run_script, script  # noqa: F401

pytestmark = pytest.mark.gpu


def test_unguarded_script_forks_and_runs_on_cuda(model_dir, tmp_path):  # noqa: F811
    result = run_script(tmp_path, script(model_dir, guarded=False, device="auto"), method=None)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("TOKENS")]
    assert len(ast.literal_eval(line.removeprefix("TOKENS "))) == 3
    # Forked, not spawned: nothing forced the switch.
    assert "must be 'spawn'" not in result.stderr
