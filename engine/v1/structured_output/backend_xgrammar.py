"""The xgrammar backend: compile a constraint once, then one matcher per request.

vLLM twin: ``vllm/v1/structured_output/backend_xgrammar.py``
(``XgrammarBackend``, ``XgrammarGrammar``, ``validate_xgrammar_grammar``).
Read it for the three objects xgrammar is built from: ``TokenizerInfo`` (every
token's bytes, so a grammar over characters can be turned into one over
token ids), ``GrammarCompiler`` (constraint -> ``CompiledGrammar``, with its
own cache) and ``GrammarMatcher`` (a request's state: ``accept_token``,
``rollback``, ``fill_next_token_bitmask``). ``validate_xgrammar_grammar`` runs
in the front end, before the request reaches the engine: a bad schema, regex
or grammar is a ``ValueError`` there, not a failure inside the engine loop.
Sessions: 06.

Simpler than vLLM: no Mistral tokenizers, no Lark-to-EBNF conversion (a
grammar must be xgrammar's EBNF), no structural tags. ``GrammarMatcher`` is
built without ``max_rollback_tokens``: xgrammar 0.2 always keeps the whole
history and warns when the argument is passed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from engine.v1.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    StructuredOutputOptions,
)
from engine.v1.structured_output.utils import choice_as_grammar

if TYPE_CHECKING:
    import torch

    from engine.sampling_params import SamplingParams

# xgrammar's compiled-grammar cache, in MiB (vLLM: VLLM_XGRAMMAR_CACHE_MB, same default).
XGRAMMAR_CACHE_MB = int(os.environ.get("GLASSBOX_XGRAMMAR_CACHE_MB", "512"))


@dataclass
class XgrammarBackend(StructuredOutputBackend):
    def __post_init__(self) -> None:
        so_config = self.glassbox_config.structured_outputs_config
        self.disable_any_whitespace = so_config.disable_any_whitespace
        # vocab_size is the model's (its logits' width): ids the tokenizer
        # lacks (padding rows of the embedding) are never allowed.
        tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size
        )
        self.compiler = xgr.GrammarCompiler(
            tokenizer_info,
            max_threads=8,
            cache_enabled=True,
            cache_limit_bytes=XGRAMMAR_CACHE_MB * 1024 * 1024,
        )

    def compile_grammar(
        self, request_type: StructuredOutputOptions, grammar_spec: str
    ) -> StructuredOutputGrammar:
        any_whitespace = not self.disable_any_whitespace
        if request_type == StructuredOutputOptions.JSON:
            ctx = self.compiler.compile_json_schema(grammar_spec, any_whitespace=any_whitespace)
        elif request_type == StructuredOutputOptions.JSON_OBJECT:
            ctx = self.compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=any_whitespace
            )
        elif request_type == StructuredOutputOptions.GRAMMAR:
            ctx = self.compiler.compile_grammar(grammar_spec)
        elif request_type == StructuredOutputOptions.REGEX:
            ctx = self.compiler.compile_regex(grammar_spec)
        elif request_type == StructuredOutputOptions.CHOICE:
            ctx = self.compiler.compile_grammar(choice_as_grammar(json.loads(grammar_spec)))
        else:
            raise ValueError(f"structured_outputs: unknown constraint kind {request_type}")
        return XgrammarGrammar(matcher=xgr.GrammarMatcher(ctx), vocab_size=self.vocab_size, ctx=ctx)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(max_num_seqs, self.vocab_size)

    def destroy(self) -> None:
        del self.compiler


@dataclass
class XgrammarGrammar(StructuredOutputGrammar):
    vocab_size: int
    matcher: Any = field(hash=False)
    ctx: Any = field(hash=False)
    num_processed_tokens: int = field(default=0, repr=False, hash=False, init=False)
    _is_terminated: bool = field(default=False, repr=False, hash=False)

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self._is_terminated:
            return False
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        self._is_terminated = self.matcher.is_terminated()
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))  # validation leaves no trace
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens
        self._is_terminated = self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, idx)

    def is_terminated(self) -> bool:
        return self._is_terminated

    def reset(self) -> None:
        self.num_processed_tokens = 0
        self._is_terminated = False
        self.matcher.reset()


# String formats xgrammar's JSON-schema converter understands (others would
# be silently unconstrained, so they are refused up front, as in vLLM).
STRING_SUPPORTED_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname",
        "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
        "relative-json-pointer",
    }
)  # fmt: skip


def find_xgrammar_unsupported_json_feature(schema: Any) -> str | None:
    """The first schema keyword xgrammar cannot enforce, or None. Glassbox's
    own form of vLLM's ``has_xgrammar_unsupported_json_features``: it names
    the keyword, so the error can."""
    if isinstance(schema, list):
        for item in schema:
            if (found := find_xgrammar_unsupported_json_feature(item)) is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if kind in ("integer", "number") and "multipleOf" in schema:
        return "multipleOf"
    if kind == "array":
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in schema:
                return key
    fmt = schema.get("format")
    if (
        kind == "string"
        and fmt is not None
        and (not isinstance(fmt, str) or fmt not in STRING_SUPPORTED_FORMATS)
    ):
        return f"format={fmt!r}"
    if kind == "object":
        for key in ("patternProperties", "propertyNames"):
            if key in schema:
                return key
    for value in schema.values():
        if (found := find_xgrammar_unsupported_json_feature(value)) is not None:
            return found
    return None


# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: ".
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _reason(e: Exception) -> str:
    return _XGRAMMAR_ERROR_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e) else repr(e)


def validate_xgrammar_grammar(sampling_params: SamplingParams) -> None:
    """Check the request's constraint parses, before it enters the engine.
    A ``choice`` list is rewritten to the EBNF grammar it compiles to (as
    vLLM does), so from here on it is a ``grammar`` request."""
    so = sampling_params.structured_outputs
    if so is None:
        return
    if so.regex is not None:
        try:
            xgr.Grammar.from_regex(so.regex)
        except Exception as e:
            raise ValueError(f"structured_outputs.regex is not a valid regex: {_reason(e)}") from e
        return
    if so.choice is not None:
        grammar = choice_as_grammar(so.choice)
        try:
            xgr.Grammar.from_ebnf(grammar)
        except Exception as e:
            raise ValueError(f"structured_outputs.choice cannot be compiled: {_reason(e)}") from e
        so.choice = None
        so.grammar = grammar
        return
    if so.json is not None:
        if isinstance(so.json, str):
            try:
                schema = json.loads(so.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {_reason(e)}") from e
        else:
            schema = so.json
        if not isinstance(schema, dict):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}"
            )
        if (feature := find_xgrammar_unsupported_json_feature(schema)) is not None:
            raise ValueError(
                f"structured_outputs.json uses {feature}, which the xgrammar backend cannot enforce"
            )
        try:
            xgr.Grammar.from_json_schema(json.dumps(schema))
        except Exception as e:
            raise ValueError(
                f"structured_outputs.json is not a valid JSON schema: {_reason(e)}"
            ) from e
        return
    if so.grammar is not None:
        try:
            xgr.Grammar.from_ebnf(so.grammar)
        except Exception as e:
            raise ValueError(
                f"structured_outputs.grammar is not a valid EBNF grammar: {_reason(e)}"
            ) from e
