"""Which CUDA graph (if any) runs a given batch.

vLLM twin: ``vllm/v1/cudagraph_dispatcher.py`` (``CudagraphDispatcher``) and
``BatchDescriptor`` in ``vllm/forward_context.py``.
Read it for the runtime half of CUDA graphs: a graph replays fixed shapes, so
each step the runner describes its batch (token count, whether it is a
uniform decode), the dispatcher rounds the token count up to the next
captured size and answers FULL (replay that graph, padding the inputs) or
NONE (run eagerly). Padding rows compute garbage that nobody reads: their
slot mapping points at the null block.
Sessions: 04, 06 (CUDA graphs).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.config.compilation import CompilationConfig, CUDAGraphMode


@dataclass(frozen=True)
class BatchDescriptor:
    """The key a graph is captured and looked up under."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False


class CudagraphDispatcher:
    def __init__(self, compilation_config: CompilationConfig) -> None:
        self.mode = compilation_config.cudagraph_mode
        self.capture_sizes = list(compilation_config.cudagraph_capture_sizes)
        # Keys captured so far (filled by the runner's capture_model()).
        self.captured: set[BatchDescriptor] = set()

    def padded_size(self, num_tokens: int) -> int | None:
        """Smallest capture size >= num_tokens, or None if it is too big."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def decode_keys(self) -> list[BatchDescriptor]:
        """What capture_model() should capture for FULL_DECODE_ONLY."""
        if self.mode.decode_mode() != CUDAGraphMode.FULL:
            return []
        return [BatchDescriptor(num_tokens=s, num_reqs=s, uniform=True) for s in self.capture_sizes]

    def dispatch(
        self, num_tokens: int, uniform_decode: bool
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """(runtime mode, padded batch descriptor) for this step's batch."""
        eager = BatchDescriptor(num_tokens=num_tokens)
        if not uniform_decode or self.mode.decode_mode() != CUDAGraphMode.FULL:
            return CUDAGraphMode.NONE, eager
        padded = self.padded_size(num_tokens)
        if padded is None:
            return CUDAGraphMode.NONE, eager
        key = BatchDescriptor(num_tokens=padded, num_reqs=padded, uniform=True)
        if key not in self.captured:
            return CUDAGraphMode.NONE, eager
        return CUDAGraphMode.FULL, key
