"""CompilationConfig: which CUDA graphs to capture, at which batch sizes.

vLLM twin: ``vllm/config/compilation.py`` (``CUDAGraphMode``,
``CompilationConfig.cudagraph_mode`` / ``cudagraph_capture_sizes``).
Read it for the five graph modes and what each captures:

  NONE                run every step eagerly (kernel launches from Python);
  PIECEWISE           graphs around everything except attention (vLLM needs
                      torch.compile to split the model; not implemented here);
  FULL                one graph for the whole forward, attention included;
  FULL_DECODE_ONLY    FULL for pure-decode batches, eager for anything with a
                      prefill -- the mode Glassbox implements on CUDA;
  FULL_AND_PIECEWISE  FULL for decodes, PIECEWISE for the rest (vLLM's
                      default on recent GPUs; not implemented here).

Capture sizes follow vLLM's shape: 1, 2, 4, 8, then every 8 up to the
largest batch. A batch of 13 decodes is padded to 16 and replayed with the
16-graph. The largest is ``max_num_seqs`` tokens, times 1 + k with k drafts
per request (a verification batch of max_num_seqs requests), and never more
than ``max_num_batched_tokens``; vLLM doubles that bound (up to 512) because
its piecewise graphs also serve mixed batches, which FULL_DECODE_ONLY runs
eagerly.
Sessions: 04 (worker), 06 (CUDA graphs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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


# Modes this engine can actually run (the others are listed for the reader).
IMPLEMENTED_CUDAGRAPH_MODES = (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        return []  # SchedulerConfig reports the bad value
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if max_num_seqs > 8 and max_num_seqs % 8:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


@dataclass
class CompilationConfig:
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_DECODE_ONLY
    cudagraph_capture_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.cudagraph_mode, str):
            try:
                self.cudagraph_mode = CUDAGraphMode[self.cudagraph_mode.upper()]
            except KeyError as e:
                raise ValueError(
                    f"cudagraph_mode must be one of {[m.name for m in CUDAGraphMode]}, "
                    f"got {self.cudagraph_mode!r}"
                ) from e
        if self.cudagraph_mode not in IMPLEMENTED_CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode={self.cudagraph_mode.name} is not implemented in Glassbox; "
                f"use one of {[m.name for m in IMPLEMENTED_CUDAGRAPH_MODES]}"
            )
        if any(not isinstance(s, int) or s < 1 for s in self.cudagraph_capture_sizes):
            raise ValueError(
                "cudagraph_capture_sizes must be positive integers, "
                f"got {self.cudagraph_capture_sizes!r}"
            )
        self.cudagraph_capture_sizes = sorted(set(self.cudagraph_capture_sizes))

    def finalize(
        self,
        max_num_seqs: int,
        enforce_eager: bool,
        uniform_decode_query_len: int = 1,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """Settle the mode and sizes once the scheduler limits are known
        (``uniform_decode_query_len``: 1 + k with k drafts per request)."""
        if enforce_eager:
            self.cudagraph_mode = CUDAGraphMode.NONE
        largest = max_num_seqs * uniform_decode_query_len
        if isinstance(max_num_batched_tokens, int) and max_num_batched_tokens > 0:
            largest = min(largest, max_num_batched_tokens)
        if not self.cudagraph_capture_sizes:
            self.cudagraph_capture_sizes = default_capture_sizes(largest)
        self.cudagraph_capture_sizes = [s for s in self.cudagraph_capture_sizes if s <= largest]
