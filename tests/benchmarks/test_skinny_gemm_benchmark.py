"""benchmarks/skinny_gemm.py on the CPU: the script's path through every shape and tile
(scaled-down shapes, Triton's interpreter), and the JSON it writes. The timings exist only
on a GPU; here every tile's error against F.linear must be float32-small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_check_writes_every_shape_and_tile(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/skinny_gemm.py",
            "--device",
            "cpu",
            "--rows",
            "1,4",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "skinny_gemm_cpu.json").read_text())
    assert result["benchmark"] == "skinny_gemm" and result["device"] == "cpu"
    assert list(result["shapes"]) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
    for shape in result["shapes"].values():
        assert set(shape["rows"]) == {"1", "4"}
        one, four = shape["rows"]["1"]["tiles"], shape["rows"]["4"]["tiles"]
        assert len(one) == 8 and len(four) == 5  # tl.dot tiles need block_n >= 16
        for tile in [*one.values(), *four.values()]:
            assert tile["max_abs_err"] < 1e-5
