"""Worker: one device, one model runner, and the memory budget for KV.

vLLM twin: ``vllm/v1/worker/gpu_worker.py`` (``Worker``: ``init_device``,
``load_model``, ``determine_available_memory``, ``initialize_from_config``,
``execute_model``, ``sample_tokens``).
Read it for how the number of KV blocks is decided:
  * CUDA: run the model once at the largest batch with no KV cache, then the
    sampler on ``max_num_seqs`` rows (``profile_run``), read the peak memory,
    and give the KV cache what is left of ``gpu_memory_utilization * total
    memory`` (or exactly ``kv_cache_memory_bytes`` when set);
  * CPU: there is nothing useful to profile, so the size is a setting --
    ``kv_cache_memory_bytes``, else ``GLASSBOX_CPU_KVCACHE_SPACE`` GiB
    (default 1), the twin of vLLM's ``VLLM_CPU_KVCACHE_SPACE``.
``num_gpu_blocks_override`` skips all of this (EngineCore never asks).
``profile`` opens and closes a profiling window (``profiler_config``): the
profiler is made at the first start and steps at the top of every
``execute_model``, which runs inside a label naming the step's prompt and
generation work (``engine/profiler/wrapper.py``).
On the CPU, ``init_device`` also sizes torch's threads to the cores this
process may use (``engine/utils/cpu_resource_utils.py``; vLLM does this for its
``CPUWorker`` in ``vllm/utils/ompmultiprocessing.py``).
Sessions: 04 (worker).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from engine.compilation.decorators import release_compiled_model
from engine.config import GlassboxConfig
from engine.distributed.parallel_state import (
    cleanup_dist_env_and_memory,
    default_backend,
    init_distributed_environment,
    initialize_model_parallel,
)
from engine.distributed.utils import get_worker_rank_suffix
from engine.profiler.wrapper import WorkerProfiler, make_worker_profiler
from engine.tracing import NULL_TRACER, Tracer
from engine.tracing.worker_trace import RunnerTrace
from engine.utils.cpu_resource_utils import init_cpu_threads_env, plan_cpu_threads
from engine.utils.torch_utils import release_device_memory
from engine.v1.utils import compute_iteration_details
from engine.v1.worker.gpu_model_runner import GPUModelRunner
from engine.v1.worker.worker_base import WorkerBase

logger = logging.getLogger(__name__)

GiB = 1 << 30


def cpu_kv_cache_space_bytes() -> int:
    raw = os.environ.get("GLASSBOX_CPU_KVCACHE_SPACE", "1")
    try:
        gib = float(raw)
    except ValueError as e:
        raise ValueError(f"GLASSBOX_CPU_KVCACHE_SPACE must be a number of GiB, got {raw!r}") from e
    if gib <= 0:
        raise ValueError(f"GLASSBOX_CPU_KVCACHE_SPACE must be > 0 GiB, got {raw!r}")
    return int(gib * GiB)


class Worker(WorkerBase):
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        local_rank: int = 0,
        rank: int = 0,
        tracer: Tracer = NULL_TRACER,
        distributed_init_method: str | None = None,
        is_driver_worker: bool = True,
        local_world_size: int = 1,
    ) -> None:
        super().__init__(glassbox_config, local_rank, rank)
        self.tracer = tracer
        # Where the ranks meet (tcp://ip:port); None with a single rank.
        self.distributed_init_method = distributed_init_method
        # The rank whose output goes back to EngineCore (rank 0).
        self.is_driver_worker = is_driver_worker
        self.local_world_size = local_world_size
        self.device: torch.device | None = None
        self.model_runner: GPUModelRunner | None = None
        # Made at the first start_profile (None: never started).
        self.profiler: WorkerProfiler | None = None
        self.profiler_config = glassbox_config.profiler_config

    def init_device(self) -> None:
        device_type = self.glassbox_config.device_config.resolve()
        if device_type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' was requested but torch sees no CUDA device")
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
        else:
            if self.profiler_config.profiler == "cuda":
                raise ValueError("profiler_config.profiler='cuda' needs a CUDA device; use 'torch'")
            self.device = torch.device("cpu")
            # This process runs the model: size torch's threads to its share
            # of the cores (the ranks of one machine split them).
            init_cpu_threads_env(plan_cpu_threads(local_world_size=self.local_world_size))
        self.init_worker_distributed_environment()
        torch.manual_seed(self.glassbox_config.model_config.seed)
        # Only the output rank records the runner's events: the others run
        # the same batch on their slices (their calls: worker.rpc_* events).
        trace = RunnerTrace.create(self.tracer if self.is_driver_worker else NULL_TRACER)
        self.model_runner = GPUModelRunner(self.glassbox_config, self.device, trace=trace)

    def init_worker_distributed_environment(self) -> None:
        """Join the other ranks (nothing to do for a single rank)."""
        parallel_config = self.glassbox_config.parallel_config
        if parallel_config.world_size == 1:
            return
        assert self.device is not None and self.distributed_init_method is not None
        backend = default_backend(self.device)
        init_distributed_environment(
            parallel_config.world_size,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            backend,
        )
        initialize_model_parallel(parallel_config.tensor_parallel_size, backend)

    def load_model(self) -> None:
        assert self.model_runner is not None, "init_device() first"
        self.model_runner.load_model()

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        assert self.model_runner is not None and self.device is not None
        cache_config = self.glassbox_config.cache_config
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return cpu_kv_cache_space_bytes()
        # Garbage first: an engine shut down earlier in this process may still hold
        # tensors, which the peak below would count as this engine's.
        release_device_memory()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        release_device_memory()
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory used by others (other processes, the CUDA context) counts too.
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * cache_config.gpu_memory_utilization)
        available = budget - peak - max(non_torch, 0)
        logger.info(
            "memory: total %.2f GiB, budget %.2f GiB, peak torch %.2f GiB, "
            "other %.2f GiB -> KV %.2f GiB",
            total / GiB,
            budget / GiB,
            peak / GiB,
            non_torch / GiB,
            available / GiB,
        )
        return available

    def get_kv_cache_spec(self):
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_spec()

    def update_max_model_len(self, max_model_len: int) -> None:
        """The auto-fitted ``max_model_len`` (``max_model_len=-1``), decided by
        EngineCore after sizing the KV cache."""
        self.glassbox_config.model_config.max_model_len = max_model_len
        self.glassbox_config.scheduler_config.max_model_len = max_model_len
        if self.model_runner is not None:
            self.model_runner.max_model_len = max_model_len

    def initialize_from_config(self, kv_cache_config) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(kv_cache_config)
        self.compile_or_warm_up_model()

    def compile_or_warm_up_model(self) -> None:
        """Compile the model (when compilation is on), then capture CUDA graphs
        (a no-op on the CPU or with enforce_eager)."""
        assert self.model_runner is not None
        self.model_runner.warm_up_model()
        self.model_runner.capture_model()

    def execute_model(self, scheduler_output):
        assert self.model_runner is not None
        with self.annotate_profile(scheduler_output):
            return self.model_runner.execute_model(scheduler_output)

    def annotate_profile(self, scheduler_output) -> contextlib.AbstractContextManager:
        """Advance the profiler one step and label the step's work."""
        if self.profiler is None:
            return contextlib.nullcontext()
        self.profiler.step()
        d = compute_iteration_details(scheduler_output)
        return self.profiler.annotate_context_manager(
            f"execute_context_{d.num_ctx_requests}({d.num_ctx_tokens})"
            f"_generation_{d.num_generation_requests}({d.num_generation_tokens})"
        )

    def apply_model(self, fn):
        """``fn(model)`` on this rank's model (``LLM.apply_model``)."""
        assert self.model_runner is not None and self.model_runner.model is not None
        return fn(self.model_runner.model)

    def add_lora(self, lora_request) -> bool:
        assert self.model_runner is not None
        return self.model_runner.add_lora(lora_request)

    def check_lora(self, lora_request) -> None:
        assert self.model_runner is not None
        self.model_runner.check_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        assert self.model_runner is not None
        return self.model_runner.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        assert self.model_runner is not None
        return self.model_runner.pin_lora(lora_id)

    def list_loras(self) -> set[int]:
        assert self.model_runner is not None
        return self.model_runner.list_loras()

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:
        """Open (``is_start``) or close the profiling window. The first start
        names the trace ``<profile_prefix>_<rank suffix>``; later windows
        keep that name (each writes its own file)."""
        if self.profiler_config.profiler is None:
            raise RuntimeError(
                "profiling is off: start the engine with profiler_config, e.g. --profiler-config "
                '\'{"profiler": "torch", "torch_profiler_dir": "./traces"}\''
            )
        if not is_start:
            if self.profiler is None:
                logger.warning("stop_profile before any start_profile: nothing to stop")
                return
            self.profiler.stop()
            return
        if self.profiler is None:
            assert self.device is not None, "init_device() first"
            suffix = get_worker_rank_suffix(global_rank=self.rank)
            name = f"{profile_prefix}_{suffix}" if profile_prefix else suffix
            self.profiler = make_worker_profiler(
                self.profiler_config, name, self.local_rank, self.device
            )
        self.profiler.start()

    def sample_tokens(self, grammar_output=None):
        assert self.model_runner is not None
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        assert self.model_runner is not None
        return self.model_runner.take_draft_token_ids()

    def shutdown(self) -> None:
        if self.profiler is not None:
            self.profiler.shutdown()  # a window still open writes its trace
        if self.model_runner is not None:
            # What outlives this engine in the process (Dynamo's caches, the
            # config the caller keeps) must not keep its weights, KV cache or graphs.
            # (Drafters always run eagerly: only the target model is compiled.)
            if self.model_runner.model is not None:
                release_compiled_model(self.model_runner.model)
            self.glassbox_config.compilation_config.static_forward_context.clear()
        self.model_runner = None
        if self.glassbox_config.parallel_config.world_size > 1:
            cleanup_dist_env_and_memory()
        if self.device is not None and self.device.type == "cuda":
            release_device_memory()
