"""benchmarks/inductor_kernels.py: the Triton kernels Inductor would launch per
piece, generated on the CPU (docs/compilation.md, "Inductor's options").

Run as a script, in a process of its own: it patches Inductor and Triton for
the whole process. Two layers of the Qwen3-0.6B config give a first piece, one
middle piece (one layer's MLP, the next layer's attention input) and a last
piece; the middle one is the figure the docs give for every layer.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _middle_piece(*flags: str) -> tuple[int, int, list[str]]:
    done = subprocess.run(
        [sys.executable, "benchmarks/inductor_kernels.py", "--layers", "2", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    blocks = re.findall(
        r"^piece (\d+): (\d+) Triton \+ (\d+) library kernels .*\n((?:    \S+\n)*)",
        done.stdout,
        re.M,
    )
    assert [int(b[0]) for b in blocks] == [0, 1, 2], done.stdout
    _, triton, library, names = blocks[1]
    return int(triton), int(library), names.split()


@pytest.mark.parametrize("combo", [False, True], ids=["default", "combo_kernels"])
def test_qk_norm_rope_kernels_in_a_middle_piece(combo: bool) -> None:
    triton, library, names = _middle_piece(*(["--combo"] if combo else []))
    assert library == 4  # o_proj, gate_up_proj, down_proj, qkv_proj
    assert len(names) == triton
    # Two residual + RMSNorm kernels and SiLU-and-mul, then q/k norm + rotary:
    # a reduction and a rotation for each of q and k, or one of each for both.
    assert sum("add_mean_mul_pow_rsqrt" in n for n in names) == 2
    assert sum("silu" in n for n in names) == 1
    assert triton == (5 if combo else 7)
