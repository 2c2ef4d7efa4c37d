"""The collectives a tensor-parallel layer calls, on the TP group.

vLLM twin: ``vllm/distributed/communication_op.py``
(``tensor_model_parallel_all_reduce``, ``tensor_model_parallel_all_gather``).
Read it as the list of what crosses ranks inside a forward pass: the
row-parallel layers' partial sums (all-reduce), the vocabulary-parallel
embedding's partial lookups (all-reduce) and the LM head's logits slices
(all-gather). Sessions: 07.

Simpler than vLLM: no reduce-scatter, gather-to-one-rank or tensor-dict
broadcast (the scheduler's output reaches the workers through the executor's
shared-memory queue, not through these groups).
"""

from __future__ import annotations

import torch

from engine.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum ``input_`` over the TP ranks (the input itself with one rank)."""
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's ``input_`` along ``dim``, rank 0 first."""
    return get_tp_group().all_gather(input_, dim)
