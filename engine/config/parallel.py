"""ParallelConfig: how many ranks share the model, and which executor runs them.

vLLM twin: ``vllm/config/parallel.py`` (``ParallelConfig``: ``world_size``,
the choice of ``distributed_executor_backend``). Sessions: 07.

Read it for vLLM's default backend: one rank -> ``"uni"`` (the worker lives
in the EngineCore process); several -> ``"ray"`` when the process already
runs inside a Ray cluster (``ray.is_initialized()``), else ``"mp"`` (one
worker process per rank on this machine).

Simpler than vLLM: tensor parallelism only (``world_size`` is
``tensor_parallel_size``: no pipeline, data, expert or context parallelism);
no ``external_launcher`` backend.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None
    """"uni", "mp", "ray", or an ``Executor`` subclass; None picks as vLLM does."""

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        backend: Any = self.distributed_executor_backend
        if backend is None:
            backend = self.default_backend()
        if not isinstance(backend, type) and backend not in BACKENDS:
            raise ValueError(
                "distributed_executor_backend must be 'uni', 'mp', 'ray' or an Executor "
                f"subclass, got {backend!r}"
            )
        if backend == "uni" and tp > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker; tensor_parallel_size={tp} "
                "needs 'mp' or 'ray'"
            )
        self.distributed_executor_backend = backend

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def default_backend(self) -> str:
        if self.world_size == 1:
            return "uni"
        ray = sys.modules.get("ray")  # only a process that imported Ray can be in a cluster
        if ray is not None and ray.is_initialized():
            return "ray"
        return "mp"
