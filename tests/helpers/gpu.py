"""Engine settings shared by the GPU tests.

On CUDA the default optimization level is O2: the model is compiled by
Inductor and captured as FULL_AND_PIECEWISE graphs (tests/gpu/test_gpu_compile.py
checks that path against eager). The other GPU tests each check one subsystem
(an attention backend, async scheduling, speculation, structured outputs,
tracing); they run the model eagerly with full graphs for decode batches, so
that none of them pays Inductor's compile time and the whole GPU suite fits
one device call.
"""

from __future__ import annotations

from typing import Any


def decode_graphs(**kw: Any) -> dict[str, Any]:
    """Engine keywords: O0 with FULL_DECODE_ONLY graphs, unless ``kw`` says otherwise
    (``compilation_config`` or ``optimization_level`` in ``kw`` replace these)."""
    return {
        "optimization_level": 0,
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
        **kw,
    }
