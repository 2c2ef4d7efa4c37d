"""Process groups: who talks to whom when one model is split across ranks.

vLLM twin: ``vllm/distributed/parallel_state.py`` (``GroupCoordinator``,
``init_distributed_environment``, ``initialize_model_parallel``,
``get_world_group``, ``get_tp_group``, ``get_tensor_model_parallel_rank`` /
``_world_size``, ``destroy_model_parallel``, ``destroy_distributed_environment``).
Read it for three ideas:
  * every worker process calls ``init_distributed_environment`` once (the
    world: all ranks, over ``torch.distributed``), then
    ``initialize_model_parallel`` carves the world into groups; with tensor
    parallelism only, the TP group is the world;
  * a ``GroupCoordinator`` wraps a group with the collectives the model
    needs (``all_reduce``, ``all_gather``, ``gather``, ``broadcast_object``)
    and a CPU twin of the group (gloo) for host-side objects;
  * the layers ask ``get_tp_group()`` for their rank and world size when
    they are built, and call the collectives in ``forward``. This module's
    groups are the one per-process global the model reads besides the forward
    context (vLLM's design; the groups never change after start-up).
Collectives use gloo on the CPU and NCCL on CUDA (``backend`` follows the
device, as vLLM's platforms choose). Sessions: 07 (executor).

Simpler than vLLM: tensor parallelism only (no pipeline, data, expert,
decode-context or prefill-context groups, no custom all-reduce kernels, no
device communicators, no stateless groups); a rank that runs alone
(``UniProcExecutor``) creates no process group at all -- ``get_tp_group()``
then returns a group of one whose collectives return their input.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.utils.torch_utils import direct_register_custom_op

logger = logging.getLogger(__name__)

# torch 2.13 renamed all_gather_into_tensor (still there, with a warning).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class CollectiveStats:
    """What a group's collectives cost since ``take_stats``: the per-step
    figures the worker's trace reports (count, bytes, host time)."""

    all_reduce_count: int = 0
    all_gather_count: int = 0
    nbytes: int = 0
    seconds: float = 0.0


