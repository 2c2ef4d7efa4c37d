"""Which CUDA graph (if any) runs a given batch.

vLLM twin: ``vllm/v1/cudagraph_dispatcher.py`` (``CudagraphDispatcher``); the
key, ``BatchDescriptor``, lives in the forward context as in vLLM.
Read it for the runtime half of CUDA graphs: a graph replays fixed shapes, so
each step the runner describes its batch (token count, whether it is a
uniform decode), the dispatcher rounds the token count up to the next
captured size and answers FULL (replay the whole model's graph, padding the
inputs), PIECEWISE (replay the compiled pieces' graphs, attention eager
between them; any batch, padded in tokens only) or NONE (run eagerly).
Padding rows compute garbage that nobody reads: their slot mapping is -1
(nothing written).

Speculative decoding (``uniform_decode_query_len`` = 1 + k, vLLM's name): a
verification batch where every request runs its last token and k drafts is
uniform too. With a builder that supports such batches
(``AttentionCGSupport.UNIFORM_BATCH``) it gets graphs of its own, keyed by
tokens and requests; their sizes are the capture sizes rounded up to
multiples of 1 + k (vLLM adjusts its capture list the same way).
Sessions: 04, 06 (CUDA graphs).
"""

from __future__ import annotations

import bisect

from engine.config.compilation import CompilationConfig, CUDAGraphMode
from engine.forward_context import BatchDescriptor

__all__ = ["BatchDescriptor", "CudagraphDispatcher"]


class CudagraphDispatcher:
    def __init__(
        self,
        compilation_config: CompilationConfig,
        uniform_decode_query_len: int = 1,
        max_num_tokens: int | None = None,
        max_num_reqs: int | None = None,
    ) -> None:
        self.mode = compilation_config.cudagraph_mode
        # The runner's input buffers hold this many tokens (None: no limit).
        self.max_num_tokens = max_num_tokens
        self.uniform_decode_query_len = uniform_decode_query_len
        self.max_num_reqs = max_num_reqs
        sizes = list(compilation_config.cudagraph_capture_sizes)
        self.spec_capture_sizes = self._spec_sizes(sizes)
        # One-token decodes: a batch never holds more than max_num_reqs of them
        # (the larger sizes are there for verification and mixed batches).
        self.capture_sizes = [s for s in sizes if max_num_reqs is None or s <= max_num_reqs]
        # Piecewise graphs serve any batch (prefills too) up to the largest size.
        limit = max_num_tokens or float("inf")
        self.piecewise_capture_sizes = [s for s in sizes if s <= limit]
        # Keys captured so far (filled by the runner's capture_model()).
        self.captured: set[BatchDescriptor] = set()

    def _spec_sizes(self, sizes: list[int]) -> list[int]:
        """Token counts of the verification graphs: each capture size rounded
        up to a multiple of 1 + k, those that fit the runner's buffers and a
        batch of at most max_num_reqs requests (vLLM's bound for FULL decodes)."""
        q = self.uniform_decode_query_len
        if q == 1:
            return []
        limit = self.max_num_tokens or float("inf")
        if self.max_num_reqs is not None:
            limit = min(limit, q * self.max_num_reqs)
        return sorted({n for s in sizes if (n := -(-s // q) * q) <= limit})

    def disable_spec_graphs(self) -> None:
        """The attention builder cannot replay 1 + k tokens per request."""
        self.uniform_decode_query_len = 1
        self.spec_capture_sizes = []

    def padded_size(self, num_tokens: int, query_len: int = 1) -> int | None:
        """Smallest capture size >= num_tokens for batches of ``query_len``
        tokens per request, or None if it is too big."""
        sizes = self.capture_sizes if query_len == 1 else self.spec_capture_sizes
        i = bisect.bisect_left(sizes, num_tokens)
        return sizes[i] if i < len(sizes) else None

    def decode_keys(self) -> list[BatchDescriptor]:
        """What capture_model() should capture for FULL_DECODE_ONLY: one-token
        decodes, and with drafts, batches of 1 + k tokens per request."""
        if self.mode.decode_mode() != CUDAGraphMode.FULL:
            return []
        q = self.uniform_decode_query_len
        return [
            BatchDescriptor(num_tokens=s, num_reqs=s, uniform=True) for s in self.capture_sizes
        ] + [
            BatchDescriptor(num_tokens=s, num_reqs=s // q, uniform=True)
            for s in self.spec_capture_sizes
        ]

    def piecewise_keys(self) -> list[BatchDescriptor]:
        """What capture_model() captures for the piecewise graphs (PIECEWISE,
        FULL_AND_PIECEWISE): one key per token count, whatever the requests."""
        if not self.mode.has_piecewise_cudagraphs():
            return []
        return [BatchDescriptor(num_tokens=s) for s in self.piecewise_capture_sizes]

    def dispatch(
        self, num_tokens: int, uniform_decode: bool, query_len: int = 1
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """(runtime mode, padded batch descriptor) for this step's batch;
        ``uniform_decode``: every request runs ``query_len`` tokens. A uniform
        batch replays a FULL graph when the mode has them and one fits; any
        batch may then replay piecewise graphs; else it runs eagerly."""
        if (
            uniform_decode
            and self.mode.decode_mode() == CUDAGraphMode.FULL
            and query_len in (1, self.uniform_decode_query_len)
        ):
            padded = self.padded_size(num_tokens, query_len)
            if padded is not None:
                key = BatchDescriptor(num_tokens=padded, num_reqs=padded // query_len, uniform=True)
                if key in self.captured:
                    return CUDAGraphMode.FULL, key
        if self.mode.has_piecewise_cudagraphs():
            i = bisect.bisect_left(self.piecewise_capture_sizes, num_tokens)
            if i < len(self.piecewise_capture_sizes):
                key = BatchDescriptor(num_tokens=self.piecewise_capture_sizes[i])
                if key in self.captured:
                    return CUDAGraphMode.PIECEWISE, key
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens=num_tokens)
