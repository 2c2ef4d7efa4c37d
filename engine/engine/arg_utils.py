"""EngineArgs: vLLM's engine arguments, under vLLM's names, turned into configs.

vLLM twin: ``vllm/engine/arg_utils.py`` (``EngineArgs.create_engine_config``).
Read it for: which user-facing argument lands in which config object. Every
keyword ``LLM(...)`` accepts is a field here. ``max_num_batched_tokens`` and
``max_num_seqs`` left at None get vLLM's defaults for the entry point (the
``UsageContext``) and the hardware (``get_batch_defaults``).
Sessions: 01, 02.
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
    ProfilerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from engine.config.lora import LoRAConfig
from engine.usage.usage_lib import UsageContext

GiB_bytes = 1 << 30


@dataclass
class EngineArgs:
    # The docstring under each field is its --help line in `glassbox serve` / `bench`.
    model: str | None = None
    """HF checkpoint folder, or a Hub name already in the Hugging Face cache;
    None or "default": the embedded SmolLM2-135M-Instruct, converted once."""
    tokenizer: str | None = None
    """Tokenizer folder, or a Hub name already in the Hugging Face cache; None: the model's."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer: prompts must be token ids, and outputs carry token ids only."""
    dtype: str = "auto"
    """Weights and activations dtype: auto (float32 on the CPU; on CUDA the
    checkpoint's float16 or bfloat16, bfloat16 for a float32 one, as vLLM), float32,
    float16 or bfloat16."""
    seed: int = 0
    """Seed of the worker's global random generator (requests may bring their own)."""
    max_model_len: int | None = None
    """Tokens per sequence (prompt + output) at most; None: the model's own limit
    from config.json; -1 (auto on the CLIs): that limit, cut at start-up to the
    longest sequence the KV cache holds. On the CLIs 32k means 32,000, 32K 32,768."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of earlier prompts that share a prefix (hash lookup)."""
    num_gpu_blocks_override: int | None = None
    """Number of KV blocks, the null block included, instead of sizing the pool
    from memory."""
    gpu_memory_utilization: float = 0.92
    """CUDA: fraction of GPU memory the engine may use (weights, activations, KV cache)."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache size in bytes (4G: 4 GiB on the CLIs); None: from
    gpu_memory_utilization on CUDA, from GLASSBOX_CPU_KVCACHE_SPACE (GiB, default 1)
    on the CPU."""
    max_num_batched_tokens: int | None = None
    """Token budget of one scheduler step; None: vLLM's default for the entry point
    and hardware (CPU: LLM 4096, serve 2048; GPU with 70 GiB or more: 16384 and
    8192; other GPUs: 8192 and 2048; times the TP size on the CPU; doubled by
    performance_mode throughput; at least max_model_len without chunked prefill)."""
    max_num_seqs: int | None = None
    """Requests running at once at most; None: vLLM's default for the entry point
    and hardware (CPU: LLM 256, serve 128; GPU with 70 GiB or more: 1024; other
    GPUs: 256; times the TP size on the CPU; doubled by performance_mode throughput)."""
    enable_chunked_prefill: bool = True
    """Split a long prompt's prefill over several steps to fit the token budget."""
    long_prefill_token_threshold: int = 0
    """When > 0, no request gets more than this many new tokens in one step."""
    scheduling_policy: str = "fcfs"
    """Order of the waiting queue: fcfs (arrival) or priority (request priority,
    then arrival)."""
    scheduler_reserve_full_isl: bool = True
    """Admit a waiting request only if the KV cache can hold its whole prompt,
    not just its first chunk."""
    stream_interval: int = 1
    """Streamed outputs go out every this many tokens (and at the first and last)."""
    # Glassbox's own (see SchedulerConfig.max_waiting_requests); -1: no limit.
    max_waiting_requests: int = SchedulerConfig.DEFAULT_MAX_WAITING_REQUESTS
    """Sequences that may wait beyond a full batch before the API server answers
    503 (a request with n samples counts n); -1: no limit."""
    load_format: str = "auto"
    """How weights are loaded: auto or safetensors (from the checkpoint), dummy
    (random weights, for benchmarks)."""
    quantization: str | None = None
    """How the weights are stored: None (as the checkpoint says), fp8 (float
    weights quantized to e4m3 as they load, activations per call) or gguf (a .gguf
    file as MODEL, its blocks dequantized inside each layer; MODEL=default with
    quantization gguf runs the embedded SmolLM2 from its Q4_1 file)."""
    hf_config_path: str | None = None
    """Folder with the model's config.json when MODEL is not one (a .gguf file)."""
    generation_config: str = "auto"
    """Default sampling parameters: auto (the model's generation_config.json), vllm
    (none: SamplingParams' own), or a folder with a generation_config.json."""
    override_generation_config: dict[str, Any] | None = None
    """JSON object of generation_config.json keys that replace the file's, e.g.
    {"temperature": 0.5}."""
    hf_overrides: dict[str, Any] | None = None
    """JSON object whose keys replace those of the model's config.json."""
    enforce_eager: bool = False
    """Run every step eagerly: no torch.compile, no CUDA graphs (optimization level 0)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split across (one worker per rank; -tp)."""
    distributed_executor_backend: str | type | None = None
    """Executor that runs the workers: uni (one, in-process), mp (a process per
    rank), ray (a Ray actor per rank), or the import path of an Executor
    subclass (module.Class); None: uni for one rank, else ray inside a Ray
    cluster, else mp."""
    device: str = "auto"
    """Where the model runs: auto (CUDA when torch sees a GPU, else cpu), cpu or cuda."""
    disable_log_stats: bool = False
    """Collect no engine statistics (the glassbox: metrics behind /metrics)."""
    trace_path: str | None = None
    """Write the event trace (JSONL) to this file; a path alone means trace_level
    lifecycle."""
    compilation_config: dict[str, Any] | None = None
    """Compilation and CUDA graphs, as a JSON object: {"mode": 0-3 (3: compile,
    split at attention), "backend": "inductor" or "eager", "compile_sizes": [...],
    "cudagraph_mode": NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE,
    "cudagraph_capture_sizes": [1, 2, 4, ...]}; what it leaves out comes from
    optimization_level."""
    performance_mode: str = "balanced"
    """balanced; interactivity (a CUDA graph for every batch size up to 32: less
    padding at small batches); throughput (twice the default max_num_batched_tokens
    and max_num_seqs, where they are left unset)."""
    optimization_level: int | None = None
    """-O0 ... -O3: 0 eager, 1 compiled with piecewise CUDA graphs, 2 and 3 compiled
    with full graphs for decodes and piecewise ones for the rest; None: 2 on CUDA,
    0 on the CPU (compiling there costs a minute at start-up)."""
    trace_level: str = "off"
    """How much the trace records: off, lifecycle (requests, scheduler, KV
    cache), or full (plus the sampler's candidates)."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs return: raw_logprobs, raw_logits (of the model's output), or
    processed_logprobs, processed_logits (after penalties, temperature, top-k/p)."""
    max_logprobs: int = 20
    """Most logprobs a request may ask for per token (logprobs=N; 20, the OpenAI
    API's limit); -1: no limit (logprobs=-1 asks for the whole vocabulary)."""
    logits_processors: list[str | type] | None = None
    """Custom logits processors, as module:Class names (or classes, from Python)."""
    served_model_name: str | list[str] | None = None
    """Name(s) the model answers to in requests; the first also labels the
    metrics. None: MODEL as given."""
    speculative_config: dict[str, Any] | None = None
    """Speculative decoding, as a JSON object: {"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}."""
    spec_method: str | None = None
    """Short for speculative_config's "method" (ngram, draft_model, eagle)."""
    spec_model: str | None = None
    """Short for speculative_config's "model" (the draft or EAGLE checkpoint)."""
    spec_tokens: int | None = None
    """Short for speculative_config's "num_speculative_tokens"."""
    structured_outputs_config: dict[str, Any] | None = None
    """Structured outputs, as a JSON object: {"backend": "auto" or "xgrammar",
    "disable_any_whitespace": false}."""
    profiler_config: dict[str, Any] | None = None
    """Profiling windows (start_profile / stop_profile, the server's
    /start_profile), as a JSON object: {"profiler": "torch",
    "torch_profiler_dir": "./traces"}; None: profiling off."""
    enable_lora: bool = False
    """Serve LoRA adapters: requests may name one (lora_request)."""
    max_loras: int = 1
    """With enable_lora: adapters on the device at once (one step mixes at most this many)."""
    max_lora_rank: int = 16
    """With enable_lora: the largest adapter rank accepted (device slots are this wide)."""
    max_cpu_loras: int | None = None
    """With enable_lora: adapters kept loaded in host memory (LRU); None: max_loras."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs on the device (vLLM's default); None:
    on unless the executor cannot overlap steps; --no-async-scheduling runs the
    serial loop."""
    shutdown_timeout: int = 0
    """Seconds a stopping engine lets the requests in flight finish (SIGTERM or
    Ctrl-C) before it aborts them; 0: abort at once."""

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def _speculative_config(self) -> SpeculativeConfig | None:
        spec = self.speculative_config
        aliases = {
            "spec_method": ("method", self.spec_method),
            "spec_model": ("model", self.spec_model),
            "spec_tokens": ("num_speculative_tokens", self.spec_tokens),
        }
        given = {name: pair for name, pair in aliases.items() if pair[1] is not None}
        if isinstance(spec, SpeculativeConfig) and not given:
            return spec
        if spec is not None and not isinstance(spec, dict):
            raise ValueError(
                f"speculative_config must be a JSON object (a dict), got {type(spec).__name__}"
            )
        if given:
            # vLLM's create_speculative_config: each alias fills one key, never both.
            spec = dict(spec or {})
            for name, (key, value) in given.items():
                if key in spec:
                    raise ValueError(
                        f"{name} and speculative_config[{key!r}] are mutually exclusive"
                    )
                spec[key] = value
        return None if spec is None else SpeculativeConfig.from_dict(spec)

    @classmethod
    def get_batch_defaults(
        cls, world_size: int, device_config: DeviceConfig | None = None
    ) -> tuple[dict[UsageContext | None, int], dict[UsageContext | None, int]]:
        """vLLM's defaults for max_num_batched_tokens and max_num_seqs, per usage
        context: (tokens, seqs). An entry point that is not listed
        (ENGINE_CONTEXT, ...) falls back to SchedulerConfig's 2048 and 128."""
        device_config = device_config or DeviceConfig()
        if device_config.resolve() == "cpu":
            return (
                {
                    UsageContext.LLM_CLASS: 4096 * world_size,
                    UsageContext.OPENAI_API_SERVER: 2048 * world_size,
                },
                {
                    UsageContext.LLM_CLASS: 256 * world_size,
                    UsageContext.OPENAI_API_SERVER: 128 * world_size,
                },
            )
        memory, name = device_config.get_device_memory_and_name()
        name = name.lower()
        # An H100/H200-class GPU gets bigger batches; A100s are excluded by name
        # because vLLM measured lower throughput there with the larger budget.
        if memory >= 70 * GiB_bytes and "a100" not in name:
            return (
                {UsageContext.LLM_CLASS: 16384, UsageContext.OPENAI_API_SERVER: 8192},
                {UsageContext.LLM_CLASS: 1024, UsageContext.OPENAI_API_SERVER: 1024},
            )
        return (
            {UsageContext.LLM_CLASS: 8192, UsageContext.OPENAI_API_SERVER: 2048},
            {UsageContext.LLM_CLASS: 256, UsageContext.OPENAI_API_SERVER: 256},
        )

    def _set_default_max_num_seqs_and_batched_tokens_args(
        self, usage_context: UsageContext | None, max_model_len: int
    ) -> None:
        """Fill max_num_batched_tokens and max_num_seqs when the user left them
        None (vLLM does the same, on the same EngineArgs object)."""
        budget_unset = self.max_num_batched_tokens is None
        if budget_unset or self.max_num_seqs is None:
            tp = self.tensor_parallel_size  # a bad value is ParallelConfig's to name
            world_size = tp if isinstance(tp, int) and tp >= 1 else 1
            tokens, seqs = self.get_batch_defaults(world_size, DeviceConfig(device=self.device))
            scale = 2 if self.performance_mode == "throughput" else 1
            if budget_unset:
                self.max_num_batched_tokens = scale * tokens.get(
                    usage_context, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
                )
            if self.max_num_seqs is None:
                self.max_num_seqs = scale * seqs.get(
                    usage_context, SchedulerConfig.DEFAULT_MAX_NUM_SEQS
                )
        if budget_unset:
            assert self.max_num_batched_tokens is not None and self.max_num_seqs is not None
            if not self.enable_chunked_prefill:
                # Without chunking a whole prompt must fit in one step.
                self.max_num_batched_tokens = max(self.max_num_batched_tokens, max_model_len)
            if isinstance(self.max_num_seqs, int) and self.max_num_seqs > 0:
                # Never more than every running sequence could use at once (a bad
                # max_num_seqs is left for SchedulerConfig to name).
                self.max_num_batched_tokens = min(
                    self.max_num_batched_tokens, self.max_num_seqs * max_model_len
                )

    def create_engine_config(self, usage_context: UsageContext | None = None) -> GlassboxConfig:
        model = self.model
        served_model_name = self.served_model_name
        if isinstance(served_model_name, list | tuple):
            served_model_name = served_model_name[0] if served_model_name else None
        tokenizer, hf_config_path = self.tokenizer, self.hf_config_path
        if model is None or model == "default":
            from engine.model_executor.model_loader.default_model import (
                DEFAULT_MODEL_NAME,
                find_default_model_gguf,
                resolve_model,
            )

            model = resolve_model(model)
            served_model_name = served_model_name or DEFAULT_MODEL_NAME
            if self.quantization == "gguf":
                # The Q4_1 file itself; config and tokenizer from its converted folder.
                hf_config_path = hf_config_path or model
                tokenizer = tokenizer or model
                model = str(find_default_model_gguf())
        model_config = ModelConfig(
            model=model,
            tokenizer=tokenizer,
            skip_tokenizer_init=self.skip_tokenizer_init,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            hf_overrides=self.hf_overrides,
            enforce_eager=self.enforce_eager,
            logprobs_mode=self.logprobs_mode,  # type: ignore[arg-type]
            max_logprobs=self.max_logprobs,
            logits_processors=self.logits_processors,
            served_model_name=served_model_name,
            quantization=self.quantization,
            hf_config_path=hf_config_path,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
        )
        max_model_len = model_config.max_model_len
        assert max_model_len is not None
        self._set_default_max_num_seqs_and_batched_tokens_args(usage_context, max_model_len)
        assert self.max_num_batched_tokens is not None and self.max_num_seqs is not None
        if isinstance(self.compilation_config, CompilationConfig):
            compilation_config = self.compilation_config
        else:
            compilation_config = CompilationConfig(**(self.compilation_config or {}))
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
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,  # type: ignore[arg-type]
                scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
                stream_interval=self.stream_interval,
                max_waiting_requests=self.max_waiting_requests,
                async_scheduling=self.async_scheduling,
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
            speculative_config=self._speculative_config(),
            structured_outputs_config=(
                self.structured_outputs_config
                if isinstance(self.structured_outputs_config, StructuredOutputsConfig)
                else StructuredOutputsConfig.from_dict(self.structured_outputs_config or {})
            ),
            profiler_config=(
                self.profiler_config
                if isinstance(self.profiler_config, ProfilerConfig)
                else ProfilerConfig.from_dict(self.profiler_config or {})
            ),
            shutdown_timeout=self.shutdown_timeout,
            optimization_level=self.optimization_level,  # type: ignore[arg-type]
            performance_mode=self.performance_mode,  # type: ignore[arg-type]
            lora_config=(
                LoRAConfig(self.max_lora_rank, self.max_loras, self.max_cpu_loras)
                if self.enable_lora
                else None
            ),
        )
