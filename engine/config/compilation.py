"""CompilationConfig: how the model is compiled, which CUDA graphs to
capture, at which batch sizes.

vLLM twin: ``vllm/config/compilation.py`` (``CompilationMode``,
``CUDAGraphMode``, ``CompilationConfig``).
Read it for the four compilation modes (see engine/compilation/decorators.py:
NONE, STOCK_TORCH_COMPILE, DYNAMO_TRACE_ONCE, VLLM_COMPILE), the settings of
the piecewise backend (``backend``, ``splitting_ops``: where the graph is
cut, by default at attention; ``compile_sizes``: token counts that get code
of their own; ``cache_dir``), ``custom_ops`` (which CustomOps run their own
kernels: "all" / "none" plus "+name" / "-name"; with Inductor the default is
"none", so the plain-torch versions get fused) and the five graph modes and
what each captures:

  NONE                run every step eagerly (kernel launches from Python);
  PIECEWISE           graphs around everything except attention: the pieces
                      the compiler split the model into (needs compilation
                      mode VLLM_COMPILE; otherwise NONE, as vLLM does);
  FULL                one graph for the whole forward, attention included
                      (for mixed batches too: no backend of ours allows that,
                      so it becomes FULL_AND_PIECEWISE or FULL_DECODE_ONLY
                      with vLLM's warning);
  FULL_DECODE_ONLY    FULL for uniform decode batches, eager for the rest;
  FULL_AND_PIECEWISE  FULL for uniform decodes, PIECEWISE for the rest
                      (vLLM's default).

Left at None, ``mode`` and ``cudagraph_mode`` come from the optimization
level (``GlassboxConfig.optimization_level``, vLLM's ``-O0`` ... ``-O3``):
O0 neither compiles nor captures; O1 compiles and captures PIECEWISE; O2 and
O3 compile and capture FULL_AND_PIECEWISE. What is set here wins over the
level, as in vLLM.

``inductor_compile_config`` holds Inductor options for every piece (and for
plain ``torch.compile`` under mode 1/2 with ``backend="inductor"``), e.g.
``{"size_asserts": False}``; vLLM's ``enable_auto_functionalized_v2: False``
is filled in, and on a GPU, as in vLLM, ``combo_kernels`` and
``benchmark_combo_kernel`` (Inductor's horizontal fusion: Qwen3's q and k
norm-and-rotary, two shapes, in one kernel; ``apply_platform_defaults``) unless
the user set either (docs/compilation.md, "Inductor's options").

Capture sizes follow vLLM's shape: 1, 2, 4, 8, then every 8 up to 256 and
every 16 beyond, plus the step's token budget when it fits. A batch of 13
decodes is padded to 16 and replayed with the 16-graph. The largest is
twice ``max_num_seqs`` tokens, times 1 + k with k drafts per request (a
verification batch of max_num_seqs requests), at most 512 and never more
than ``max_num_batched_tokens``; ``max_cudagraph_capture_size`` sets it
instead. The dispatcher captures FULL decode graphs only up to what a batch
of decodes can hold; the sizes above serve piecewise (mixed) batches.
Sessions: 04 (worker), 06 (CUDA graphs).
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class CompilationMode(enum.IntEnum):
    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


# Where the graph is cut under VLLM_COMPILE (the attention custom op).
ATTENTION_OPS = ["glassbox::unified_attention_with_output"]
COMPILE_BACKENDS = ("inductor", "eager")


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        """True when decode batches and mixed batches use different modes."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """Whether this setting ever runs the runtime mode ``mode`` (NONE, PIECEWISE, FULL)."""
        if self.separate_routine():
            return mode.value in self.value
        return self == mode

    def requires_piecewise_compilation(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.requires_piecewise_compilation()

    def max_cudagraph_mode(self) -> CUDAGraphMode:
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return self.max_cudagraph_mode() == CUDAGraphMode.FULL

    def is_valid_runtime_mode(self) -> bool:
        """NONE, PIECEWISE and FULL are what one step runs; the pairs are settings."""
        return not self.separate_routine()


def default_capture_sizes(
    largest: int, max_num_tokens: int | None = None, every_size_up_to: int = 0
) -> list[int]:
    """1, 2, 4 (every size up to ``every_size_up_to``: 32 in vLLM's interactivity
    mode), every 8 below 256, every 16 from 256, up to ``largest``; plus
    ``max_num_tokens`` when it fits, so a full step has a graph of its exact size."""
    if not isinstance(largest, int) or largest < 1:
        return []  # SchedulerConfig reports the bad value
    sizes = [s for s in (1, 2, 4) if s <= largest]
    sizes += list(range(1, min(largest, every_size_up_to) + 1))
    sizes += list(range(8, min(largest + 1, 256), 8))
    sizes += list(range(256, largest + 1, 16))
    if max_num_tokens is not None and max_num_tokens <= largest:
        sizes.append(max_num_tokens)
    return sorted(set(sizes))


@dataclass
class CompilationConfig:
    mode: CompilationMode | None = None
    backend: str = "inductor"
    splitting_ops: list[str] | None = None
    compile_sizes: list[int | str] | None = None
    cache_dir: str = ""
    custom_ops: list[str] = field(default_factory=list)
    cudagraph_mode: CUDAGraphMode | None = None
    cudagraph_capture_sizes: list[int] = field(default_factory=list)
    max_cudagraph_capture_size: int | None = None
    # Inductor options (``torch._inductor.config`` names) for every piece it compiles.
    inductor_compile_config: dict[str, Any] = field(default_factory=dict)
    # Attention layer name -> layer, filled as the model is built; the forward
    # context hands it to the attention custom op. Not part of the settings:
    # not compared, shown or pickled.
    static_forward_context: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "static_forward_context": {}}

    def __post_init__(self) -> None:
        self._check_compilation_fields()
        if self.mode is not None:
            self._set_mode_defaults()
        if isinstance(self.cudagraph_mode, str):
            try:
                self.cudagraph_mode = CUDAGraphMode[self.cudagraph_mode.upper()]
            except KeyError as e:
                raise ValueError(
                    f"cudagraph_mode must be one of {[m.name for m in CUDAGraphMode]}, "
                    f"got {self.cudagraph_mode!r}"
                ) from e
        if any(not isinstance(s, int) or s < 1 for s in self.cudagraph_capture_sizes):
            raise ValueError(
                "cudagraph_capture_sizes must be positive integers, "
                f"got {self.cudagraph_capture_sizes!r}"
            )
        self.cudagraph_capture_sizes = sorted(set(self.cudagraph_capture_sizes))
        # vLLM's choice: functionalization V1 for mutating custom ops in the graph.
        self.inductor_compile_config.setdefault("enable_auto_functionalized_v2", False)

    def apply_platform_defaults(self, device_type: str) -> None:
        """vLLM's Inductor defaults for the device the model runs on: on anything but
        the CPU (where Inductor has no combo kernels), horizontal fusion, with Inductor
        timing each combination before it keeps it, unless the user set either option."""
        options = self.inductor_compile_config
        if device_type != "cpu" and not {"combo_kernels", "benchmark_combo_kernel"} & set(options):
            options["combo_kernels"] = True
            options["benchmark_combo_kernel"] = True

    def _check_compilation_fields(self) -> None:
        mode = self.mode
        if mode is not None:
            if isinstance(mode, str) and not mode.isdigit():
                try:
                    mode = CompilationMode[mode.upper()]
                except KeyError:
                    mode = "?"
            try:
                self.mode = CompilationMode(int(mode))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise ValueError(
                    f"compilation_config.mode must be one of 0-3 or "
                    f"{[m.name for m in CompilationMode]}, got {self.mode!r}"
                ) from None
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(
                f"compilation_config.backend must be one of {list(COMPILE_BACKENDS)}, "
                f"got {self.backend!r}"
            )
        for op in self.splitting_ops or []:
            if not isinstance(op, str) or "::" not in op:
                raise ValueError(
                    "compilation_config.splitting_ops entries are 'namespace::op' names, "
                    f"got {op!r}"
                )
        sizes: list[int | str] = []
        for size in self.compile_sizes or []:
            if size != "cudagraph_capture_sizes" and (not isinstance(size, int) or size < 1):
                raise ValueError(
                    "compilation_config.compile_sizes entries are positive integers or "
                    f"'cudagraph_capture_sizes', got {size!r}"
                )
            sizes.append(size)
        self.compile_sizes = sizes
        self._check_inductor_compile_config()
        for op in self.custom_ops:
            if op not in ("all", "none") and op[:1] not in ("+", "-"):
                raise ValueError(
                    f"compilation_config.custom_ops entries are 'all', 'none', '+name' or "
                    f"'-name', got {op!r}"
                )

    def _check_inductor_compile_config(self) -> None:
        options = self.inductor_compile_config
        if not isinstance(options, dict):
            raise ValueError(
                "compilation_config.inductor_compile_config must be a dict of Inductor "
                f"options, got {options!r}"
            )
        if not options:
            return
        import torch._inductor.config as inductor_config  # only when options are given

        known = inductor_config.get_config_copy()
        unknown = [name for name in options if name not in known]
        if unknown:
            raise ValueError(
                f"compilation_config.inductor_compile_config: {unknown[0]!r} is not an "
                "option of torch._inductor.config"
            )

    def _set_mode_defaults(self) -> None:
        """The settings that follow from the compilation mode, once it is known."""
        if self.splitting_ops is None:
            compiled = self.mode == CompilationMode.VLLM_COMPILE
            self.splitting_ops = list(ATTENTION_OPS) if compiled else []
        if not {"all", "none"} & set(self.custom_ops):
            # Under Inductor the plain-torch versions fuse; hand-written kernels would not.
            compiled = self.mode != CompilationMode.NONE and self.backend == "inductor"
            self.custom_ops.append("none" if compiled else "all")

    def apply_level_defaults(self, mode: CompilationMode, cudagraph_mode: CUDAGraphMode) -> None:
        """Fill what the user left at None with an optimization level's choices."""
        if self.mode is None:
            self.mode = mode
        if self.cudagraph_mode is None:
            self.cudagraph_mode = cudagraph_mode
        self._set_mode_defaults()

    def run_eagerly(self, reason: str) -> None:
        """No torch.compile and no CUDA graphs (mode 0, cudagraph_mode NONE); the
        log says ``reason`` when that turns off something that was on."""
        asked = (self.mode or CompilationMode.NONE, self.cudagraph_mode or CUDAGraphMode.NONE)
        if asked != (CompilationMode.NONE, CUDAGraphMode.NONE):
            logger.warning(
                "%s: no torch.compile and no CUDA graphs (the same as compilation mode 0 "
                "and cudagraph_mode NONE)",
                reason,
            )
        self.mode = CompilationMode.NONE
        self.cudagraph_mode = CUDAGraphMode.NONE
        # Without a compiler to fuse them, the layers run their own kernels.
        self.custom_ops = [op for op in self.custom_ops if op != "none"] or ["all"]

    def is_custom_op_enabled(self, name: str) -> bool:
        """Whether the CustomOp ``name`` runs its own kernels (else ``forward_native``)."""
        if "all" in self.custom_ops:
            return f"-{name}" not in self.custom_ops
        return f"+{name}" in self.custom_ops

    def splitting_ops_contain_attention(self) -> bool:
        return any(op in (self.splitting_ops or []) for op in ATTENTION_OPS)

    def resolve_cudagraph_mode(self, min_cg_support: Any, backend_name: str) -> CUDAGraphMode:
        """Fit the graph mode to what the attention backend's metadata allows
        under a graph (``min_cg_support``, an ``AttentionCGSupport``), with
        vLLM's downgrades and messages (``resolve_cudagraph_mode_and_sizes``)."""
        mode = self.cudagraph_mode
        support = min_cg_support.name
        where = f"with the {backend_name} backend (support: {support})"
        if mode.mixed_mode() == CUDAGraphMode.FULL and support != "ALWAYS":
            if support == "NEVER":
                raise ValueError(
                    f"cudagraph_mode {mode.name} is not supported {where}; use PIECEWISE "
                    "with compilation mode VLLM_COMPILE"
                )
            mode = (
                CUDAGraphMode.FULL_AND_PIECEWISE
                if self.splitting_ops_contain_attention()
                else CUDAGraphMode.FULL_DECODE_ONLY
            )
            logger.warning(
                "cudagraph_mode %s is not supported %s; setting cudagraph_mode=%s",
                self.cudagraph_mode.name,
                where,
                mode.name,
            )
        if mode.decode_mode() == CUDAGraphMode.FULL and support == "NEVER":
            piecewise = (
                self.mode == CompilationMode.VLLM_COMPILE and self.splitting_ops_contain_attention()
            )
            downgraded = CUDAGraphMode.PIECEWISE if piecewise else CUDAGraphMode.NONE
            logger.warning(
                "cudagraph_mode %s is not supported %s; setting cudagraph_mode=%s",
                mode.name,
                where,
                downgraded.name,
            )
            mode = downgraded
        self.cudagraph_mode = mode
        return mode

    def resolved_cache_dir(self) -> str:
        """``cache_dir``, else ``$GLASSBOX_CACHE/torch_compile_cache``."""
        if self.cache_dir:
            return os.path.expanduser(self.cache_dir)
        root = os.environ.get("GLASSBOX_CACHE", "~/.cache/glassbox")
        return os.path.join(os.path.expanduser(root), "torch_compile_cache")

    def _set_cudagraph_sizes(
        self,
        max_num_seqs: int,
        uniform_decode_query_len: int,
        max_num_tokens: int | None,
        performance_mode: str = "balanced",
    ) -> None:
        """vLLM's ``VllmConfig._set_cudagraph_sizes``: the largest graph is twice
        what a batch of decodes can hold (mixed batches replay graphs too), at
        most 512 and never more than the step's token budget; user sizes are
        kept up to the budget. ``max_cudagraph_capture_size`` ends as the
        largest size in the list."""
        if self.cudagraph_mode == CUDAGraphMode.NONE:
            self.cudagraph_capture_sizes = []  # nothing to capture
            return
        if not (isinstance(max_num_tokens, int) and max_num_tokens > 0):
            max_num_tokens = None
        asked_sizes = list(self.cudagraph_capture_sizes)
        largest = self.max_cudagraph_capture_size
        if largest is None:
            largest = min(max_num_seqs * uniform_decode_query_len * 2, 512)
        if max_num_tokens is not None:
            largest = min(largest, max_num_tokens)
        if asked_sizes:
            limit = max_num_tokens if max_num_tokens is not None else max(asked_sizes)
            sizes = sorted({s for s in asked_sizes if s <= limit})
        else:
            every = 32 if performance_mode == "interactivity" else 0
            sizes = default_capture_sizes(largest, max_num_tokens, every_size_up_to=every)
        valid_max = sizes[-1] if sizes else 0
        if self.max_cudagraph_capture_size not in (None, valid_max):
            if asked_sizes:
                raise ValueError(
                    f"max_cudagraph_capture_size ({self.max_cudagraph_capture_size}) must equal "
                    f"the largest of cudagraph_capture_sizes ({valid_max})"
                )
            logger.warning("Truncating max_cudagraph_capture_size to %d", valid_max)
        if len(sizes) < len(asked_sizes):
            logger.warning(
                "cudagraph_capture_sizes %s cut to %s (max_num_batched_tokens %s)",
                asked_sizes,
                sizes,
                max_num_tokens,
            )
        self.max_cudagraph_capture_size = valid_max
        self.cudagraph_capture_sizes = sizes

    def finalize(
        self,
        max_num_seqs: int,
        enforce_eager: bool,
        uniform_decode_query_len: int = 1,
        max_num_batched_tokens: int | None = None,
        performance_mode: str = "balanced",
    ) -> None:
        """Settle the mode and sizes once the scheduler limits are known
        (``uniform_decode_query_len``: 1 + k with k drafts per request;
        ``performance_mode`` interactivity: a graph for every size up to 32).
        Fields still None get O0's choices (GlassboxConfig applies the level
        it was given first)."""
        if enforce_eager:
            self.run_eagerly("enforce_eager is set")
        self.apply_level_defaults(CompilationMode.NONE, CUDAGraphMode.NONE)
        if (
            self.cudagraph_mode.requires_piecewise_compilation()
            and self.mode != CompilationMode.VLLM_COMPILE
        ):
            logger.warning(
                "cudagraph_mode %s needs compilation mode VLLM_COMPILE (3) to split the "
                "model into pieces; compilation mode is %s: setting cudagraph_mode NONE",
                self.cudagraph_mode.name,
                self.mode.name,
            )
            self.cudagraph_mode = CUDAGraphMode.NONE
        self._set_cudagraph_sizes(
            max_num_seqs, uniform_decode_query_len, max_num_batched_tokens, performance_mode
        )
        # compile_sizes may name the capture sizes (vLLM's "cudagraph_capture_sizes").
        sizes: set[int] = set()
        for size in self.compile_sizes or []:
            if isinstance(size, str):
                sizes.update(self.cudagraph_capture_sizes)
            else:
                sizes.add(size)
        self.compile_sizes = sorted(sizes)
