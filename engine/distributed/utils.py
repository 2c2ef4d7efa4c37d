"""Small helpers about a worker's place among the ranks.

vLLM twin: ``vllm/distributed/utils.py`` (``get_worker_rank_suffix``; the rest
of vLLM's file is about pipeline-parallel layer splits and stateless process
groups, which Glassbox does not have). Sessions: 07.

Simpler than vLLM: Glassbox has one parallel dimension, tensor parallelism, so
the suffix names it and the global rank; vLLM's also names the data, pipeline,
decode-context and expert parallel ranks (``dp0_pp0_tp1_dcp0_ep0_rank1``).
"""

from __future__ import annotations

from engine.distributed.parallel_state import get_tensor_model_parallel_rank


def get_worker_rank_suffix(global_rank: int | None = None) -> str:
    """``tp<r>`` (``tp<r>_rank<g>`` with a global rank): names a worker's
    files, such as its profiler trace, so ranks never overwrite each other."""
    suffix = f"tp{get_tensor_model_parallel_rank()}"
    return suffix if global_rank is None else f"{suffix}_rank{global_rank}"
