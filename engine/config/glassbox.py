"""GlassboxConfig: every sub-config in one object handed to each component.

vLLM twin: ``vllm/config/vllm.py`` (``VllmConfig``). Sessions: 01.

``shutdown_timeout`` is vLLM's field: how long a stopping engine lets the
requests in flight run before it aborts them. 0 (the default, as in vLLM)
aborts at once; ``glassbox serve`` defaults it to 30.

``__post_init__`` resolves ``scheduler_config.async_scheduling`` as vLLM's
does: left at None it turns on unless the executor class cannot overlap two
steps (``Executor.supports_async_scheduling``); set to True with such an
executor it is an error. The result is logged once per process. vLLM's CPU
platform turns async scheduling off whatever was asked
(``CpuPlatform.check_and_update_config``); Glassbox does not, so a learner
on a laptop watches the loop vLLM runs on a GPU.

``performance_mode`` is vLLM's (``PerformanceMode``): it changes two
defaults, the batch limits (``EngineArgs``) and the capture sizes
(``CompilationConfig``). vLLM's field docstring also speaks of kernel choices;
at 52a31cc its code, too, reads the mode in only these two places.

``optimization_level`` is vLLM's ``-O0`` ... ``-O3`` (``OptimizationLevel``):
it picks the compilation mode and CUDA-graph mode that
``compilation_config`` leaves at None (``OPTIMIZATION_LEVEL_TO_CONFIG``),
then ``compilation_config.finalize`` settles sizes and downgrades.
``enforce_eager=True`` is O0 whatever the level. vLLM's levels also switch
Inductor fusion passes (``pass_config``) and FlashInfer autotuning; Glassbox
has neither, so its levels differ only in those two modes, and O3 equals O2
(as in vLLM today). Left at None the level is O2 (vLLM's default) on CUDA and
O0 on the CPU: vLLM compiles on the CPU too, but a cold Inductor build of
even the default model costs about a minute on a 2-core laptop, longer than
the work a learner runs; pass ``optimization_level=2`` (``-O2``) for it.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.config.cache import CacheConfig
from engine.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
from engine.config.device import DeviceConfig
from engine.config.load import LoadConfig
from engine.config.lora import LoRAConfig
from engine.config.model import ModelConfig
from engine.config.observability import ObservabilityConfig
from engine.config.parallel import ParallelConfig
from engine.config.profiler import ProfilerConfig
from engine.config.scheduler import SchedulerConfig
from engine.config.speculative import SpeculativeConfig
from engine.config.structured_outputs import StructuredOutputsConfig

logger = logging.getLogger(__name__)
# The resolved async-scheduling setting, once logged (vLLM logs it once).
_logged_async_scheduling: set[bool] = set()


# vLLM's PerformanceMode: "balanced" (default); "interactivity" captures a CUDA
# graph for every batch size up to 32 (less padding at small batches);
# "throughput" doubles the default max_num_batched_tokens and max_num_seqs.
PerformanceMode = Literal["balanced", "interactivity", "throughput"]
PERFORMANCE_MODES = ("balanced", "interactivity", "throughput")


class OptimizationLevel(enum.IntEnum):
    O0 = 0  # start at once: eager, no CUDA graphs
    O1 = 1  # Dynamo + Inductor, piecewise CUDA graphs
    O2 = 2  # O1, plus full CUDA graphs for uniform decode batches
    O3 = 3  # the same as O2


# What each level fills in where compilation_config leaves a field at None.
OPTIMIZATION_LEVEL_TO_CONFIG: dict[OptimizationLevel, dict[str, object]] = {
    OptimizationLevel.O0: {"mode": CompilationMode.NONE, "cudagraph_mode": CUDAGraphMode.NONE},
    OptimizationLevel.O1: {
        "mode": CompilationMode.VLLM_COMPILE,
        "cudagraph_mode": CUDAGraphMode.PIECEWISE,
    },
    OptimizationLevel.O2: {
        "mode": CompilationMode.VLLM_COMPILE,
        "cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE,
    },
    OptimizationLevel.O3: {
        "mode": CompilationMode.VLLM_COMPILE,
        "cudagraph_mode": CUDAGraphMode.FULL_AND_PIECEWISE,
    },
}


@dataclass
class GlassboxConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    shutdown_timeout: int = 0
    """Seconds a stopping engine lets the requests in flight finish before it
    aborts them; 0 aborts them at once."""
    optimization_level: OptimizationLevel | None = None
    """0-3 (vLLM's -O0 ... -O3); None: O2 on CUDA, O0 on the CPU."""
    performance_mode: PerformanceMode = "balanced"
    """balanced, interactivity or throughput (see PerformanceMode)."""
    lora_config: LoRAConfig | None = None
    """Serve LoRA adapters (None: LoRA off)."""
    # The model's QuantizationConfig (None: unquantized), built from
    # model_config.quantization; every linear layer and the vocabulary ask it
    # for their quant method.
    quant_config: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.shutdown_timeout, int) or self.shutdown_timeout < 0:
            raise ValueError(
                f"shutdown_timeout must be an integer >= 0 (seconds), got {self.shutdown_timeout!r}"
            )
        if self.performance_mode not in PERFORMANCE_MODES:
            raise ValueError(
                f"performance_mode must be one of {', '.join(PERFORMANCE_MODES)}, "
                f"got {self.performance_mode!r}"
            )
        if self.performance_mode != "balanced":
            logger.info("Performance mode set to %r.", self.performance_mode)
        self._check_speculative_config()
        self._resolve_async_scheduling()
        self._apply_optimization_level()
        self.quant_config = self._get_quantization_config()
        self._check_parallel_config()

    def _check_parallel_config(self) -> None:
        """vLLM's ``ModelConfig.verify_with_parallel_config``: the heads must
        split evenly, plus what Glassbox cannot split yet."""
        tp = self.parallel_config.tensor_parallel_size
        spec = self.speculative_config
        draft_tp = spec.draft_tensor_parallel_size if spec is not None else None
        if draft_tp is not None and draft_tp != tp:
            raise ValueError(
                f"draft_tensor_parallel_size must equal tensor_parallel_size ({tp}): Glassbox "
                f"runs the draft on the target's ranks, got {draft_tp}"
            )
        if tp == 1:
            return
        hf = self.model_config.hf_config
        heads = int(hf.get("num_attention_heads", 1))
        if heads % tp:
            raise ValueError(
                f"tensor_parallel_size: the model's {heads} attention heads are not "
                f"divisible by tensor_parallel_size {tp}"
            )
        kv_heads = self.model_config.get_num_kv_heads()
        if (tp % kv_heads if tp > kv_heads else kv_heads % tp) != 0:
            raise ValueError(
                f"tensor_parallel_size: the model's {kv_heads} KV heads can neither be split "
                f"across nor replicated over {tp} ranks"
            )
        if self.lora_config is not None:
            raise ValueError("LoRA with tensor_parallel_size > 1 is not supported by Glassbox yet")
        if self.model_config.quantization == "gguf":
            raise ValueError("GGUF weights with tensor_parallel_size > 1 are not supported")
        if (
            self.device_config.resolve() == "cuda"
            and self.parallel_config.distributed_executor_backend == "mp"
        ):
            import torch

            if torch.cuda.device_count() < tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} needs {tp} GPUs on this machine, "
                    f"it has {torch.cuda.device_count()}"
                )

    def _run_lora_eagerly(self) -> None:
        """Glassbox's LoRA layers run outside torch.compile and CUDA graphs (vLLM
        captures them; the CPU platform of vLLM turns compilation off too)."""
        if self.speculative_config is not None:
            raise ValueError("LoRA with speculative decoding is not supported by Glassbox yet")
        self.compilation_config.run_eagerly("LoRA adapters run eagerly in Glassbox")

    def _get_quantization_config(self) -> Any:
        name = self.model_config.quantization
        if name is None:
            return None
        from engine.model_executor.layers.quantization import get_quantization_config

        checkpoint_config = self.model_config.hf_config.get("quantization_config") or {}
        return get_quantization_config(name).from_config(checkpoint_config)

    def _apply_optimization_level(self) -> None:
        level = self.optimization_level
        device_type = self.device_config.resolve()
        if level is None:
            level = OptimizationLevel.O2 if device_type == "cuda" else OptimizationLevel.O0
        try:
            self.optimization_level = OptimizationLevel(level)
        except ValueError:
            raise ValueError(f"optimization_level must be 0, 1, 2 or 3, got {level!r}") from None
        defaults = OPTIMIZATION_LEVEL_TO_CONFIG[self.optimization_level]
        compilation = self.compilation_config
        compilation.apply_level_defaults(**defaults)  # type: ignore[arg-type]
        compilation.apply_platform_defaults(device_type)
        if self.lora_config is not None:
            self._run_lora_eagerly()
        scheduler = self.scheduler_config
        compilation.finalize(
            scheduler.max_num_seqs,
            enforce_eager=self.model_config.enforce_eager,
            uniform_decode_query_len=1 + self.num_speculative_tokens,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            performance_mode=self.performance_mode,
        )

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per request per step at most; 0 without speculative decoding."""
        spec = self.speculative_config
        if spec is None or spec.num_speculative_tokens is None:
            return 0
        return spec.num_speculative_tokens

    def _check_speculative_config(self) -> None:
        spec = self.speculative_config
        if spec is None:
            return
        budget = self.scheduler_config.max_num_batched_tokens
        if budget is not None and 1 + self.num_speculative_tokens > budget:
            # Glassbox's own check: vLLM would cut every draft list to fit, for ever.
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens}: verifying them takes "
                f"1 + {self.num_speculative_tokens} tokens of one request in one step, more "
                f"than max_num_batched_tokens={budget}; lower num_speculative_tokens"
            )
        if spec.method == "ngram" or spec.draft_model_config is not None:
            return
        spec.draft_model_config = self._create_draft_model_config(spec)

    def _create_draft_model_config(self, spec: SpeculativeConfig) -> ModelConfig:
        """The draft's ModelConfig: its own checkpoint, the target's dtype and
        seed, a context no longer than the target's. An EAGLE head's
        architecture gets vLLM's ``Eagle`` prefix (``LlamaForCausalLM`` ->
        ``EagleLlamaForCausalLM``), as vLLM's ``EAGLEConfig`` renames it."""
        target = self.model_config
        assert spec.model is not None
        try:
            probe = ModelConfig(model=spec.model, skip_tokenizer_init=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config.model={spec.model!r}: {e}") from e
        overrides: dict = {}
        if spec.use_eagle():
            overrides["architectures"] = [
                a if a.startswith("Eagle") else f"Eagle{a}" for a in probe.architectures
            ]
        spec.verify_equal_vocab_size_if_draft_model(target, probe)
        max_model_len = spec._maybe_override_draft_max_model_len(
            spec.max_model_len, probe.max_model_len or 0, target.max_model_len or 0
        )
        if max_model_len < (target.max_model_len or 0):
            raise ValueError(
                f"speculative_config.model={spec.model!r}: the draft's max_model_len="
                f"{max_model_len} is shorter than the target's max_model_len="
                f"{target.max_model_len}; lower max_model_len to {max_model_len}"
            )
        # replace() keeps the hf_config already read (the overrides apply on top).
        return dataclasses.replace(
            probe,
            dtype=target.dtype,
            seed=target.seed,
            max_model_len=max_model_len,
            hf_overrides=overrides or None,
            enforce_eager=target.enforce_eager,
        )

    def _resolve_async_scheduling(self) -> None:
        from engine.v1.executor.abstract import Executor

        scheduler_config = self.scheduler_config
        if self.speculative_config is not None:
            # vLLM's rule: only some speculative methods overlap steps.
            asked = scheduler_config.async_scheduling
            resolved = self.speculative_config.resolve_async_scheduling(asked)
            scheduler_config.async_scheduling = resolved
        backend = self.parallel_config.distributed_executor_backend
        name = getattr(backend, "__name__", backend)
        supported = Executor.get_class(self).supports_async_scheduling()
        if scheduler_config.async_scheduling and not supported:
            raise ValueError(
                f"async_scheduling: the {name!r} executor does not support it; "
                "use --no-async-scheduling"
            )
        if scheduler_config.async_scheduling is None:
            if not supported:
                msg = "Async scheduling is off: the %r executor does not support it."
                logger.warning(msg, name)
            scheduler_config.async_scheduling = supported
        if scheduler_config.async_scheduling not in _logged_async_scheduling:
            _logged_async_scheduling.add(scheduler_config.async_scheduling)
            logger.info(
                "Asynchronous scheduling is %s.",
                "enabled" if scheduler_config.async_scheduling else "disabled",
            )