class GroupCoordinator:
    """One process group and the collectives on it.

    ``ranks`` are global ranks; ``rank_in_group`` is this process's index in
    them. ``device_group`` carries tensors on the model's device (NCCL on
    CUDA, gloo on the CPU); ``cpu_group`` (gloo) carries Python objects.
    """

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        torch_distributed_backend: str,
        group_name: str,
    ) -> None:
        self.unique_name = group_name
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.local_rank = local_rank
        self.device_group: dist.ProcessGroup | None = None
        self.cpu_group: dist.ProcessGroup | None = None
        self.ranks: list[int] = [self.rank]
        for ranks in group_ranks:
            # new_group must be called by every rank for every group, in order.
            device_group = dist.new_group(ranks, backend=torch_distributed_backend)
            cpu_group = (
                device_group
                if torch_distributed_backend == "gloo"
                else dist.new_group(ranks, backend="gloo")
            )
            if self.rank in ranks:
                self.ranks = list(ranks)
                self.device_group, self.cpu_group = device_group, cpu_group
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(self.rank)
        self.stats = CollectiveStats()
        _groups[group_name] = self

    @classmethod
    def single_rank(cls) -> GroupCoordinator:
        """A group of one with no process group: every collective is the identity."""
        group = cls.__new__(cls)
        group.unique_name = "single"
        group.rank = group.local_rank = group.rank_in_group = 0
        group.ranks = [0]
        group.world_size = 1
        group.device_group = group.cpu_group = None
        group.stats = CollectiveStats()
        return group

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    @contextmanager
    def _timed(self, input_: torch.Tensor):
        start = time.perf_counter()
        yield
        self.stats.nbytes += input_.numel() * input_.element_size()
        self.stats.seconds += time.perf_counter() - start

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum over the group's ranks of ``input_`` (a new tensor).

        Through the custom op ``torch.ops.glassbox.all_reduce`` (as vLLM's
        ``torch.ops.vllm.all_reduce``): a compiled model keeps it as one node
        instead of tracing into ``torch.distributed``."""
        if self.world_size == 1:
            return input_
        return torch.ops.glassbox.all_reduce(input_, self.unique_name)

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        self.stats.all_reduce_count += 1
        output = input_.clone()
        with self._timed(input_):
            dist.all_reduce(output, group=self.device_group)
        return output

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim``, in rank order."""
        if self.world_size == 1:
            return input_
        dim = dim % input_.dim()
        return torch.ops.glassbox.all_gather(input_, dim, self.unique_name)

    def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        self.stats.all_gather_count += 1
        # Ranks' tensors stacked along dim 0, then the rank axis moved next to ``dim``.
        output = input_.new_empty((self.world_size * input_.shape[0], *input_.shape[1:]))
        with self._timed(input_):
            _all_gather_single(output, input_.contiguous(), group=self.device_group)
        output = output.reshape(self.world_size, *input_.shape).movedim(0, dim)
        shape = list(input_.shape)
        shape[dim] *= self.world_size
        return output.reshape(shape)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` from the group's rank ``src`` to every rank (over the CPU group)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def take_stats(self) -> CollectiveStats:
        """The counters since the last call, and a fresh set."""
        stats, self.stats = self.stats, CollectiveStats()
        return stats

    def destroy(self) -> None:
        _groups.pop(self.unique_name, None)
        for group in {id(g): g for g in (self.device_group, self.cpu_group) if g}.values():
            dist.destroy_process_group(group)
        self.device_group = self.cpu_group = None


# Group name -> group: how the custom ops below find the group they were given.
_groups: dict[str, GroupCoordinator] = {}


def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return _groups[group_name]._all_reduce_out_place(tensor)


def all_reduce_fake(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


def all_gather(tensor: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    return _groups[group_name]._all_gather_out_place(tensor, dim)


def all_gather_fake(tensor: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] *= _groups[group_name].world_size
    return tensor.new_empty(shape)


direct_register_custom_op("all_reduce", all_reduce, mutates_args=[], fake_impl=all_reduce_fake)
direct_register_custom_op("all_gather", all_gather, mutates_args=[], fake_impl=all_gather_fake)

_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_SINGLE = GroupCoordinator.single_rank()


def get_world_group() -> GroupCoordinator:
    return _WORLD if _WORLD is not None else _SINGLE


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _SINGLE


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def default_backend(device: torch.device | str) -> str:
    """NCCL between GPUs, gloo between CPU processes (vLLM's platforms' choice)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    local_rank: int,
    backend: str,
    timeout_s: float | None = None,
) -> None:
    """Join the world: ``world_size`` processes that meet at
    ``distributed_init_method`` (``tcp://host:port``). Every rank calls it."""
    global _WORLD
    if world_size == 1:
        return  # one rank: no process group (see the module docstring)
    if not dist.is_initialized():
        logger.debug("rank %d/%d joins %s (%s)", rank, world_size, distributed_init_method, backend)
        kwargs: dict[str, Any] = {}
        if timeout_s is not None:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            **kwargs,
        )
    if _WORLD is None:
        _WORLD = GroupCoordinator([list(range(world_size))], local_rank, backend, "world")


def initialize_model_parallel(tensor_model_parallel_size: int = 1, backend: str = "gloo") -> None:
    """Split the world into tensor-parallel groups of ``tensor_model_parallel_size``
    consecutive ranks (all of it, with TP only)."""
    global _TP
    if tensor_model_parallel_size == 1:
        return
    world = get_world_group()
    if world.world_size % tensor_model_parallel_size != 0:
        raise ValueError(
            f"world size {world.world_size} is not divisible by "
            f"tensor_parallel_size {tensor_model_parallel_size}"
        )
    groups = [
        list(range(start, start + tensor_model_parallel_size))
        for start in range(0, world.world_size, tensor_model_parallel_size)
    ]
    _TP = GroupCoordinator(groups, world.local_rank, backend, "tp")


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None:
        _TP.destroy()
    _TP = None


def destroy_distributed_environment() -> None:
    global _WORLD
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()


def cleanup_dist_env_and_memory() -> None:
    destroy_model_parallel()
    destroy_distributed_environment()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
