"""Ray helpers for the Ray executor: the cluster, the placement group, the actor.

vLLM twin: ``vllm/v1/executor/ray_utils.py`` (``RayWorkerWrapper``,
``initialize_ray_cluster``, ``ray_is_available``, ``assert_ray_available``).
Read it for how ranks land on machines: one placement-group bundle per rank
(a GPU each on CUDA, a CPU each otherwise), so Ray places every rank's actor
on a node that has the device it needs -- on one machine or many.
Sessions: 07 (executor).

Also the per-node device bookkeeping (``worker_placement``): Ray shows each
GPU actor only its own GPU, as ``cuda:0``; the executor makes every GPU of a
node that holds ranks visible to all of that node's ranks (as vLLM does, so
NCCL sees its peers) and gives each rank its own GPU's index there as its
local rank.

Simpler than vLLM: no TPU/Neuron bundles, no compiled DAGs, no reordering of
the ranks by node.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# How long to wait for the placement group's resources.
PLACEMENT_GROUP_TIMEOUT_S = 60.0


def ray_is_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def assert_ray_available() -> None:
    if not ray_is_available():
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: "
            "pip install ray (or use distributed_executor_backend='mp' on one machine)"
        )


def initialize_ray_cluster(world_size: int, device_type: str) -> tuple[Any, bool]:
    """Join the Ray cluster at ``RAY_ADDRESS`` (or the one this process is in),
    or start a local one; reserve one bundle per rank. Returns the placement
    group and whether this call started the cluster (then shutdown stops it)."""
    import ray
    from ray.util.placement_group import placement_group

    started_here = False
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            # A local cluster of this machine. Ray counts logical CPUs: give it
            # at least one per rank, so TP=4 starts on a 2-core machine too.
            num_cpus = max(os.cpu_count() or 1, world_size)
            # address="local": always a cluster of our own, never one that
            # happens to run on this machine (another user's, stopped any time).
            ray.init(
                address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False
            )
            started_here = True
    resource = "GPU" if device_type == "cuda" else "CPU"
    available = ray.cluster_resources().get(resource, 0)
    if available < world_size:
        if started_here:
            ray.shutdown()
        raise ValueError(
            f"tensor_parallel_size={world_size} needs {world_size} {resource}s in the Ray "
            f"cluster, it has {available:g}"
        )
    group = placement_group([{resource: 1.0}] * world_size, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_GROUP_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        if started_here:
            ray.shutdown()
        raise RuntimeError(
            f"the Ray placement group of {world_size} {resource} bundles was not ready "
            f"within {PLACEMENT_GROUP_TIMEOUT_S:.0f} s"
        )
    return group, started_here


# Set by the executor for each worker, never copied from the driver.
WORKER_SPECIFIC_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "GLASSBOX_HOST_IP", "LOCAL_RANK")


@dataclass
class WorkerPlacement:
    """Where one rank runs: its index among its node's ranks' devices, how many
    ranks its node has, and the variables that make those devices visible."""

    local_rank: int
    local_world_size: int
    env: dict[str, str] = field(default_factory=dict)


def worker_placement(nodes_and_gpus: list[tuple[str, list[Any]]]) -> list[WorkerPlacement]:
    """``nodes_and_gpus``: per rank, its Ray node id and the GPU ids Ray gave it
    (none on the CPU). On a node with GPUs, every rank sees all of the node's
    ranks' GPUs (numeric order) and its local rank is its own GPU's position."""
    ranks_on: dict[str, list[int]] = defaultdict(list)
    gpus_on: dict[str, list[int]] = defaultdict(list)
    for rank, (node, gpus) in enumerate(nodes_and_gpus):
        ranks_on[node].append(rank)
        gpus_on[node].extend(int(g) for g in gpus)  # ids may come as strings; "10" > "9"
    placements = []
    for rank, (node, gpus) in enumerate(nodes_and_gpus):
        world = len(ranks_on[node])
        if not gpus:
            placements.append(WorkerPlacement(ranks_on[node].index(rank), world))
            continue
        visible = sorted(gpus_on[node])
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, visible))}
        placements.append(WorkerPlacement(visible.index(int(gpus[0])), world, env))
    return placements


class RayWorkerWrapper:
    """What runs inside each Ray actor: one rank's ``Worker``. The executor
    wraps this class with ``ray.remote`` (so importing this module needs no Ray)."""

    def __init__(self, glassbox_config: Any, rank: int, trace_path: str | None, level: str):
        self.glassbox_config = glassbox_config
        self.rank = rank
        self.trace_path, self.trace_level = trace_path, level
        self.worker: Any = None
        self.handlers: dict[Any, Any] = {}

    def get_node_ip(self) -> str:
        from engine.utils.network_utils import get_ip

        return get_ip()

    def get_node_and_gpu_ids(self) -> tuple[str, list[Any]]:
        """This actor's Ray node id and the GPU ids Ray assigned to it."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), list(context.get_accelerator_ids().get("GPU", []))

    def update_environment_variables(self, env: dict[str, str]) -> None:
        """Set ``env`` in this actor's process (before ``init_worker``: CUDA and
        NCCL read their variables when they start)."""
        os.environ.update(env)

    def get_open_port(self) -> int:
        from engine.utils.network_utils import get_open_port

        return get_open_port()

    def init_worker(self, distributed_init_method: str, local_rank: int, local_world: int) -> int:
        """Build the rank's worker, join the others, load the shard; its pid."""
        import logging as _logging

        from engine.tracing import Tracer, part_path
        from engine.tracing.worker_trace import WorkerProcTrace
        from engine.v1.executor.abstract import worker_handlers
        from engine.v1.worker.gpu_worker import Worker

        _logging.basicConfig(
            level=os.environ.get("GLASSBOX_LOGGING_LEVEL", "INFO"),
            format=f"(RayWorker_TP{self.rank} pid=%(process)d) %(levelname)s %(name)s: %(message)s",
            force=True,
        )
        path = part_path(self.trace_path, f"worker{self.rank}") if self.trace_path else None
        tracer = Tracer(path, self.trace_level, rank=self.rank) if path else Tracer()
        self.tracer = tracer
        self.trace = WorkerProcTrace.create(tracer)
        self.worker = Worker(
            self.glassbox_config,
            local_rank=local_rank,
            rank=self.rank,
            tracer=tracer,
            distributed_init_method=distributed_init_method,
            is_driver_worker=self.rank == 0,
            local_world_size=local_world,
        )
        self.worker.init_device()
        self.worker.load_model()
        self.handlers = worker_handlers(self.worker)
        return os.getpid()

    def execute_method(self, method: Any, *args: Any) -> Any:
        """``method``: a ``WorkerMethod`` (from the fixed table) or a function
        called as ``method(worker, *args)``. An asynchronous output is
        waited for here: only finished outputs leave the actor."""
        from engine.distributed.parallel_state import get_tp_group
        from engine.v1.outputs import AsyncModelRunnerOutput

        self.trace.rpc_received(method, args)
        try:
            if callable(method) and not isinstance(method, str):
                output = method(self.worker, *args)
            else:
                output = self.handlers[method](*args)
            if isinstance(output, AsyncModelRunnerOutput):
                output = output.get_output()
        finally:
            # Every actor answers Ray; the executor reads the output rank's.
            self.trace.rpc_done(method, args, get_tp_group(), replied=self.rank == 0)
        return output

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        tracer = getattr(self, "tracer", None)
        if tracer is not None:
            tracer.close()


def wait_for(refs: Any, what: str, timeout: float | None = None) -> Any:
    """``ray.get`` with a clear error when an actor (a rank's process) died;
    ``TimeoutError`` after ``timeout`` seconds."""
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"{what}: no answer from the workers in {timeout} s") from e
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(f"{what}: a Ray worker process died ({e.__class__.__name__})") from e
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        raise RuntimeError(f"worker failed in {what}: {type(cause).__name__}: {cause}") from None


__all__ = [
    "WORKER_SPECIFIC_ENV_VARS",
    "RayWorkerWrapper",
    "WorkerPlacement",
    "assert_ray_available",
    "initialize_ray_cluster",
    "ray_is_available",
    "wait_for",
    "worker_placement",
]
