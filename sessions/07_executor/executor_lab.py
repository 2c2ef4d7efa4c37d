"""Functions that session 07 sends to every worker with ``collective_rpc``.

Not part of the engine and with no vLLM twin: the notebook's own probes.

``MultiprocExecutor.collective_rpc(fn)`` puts ``fn`` on the broadcast ring,
and a worker process calls ``fn(worker)`` on its own ``Worker``. Glassbox
pickles ``fn`` *by name* (module and qualified name), so the worker must be
able to find it: a function of an importable module, like these, always
works. One defined in the notebook itself lives in ``__main__``; a worker
forked *after* it was defined has a copy of it, but one defined after the
workers were started is missing there, and that call fails with an error
naming the function (vLLM sends a callable by value with ``cloudpickle``, so
there it would work). Hence this module.
"""

from __future__ import annotations

import os
from typing import Any


def rank_summary(worker: Any) -> dict[str, Any]:
    """This rank's number, pid, world size and the bytes of its parameters."""
    from engine.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    params = list(worker.model_runner.model.parameters())
    return {
        "rank": group.rank_in_group,
        "world_size": group.world_size,
        "pid": os.getpid(),
        "num_params": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
    }


def rank_tensors(worker: Any, names: list[str]) -> dict[str, Any]:
    """This rank's copy of the named parameters (CPU tensors), and its rank."""
    from engine.distributed.parallel_state import get_tp_group

    params = dict(worker.model_runner.model.named_parameters())
    return {
        "rank": get_tp_group().rank_in_group,
        "tensors": {n: params[n].detach().cpu().clone() for n in names},
    }


def layer_shapes(worker: Any, prefix: str) -> dict[str, Any]:
    """Shapes of the parameters under ``prefix`` on this rank, and the heads
    its attention layer was built with."""
    from engine.distributed.parallel_state import get_tp_group

    model = worker.model_runner.model
    shapes = {
        n.removeprefix(prefix + "."): tuple(p.shape)
        for n, p in model.named_parameters()
        if n.startswith(prefix + ".")
    }
    attn = model.get_submodule(prefix + ".self_attn")
    return {
        "rank": get_tp_group().rank_in_group,
        "shapes": shapes,
        "num_heads": attn.num_heads,
        "num_kv_heads": attn.num_kv_heads,
    }
