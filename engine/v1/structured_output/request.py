"""A request's structured-output state as the scheduler keeps it.

vLLM twin: ``vllm/v1/structured_output/request.py``
(``StructuredOutputRequest``, ``get_structured_output_key``).
Read it for how the asynchronous compile is hidden: ``grammar`` holds a
``Future`` from the manager's thread pool until the compile is done, and
reading it (the scheduler does, each step, for a request parked in
``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``) polls the future without blocking
and swaps in the result once it is there.
Sessions: 06.

Simpler than vLLM: no reasoning-parser state (``reasoning_ended``). As in
vLLM, a compile that fails raises from the future into the engine loop: the
front end has already parsed the same constraint with xgrammar, so it is not
expected to happen.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from engine.v1.structured_output.backend_types import (
    StructuredOutputGrammar,
    StructuredOutputKey,
    StructuredOutputOptions,
)

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams, StructuredOutputsParams


@dataclasses.dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    _grammar: Future[StructuredOutputGrammar] | StructuredOutputGrammar | None = None

    @staticmethod
    def from_sampling_params(
        sampling_params: SamplingParams | None,
    ) -> StructuredOutputRequest | None:
        if sampling_params is None or sampling_params.structured_outputs is None:
            return None
        return StructuredOutputRequest(params=sampling_params.structured_outputs)

    def _check_grammar_completion(self) -> bool:
        if isinstance(self._grammar, Future):
            try:
                self._grammar = self._grammar.result(timeout=0)  # polls; never blocks
            except FutureTimeout:
                return False
        return True

    @property
    def is_grammar_ready(self) -> bool:
        return self._check_grammar_completion()

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        if not self._check_grammar_completion():
            return None
        return self._grammar  # type: ignore[return-value]

    @grammar.setter
    def grammar(self, grammar: StructuredOutputGrammar | Future[StructuredOutputGrammar]) -> None:
        self._grammar = grammar

    @functools.cached_property
    def structured_output_key(self) -> StructuredOutputKey:
        return get_structured_output_key(self.params)


def get_structured_output_key(params: StructuredOutputsParams) -> StructuredOutputKey:
    """(kind, spec) in the order vLLM checks the fields; a dict schema is
    dumped to JSON so equal schemas share a cache entry."""
    if params.json is not None:
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return StructuredOutputOptions.JSON, spec
    if params.json_object:
        return StructuredOutputOptions.JSON_OBJECT, ""
    if params.regex is not None:
        return StructuredOutputOptions.REGEX, params.regex
    if params.choice is not None:
        return StructuredOutputOptions.CHOICE, json.dumps(params.choice)
    if params.grammar is not None:
        return StructuredOutputOptions.GRAMMAR, params.grammar
    raise ValueError("structured_outputs: no constraint is set")
