"""StructuredOutputManager: compiles grammars and builds each step's bitmask.

vLLM twin: ``vllm/v1/structured_output/__init__.py`` (``StructuredOutputManager``).
Read it for where structured outputs live in V1: in the engine-core process,
beside the scheduler, not in the worker. ``grammar_init`` starts a request's
compile on a thread pool and stores the ``Future`` in the request (the
scheduler keeps it in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` until the
future is done; other requests run meanwhile). Each step,
``grammar_bitmask`` writes one int32 bitmask row per constrained position --
with drafts, one per draft position and one for the bonus token, stepping the
matcher forward over the drafts and back again -- and hands the rows to the
runner, which masks the logits before sampling.
Sessions: 06.

Above 128 constrained requests in a step (and without drafts) the rows are
filled by a second thread pool, 16 requests per task, as in vLLM: xgrammar
releases the GIL while it fills a row.

Simpler than vLLM: xgrammar only; no reasoning parsers (the mask applies from
the first generated token).

Tracing (Glassbox's own): the manager gets a ``StructuredOutputTrace``
(``engine/tracing/core_trace.py``) and reports compiles and each step's
allowed-token counts to it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engine.v1.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from engine.config import GlassboxConfig
    from engine.v1.request import Request


class StructuredOutputManager:
    """Engine-level owner of the grammar backend, its compile pool and the bitmask."""

    def __init__(self, glassbox_config: GlassboxConfig, trace: Any = None) -> None:
        from engine.tracing.core_trace import StructuredOutputTrace

        self.backend: StructuredOutputBackend | None = None
        self.glassbox_config = glassbox_config
        self.trace = trace if trace is not None else StructuredOutputTrace.create(None)
        self._grammar_bitmask: torch.Tensor | None = None
        spec = glassbox_config.speculative_config
        self.max_num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.tokenizer: Any = None
        self.executor: ThreadPoolExecutor | None = None
        # vLLM's numbers: threads fill the bitmask above 128 constrained requests.
        self.fill_bitmask_parallel_threshold = 128
        self.fill_bitmask_parallel_batch_size = 16
        self.executor_for_fillmask: ThreadPoolExecutor | None = None
        if glassbox_config.scheduler_config.max_num_seqs > self.fill_bitmask_parallel_threshold:
            self.executor_for_fillmask = ThreadPoolExecutor(
                max_workers=max(1, min(multiprocessing.cpu_count() // 2, 8)),
                thread_name_prefix="grammar-bitmask",
            )
        if not glassbox_config.model_config.skip_tokenizer_init:
            # Compiles are CPU-bound: half the cores at most.
            max_workers = max(1, (multiprocessing.cpu_count() + 1) // 2)
            self.executor = ThreadPoolExecutor(
                max_workers=max_workers, thread_name_prefix="grammar-compile"
            )

    def _get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            from engine.transformers_utils.tokenizer import get_tokenizer

            model_config = self.glassbox_config.model_config
            self.tokenizer = get_tokenizer(model_config.tokenizer or model_config.model)
        return self.tokenizer

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; the scheduler waits for it."""
        if request.structured_output_request is None:
            return
        if self.executor is None:
            raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init=True)")
        if self.backend is None:
            # One backend per engine, built on the first constrained request.
            from engine.v1.structured_output.backend_xgrammar import XgrammarBackend

            self.backend = XgrammarBackend(
                self.glassbox_config,
                tokenizer=self._get_tokenizer(),
                vocab_size=self.glassbox_config.model_config.vocab_size,
            )
        kind = request.structured_output_request.structured_output_key[0].name
        self.trace.compile_started(request, kind)
        request.structured_output_request.grammar = self.executor.submit(
            self._create_grammar, request
        )

    def _create_grammar(self, request: Request) -> StructuredOutputGrammar:
        assert request.structured_output_request is not None and self.backend is not None
        request_type, grammar_spec = request.structured_output_request.structured_output_key
        kind = request_type.name
        start = time.perf_counter()
        # An unchanged cache size after the compile: it was a cache hit.
        cache_size = self.backend.compiler.get_cache_size_bytes()
        try:
            grammar = self.backend.compile_grammar(request_type, grammar_spec)
        except Exception as e:
            seconds = time.perf_counter() - start
            self.trace.grammar_compiled(request.request_id, kind, seconds, False, str(e))
            raise
        cached = self.backend.compiler.get_cache_size_bytes() == cache_size
        seconds = time.perf_counter() - start
        self.trace.grammar_compiled(request.request_id, kind, seconds, cached)
        return grammar

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        structured_output_request_ids: list[str],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> np.ndarray | None:
        """Bitmask rows for the scheduled constrained requests, in order; a
        request with d drafts gets d + 1 rows (the row after draft i is what
        the grammar allows once drafts 0..i are accepted)."""
        if not structured_output_request_ids:
            return None
        assert self.backend is not None
        if self._grammar_bitmask is None:
            # A row per position that may sample: 1 + drafts per request.
            max_num_seqs = self.glassbox_config.scheduler_config.max_num_seqs
            self._grammar_bitmask = self.backend.allocate_token_bitmask(
                max_num_seqs * (1 + self.max_num_spec_tokens)
            )
        bitmask = self._grammar_bitmask
        vocab_size = self.backend.vocab_size
        if (
            self.executor_for_fillmask is not None
            and len(structured_output_request_ids) > self.fill_bitmask_parallel_threshold
            and self.max_num_spec_tokens == 0
        ):
            # One row per request: independent rows, filled by several threads.
            grammars = [
                requests[r].structured_output_request.grammar for r in structured_output_request_ids
            ]
            size = self.fill_bitmask_parallel_batch_size
            futures = [
                self.executor_for_fillmask.submit(self._fill_bitmasks, grammars[i : i + size], i)
                for i in range(0, len(grammars), size)
            ]
            for future in futures:
                future.result()
            num_rows = [1] * len(grammars)
            self.trace.bitmask_filled(structured_output_request_ids, num_rows, bitmask, vocab_size)
            return bitmask[: len(grammars)].numpy()
        row = 0
        num_rows: list[int] = []
        for req_id in structured_output_request_ids:
            request = requests[req_id]
            assert request.structured_output_request is not None
            grammar = request.structured_output_request.grammar
            assert grammar is not None
            advanced = 0
            valid = True  # a -1 (a draft not known here) ends the walk
            for token in itertools.chain(scheduled_spec_decode_tokens.get(req_id, ()), (-1,)):
                if valid:
                    self._fill_bitmasks([grammar], row)
                else:
                    bitmask[row].fill_(-1)  # past an unknown draft: nothing to constrain
                if token == -1:
                    valid = False
                if valid and not grammar.is_terminated():
                    accepted = grammar.accept_tokens(req_id, [token])
                    assert accepted, (req_id, token)  # drafts were validated
                    advanced += 1
                row += 1
            if advanced:
                grammar.rollback(advanced)
                self.trace.rolled_back(req_id, advanced)
            num_rows.append(1 + len(scheduled_spec_decode_tokens.get(req_id, ())))
        self.trace.bitmask_filled(structured_output_request_ids, num_rows, bitmask, vocab_size)
        # numpy: cheaper to serialize to a worker process than a tensor.
        return bitmask[:row].numpy()

    def _fill_bitmasks(self, grammars: list[StructuredOutputGrammar], first_row: int) -> None:
        assert self._grammar_bitmask is not None
        for row, grammar in enumerate(grammars, first_row):
            if grammar.is_terminated():
                self._grammar_bitmask[row].fill_(-1)  # nothing to constrain
            else:
                grammar.fill_bitmask(self._grammar_bitmask, row)

    def should_advance(self, request: Request) -> bool:
        """Whether the request's sampled tokens step its matcher (always,
        without reasoning parsers)."""
        return request.use_structured_output

    def clear_backend(self) -> None:
        for executor in (self.executor, self.executor_for_fillmask):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        if self.backend is not None:
            self.backend.destroy()
