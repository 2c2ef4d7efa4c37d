"""ParallelConfig: tensor parallelism and which executor runs the workers.

vLLM twin: ``vllm/config/parallel.py`` (``ParallelConfig``). Sessions: 07.

Glassbox runs tensor_parallel_size=1 today; the field exists so the sharding
seams in the layers and the executor choice read like vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None
    """"uni" (in-process worker) or an ``Executor`` subclass, as in vLLM."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size must be 1: Glassbox runs a single worker, "
                f"got {self.tensor_parallel_size!r}"
            )
        backend: Any = self.distributed_executor_backend
        if backend is not None and not isinstance(backend, type) and backend != "uni":
            raise ValueError(
                "distributed_executor_backend must be 'uni' or an Executor subclass, "
                f"got {backend!r}"
            )
