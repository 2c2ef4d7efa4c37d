"""EngineArgs: vLLM's engine arguments, under vLLM's names, turned into configs.

vLLM twin: ``vllm/engine/arg_utils.py`` (``EngineArgs.create_engine_config``).
Read it for: which user-facing argument lands in which config object. Every
keyword ``LLM(...)`` accepts is a field here.
Sessions: 01.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    GlassboxConfig,
    LoadConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
)


@dataclass
class EngineArgs:
    # None (or "default") = the embedded SmolLM2-135M-Instruct, converted once.
    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    stream_interval: int = 1
    load_format: str = "auto"
    hf_overrides: dict[str, Any] | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None
    device: str = "auto"
    disable_log_stats: bool = False
    trace_path: str | None = None
    # {"cudagraph_mode": "FULL_DECODE_ONLY" | "NONE", "cudagraph_capture_sizes": [...]}
    compilation_config: dict[str, Any] | None = None
    trace_level: str = "off"
    logprobs_mode: str = "raw_logprobs"
    logits_processors: list[str | type] | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self) -> GlassboxConfig:
        model = self.model
        if model is None or model == "default":
            from engine.model_executor.model_loader.default_model import resolve_model

            model = resolve_model(model)
        model_config = ModelConfig(
            model=model,
            tokenizer=self.tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            hf_overrides=self.hf_overrides,
            enforce_eager=self.enforce_eager,
            logprobs_mode=self.logprobs_mode,  # type: ignore[arg-type]
            logits_processors=self.logits_processors,
        )
        max_model_len = model_config.max_model_len
        assert max_model_len is not None
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            # Offline default, as vLLM's LLM class: a generous budget; without
            # chunked prefill it must cover a whole max-length prompt.
            max_num_batched_tokens = SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        if isinstance(self.compilation_config, CompilationConfig):
            compilation_config = self.compilation_config
        else:
            compilation_config = CompilationConfig(**(self.compilation_config or {}))
        max_num_seqs = (
            SchedulerConfig.DEFAULT_MAX_NUM_SEQS if self.max_num_seqs is None else self.max_num_seqs
        )
        compilation_config.finalize(max_num_seqs, enforce_eager=self.enforce_eager)
        return GlassboxConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            ),
            scheduler_config=SchedulerConfig(
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=(
                    SchedulerConfig.DEFAULT_MAX_NUM_SEQS
                    if self.max_num_seqs is None
                    else self.max_num_seqs
                ),
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,  # type: ignore[arg-type]
                scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
                stream_interval=self.stream_interval,
            ),
            load_config=LoadConfig(load_format=self.load_format),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            device_config=DeviceConfig(device=self.device),
            compilation_config=compilation_config,
            observability_config=ObservabilityConfig(
                trace_path=self.trace_path, trace_level=self.trace_level
            ),
        )
