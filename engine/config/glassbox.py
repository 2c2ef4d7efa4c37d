"""GlassboxConfig: every sub-config in one object handed to each component.

vLLM twin: ``vllm/config/vllm.py`` (``VllmConfig``). Sessions: 01.

``shutdown_timeout`` is vLLM's field: how long a stopping engine lets the
requests in flight run before it aborts them. 0 (the default, as in vLLM)
aborts at once; ``glassbox serve`` defaults it to 30.

``__post_init__`` resolves ``scheduler_config.async_scheduling`` as vLLM's
does: left at None it turns on unless the executor class cannot overlap two
steps (``Executor.supports_async_scheduling``); set to True with such an
executor it is an error. The result is logged once per process.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from engine.config.cache import CacheConfig
from engine.config.compilation import CompilationConfig
from engine.config.device import DeviceConfig
from engine.config.load import LoadConfig
from engine.config.model import ModelConfig
from engine.config.observability import ObservabilityConfig
from engine.config.parallel import ParallelConfig
from engine.config.scheduler import SchedulerConfig
from engine.config.speculative import SpeculativeConfig
from engine.config.structured_outputs import StructuredOutputsConfig

logger = logging.getLogger(__name__)
# The resolved async-scheduling setting, once logged (vLLM logs it once).
_logged_async_scheduling: set[bool] = set()


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
    shutdown_timeout: int = 0
    """Seconds a stopping engine lets the requests in flight finish before it
    aborts them; 0 aborts them at once."""

    def __post_init__(self) -> None:
        if not isinstance(self.shutdown_timeout, int) or self.shutdown_timeout < 0:
            raise ValueError(
                f"shutdown_timeout must be an integer >= 0 (seconds), got {self.shutdown_timeout!r}"
            )
        self._check_speculative_config()
        self._resolve_async_scheduling()

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
