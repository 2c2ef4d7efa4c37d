"""Per-request sampling knobs, checked once when the request is made.

vLLM twin: ``vllm/sampling_params.py``.
Read it for: every field a request can set (OpenAI-style penalties,
temperature/top-p/top-k/min-p, stop strings and stop token ids, token limits,
logprobs, logit bias ...), the ranges each one must lie in, the normalisation
done in ``__post_init__`` (one stop string becomes a list, seed -1 means
"no seed", temperature ~0 switches to greedy and turns top-p/top-k/min-p off),
and the two hooks the input processor calls before a request enters the
engine: ``update_from_generation_config`` (model's EOS and extra EOS ids) and
``update_from_tokenizer`` (bad words -> token ids, vocab range checks).
``SamplingParams`` is a ``msgspec.Struct`` because it travels inside
``EngineCoreRequest`` from the front-end process to EngineCore.
Sessions: 01 (engine loop: what a request carries), 05 (sampling: what the
sampler does with these numbers).

Simpler than vLLM:
- ``StructuredOutputsParams`` has no ``structural_tag`` (tool-call tags), and
  its per-request whitespace options are refused: vLLM's xgrammar backend
  ignores them and reads the engine's ``structured_outputs_config`` instead.
- Left out: beam search (``BeamSearchParams``), thinking
  budgets, repetition detection, ``logprob_token_ids``/``flat_logprobs``,
  routed-expert capture and the pydantic mixin. Glassbox has no engine support
  for them, so a field for them would be a promise the engine cannot keep.
- vLLM runs the model-dependent checks (logprobs against ``max_logprobs``,
  logit_bias / allowed_token_ids against the vocabulary) in ``verify()``.
  Glassbox checks ``max_logprobs`` in ``InputProcessor._validate_logprobs`` and
  folds the vocabulary checks into ``update_from_tokenizer``, since the
  tokenizer is what knows the vocab size.
- vLLM quietly keeps ``top_k=-1`` and lets the input batch treat any
  ``top_k <= 0`` as "disabled"; Glassbox rewrites -1 to 0 here so downstream
  code only ever sees 0 for "disabled".
- Type mistakes (``temperature="hot"``) are reported as ``ValueError`` naming
  the field, instead of whatever a comparison would happen to raise.
- ``RequestOutputKind`` is an ``IntEnum`` (vLLM: ``Enum`` with int values);
  both travel over msgspec as the same small int.

Differs from vLLM on purpose: every integer (``top_k``, ``seed``,
``max_tokens``, ``min_tokens``, ``logprobs``, ``prompt_logprobs`` and the ids in
``stop_token_ids``, ``allowed_token_ids`` and ``logit_bias``) must fit a signed
64-bit integer. vLLM checks that range only for the server's ``seed`` and
``priority``; a larger value elsewhere passes its checks and then fails when
msgpack encodes the request for EngineCore (an error that names no field, a
500 on the server).
"""

from __future__ import annotations

import copy
import logging
import math
import os
from enum import IntEnum
from functools import cached_property
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

# Below this temperature the request is treated as greedy (argmax).
_SAMPLING_EPS = 1e-5
# Temperatures in (0, _MAX_TEMP) are raised to _MAX_TEMP: dividing logits by a
# tiny number overflows to inf/nan in half precision.
_MAX_TEMP = 1e-2
# Upper bound on n. vLLM reads VLLM_MAX_N_SEQUENCES; Glassbox reads
# GLASSBOX_MAX_N_SEQUENCES with the same default.
_DEFAULT_MAX_N_SEQUENCES = 16384
# Every integer must fit a signed 64-bit int: msgpack carries nothing wider to
# EngineCore, and the signed range is the one vLLM's server gives seed and priority.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def _max_n_sequences() -> int:
    raw = os.environ.get("GLASSBOX_MAX_N_SEQUENCES")
    if raw is None:
        return _DEFAULT_MAX_N_SEQUENCES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"GLASSBOX_MAX_N_SEQUENCES must be a positive integer, got {raw!r}"
        ) from None
    if value < 1:
        raise ValueError(f"GLASSBOX_MAX_N_SEQUENCES must be a positive integer, got {raw!r}")
    return value


class SamplingType(IntEnum):
    """How the sampler picks a token for this request."""

    GREEDY = 0  # argmax; temperature ~ 0
    RANDOM = 1  # draw from the distribution with the batch's shared generator
    RANDOM_SEED = 2  # draw with this request's own seeded generator


class RequestOutputKind(IntEnum):
    """What each streamed ``RequestOutput`` contains."""

    CUMULATIVE = 0  # all text/tokens generated so far, every time
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


# ---------------------------------------------------------------------------
# Small checkers: each raises ValueError naming the field and what it expects.
# bool is a subclass of int in Python; it is rejected wherever a number is
# meant, because `top_k=True` is almost certainly a mistake.
# ---------------------------------------------------------------------------


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _as_int(name: str, value: Any, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        expected = "an int or None" if allow_none else "an int"
        raise ValueError(f"{name} must be {expected}, got {_describe(value)}")
    return value


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _as_bool(name: str, value: Any, *, allow_none: bool = False) -> bool | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        expected = "a bool or None" if allow_none else "a bool"
        raise ValueError(f"{name} must be {expected}, got {_describe(value)}")
    return value


def _as_int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {_describe(value)}")
    bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int)]
    if bad:
        raise ValueError(f"{name} must contain only integers, got {list(value)}")
    return list(value)


def _as_str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got {_describe(value)}")
    bad = [v for v in value if not isinstance(v, str)]
    if bad:
        raise ValueError(f"{name} must contain only strings, got {list(value)}")
    if any(v == "" for v in value):
        raise ValueError(f"{name} cannot contain an empty string, got {list(value)}")
    return list(value)


def _as_logit_bias(value: Any) -> dict[int, float]:
    """Normalise logit_bias to {token_id: bias}.

    Keys may be ints or strings holding ints, because JSON object keys (the
    OpenAI API's logit_bias) are always strings.
    """
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token_id -> bias, got {_describe(value)}")
    normalised: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, bool):
            token_id = None
        elif isinstance(key, int):
            token_id = key
        elif isinstance(key, str):
            try:
                token_id = int(key)
            except ValueError:
                token_id = None
        else:
            token_id = None
        if token_id is None:
            raise ValueError(f"logit_bias keys must be token ids (ints), got key {key!r}")
        if token_id < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id}")
        normalised[token_id] = _as_float(f"logit_bias[{token_id}]", bias)
    return normalised


def _tokenizer_vocab_size(tokenizer: Any) -> int | None:
    """Number of valid token ids the tokenizer knows about, if it says.

    Prefers ``max_token_id + 1`` (what vLLM's tokenizer wrappers expose), then
    ``len(tokenizer)`` (HF tokenizers, added tokens included), then
    ``vocab_size``. None when the object offers none of these.
    """
    max_token_id = getattr(tokenizer, "max_token_id", None)
    if isinstance(max_token_id, int) and not isinstance(max_token_id, bool):
        return max_token_id + 1
    if hasattr(type(tokenizer), "__len__"):
        return len(tokenizer)
    vocab_size = getattr(tokenizer, "vocab_size", None)
    if isinstance(vocab_size, int) and not isinstance(vocab_size, bool):
        return vocab_size
    return None


# Deeper schemas would hit Python's recursion limit when a request is copied.
_MAX_SCHEMA_DEPTH = 64


def _nesting_depth(value: Any) -> int:
    """Levels of dicts/lists in ``value`` (iterative: no recursion limit)."""
    depth, level = 0, [value]
    while level:
        level = [
            child
            for v in level
            if isinstance(v, dict | list)
            for child in (v.values() if isinstance(v, dict) else v)
        ]
        depth += 1
    return depth - 1


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """One constraint on a request's output (session 06). Exactly one of
    ``json`` (a JSON schema, as a dict or a JSON string), ``regex``,
    ``choice`` (the output is one of these strings), ``grammar`` (xgrammar's
    EBNF) and ``json_object`` (any JSON object) must be set; the input
    processor checks it compiles before the request reaches the engine."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    _backend: str | None = None
    """Set by the input processor: the backend that checked it."""
    _backend_was_auto: bool = False

    def __post_init__(self) -> None:
        checks = (
            ("json", self.json, (str, dict)),
            ("regex", self.regex, str),
            ("choice", self.choice, list),
            ("grammar", self.grammar, str),
            ("json_object", self.json_object, bool),
        )
        for name, value, kind in checks:
            if value is not None and not isinstance(value, kind):
                raise ValueError(
                    f"structured_outputs.{name} has the wrong type: {_describe(value)}"
                )
        if self.choice is not None:
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be an empty list")
            _as_str_list("structured_outputs.choice", self.choice)
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be true when given")
        if isinstance(self.json, dict) and _nesting_depth(self.json) > _MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"structured_outputs.json is nested more than {_MAX_SCHEMA_DEPTH} levels deep"
            )
        if isinstance(self.grammar, str) and not self.grammar.strip():
            raise ValueError("structured_outputs.grammar must not be an empty string")
        set_fields = [name for name, value, _ in checks if value is not None]
        if len(set_fields) > 1:
            raise ValueError(
                "structured_outputs takes one kind of constraint, got "
                f"{len(set_fields)}: {', '.join(set_fields)}"
            )
        if not set_fields:
            raise ValueError(
                "structured_outputs needs one constraint: json, regex, choice, grammar or "
                "json_object"
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if getattr(self, name):
                raise ValueError(
                    f"structured_outputs.{name} is not a per-request option here: set "
                    f"structured_outputs_config.{name} on the engine (vLLM's xgrammar "
                    "backend reads only that)"
                )
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is an outlines option; the xgrammar "
                "backend does not support it"
            )

    def all_constraints_none(self) -> bool:
        return all(
            getattr(self, f) is None for f in ("json", "regex", "choice", "grammar", "json_object")
        )


class RepetitionDetectionParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Stop a request whose output ends in a pattern of ``min_pattern_size``..
    ``max_pattern_size`` tokens repeated ``min_count`` times in a row (e.g.
    ``abcabcabc``: size 3, count 3). ``max_pattern_size=0`` turns it off."""

    max_pattern_size: int = 0
    """Longest pattern looked for, in tokens (0: detection off)."""
    min_pattern_size: int = 0
    """Shortest pattern looked for (0: 1)."""
    min_count: int = 0
    """Back-to-back repeats that end the request (>= 2 when detection is on)."""

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"repetition_detection.{name} must be an int >= 0, got {value!r}")
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError(
                f"repetition_detection.min_pattern_size ({self.min_pattern_size}) must be <= "
                f"max_pattern_size ({self.max_pattern_size}); set both to 0 to turn it off"
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                f"repetition_detection.min_count must be >= 2 to detect a repeat, got "
                f"{self.min_count}; set max_pattern_size to 0 to turn detection off"
            )


def _as_repetition_detection(value: Any) -> RepetitionDetectionParams | None:
    """The OpenAI body's object (a dict) as ``RepetitionDetectionParams``."""
    if value is None or isinstance(value, RepetitionDetectionParams):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"repetition_detection must be an object, got {type(value).__name__}")
    fields = set(RepetitionDetectionParams.__struct_fields__)
    if unknown := sorted(set(value) - fields):
        raise ValueError(f"repetition_detection: unknown field(s) {unknown}")
    return RepetitionDetectionParams(**value)


class SamplingParams(
    msgspec.Struct,
    omit_defaults=True,  # only non-default fields go over the wire
    dict=True,  # gives instances a __dict__, which @cached_property needs
):
    """Sampling parameters for one request (OpenAI completions semantics).

    Every field is validated in ``__post_init__``; a bad value raises
    ``ValueError`` naming the field and its allowed range. ``__post_init__``
    also runs when msgspec decodes the struct on the EngineCore side, so all
    normalisation here is written to be idempotent.
    """

    n: int = 1
    """Samples to generate for the prompt; each becomes a CompletionOutput."""
    presence_penalty: float = 0.0
    """In [-2, 2]. Subtracted once from the logit of every token already
    generated; > 0 pushes towards new tokens, < 0 towards repeats."""
    frequency_penalty: float = 0.0
    """In [-2, 2]. Like presence_penalty but scaled by how many times the
    token has been generated so far."""
    repetition_penalty: float = 1.0
    """> 0. Multiplicative penalty on tokens seen in the prompt or output;
    > 1 discourages repeats, < 1 encourages them, 1 disables it."""
    temperature: float = 1.0
    """>= 0. Logits are divided by it; below 1e-5 means greedy."""
    top_p: float = 1.0
    """In (0, 1]. Keep the smallest set of tokens whose probability mass
    reaches top_p; 1 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 (or -1, rewritten to 0)
    disables it."""
    min_p: float = 0.0
    """In [0, 1]. Drop tokens whose probability is below min_p times the
    most likely token's; 0 disables it."""
    seed: int | None = None
    """Per-request RNG seed (makes the request RANDOM_SEED); -1 means None."""
    stop: str | list[str] | None = None
    """Stop strings; normalised to a list. Matched in the detokenized text and
    cut from the output unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the sample; normalised to a list. The stop token is
    kept in the output token ids."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token (benchmarking)."""
    max_tokens: int | None = 16
    """Cap on generated tokens per sample. None lets the engine fill in
    max_model_len - prompt_len."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked out until this many tokens exist."""
    logprobs: int | None = None
    """Top-k logprobs to return per generated token (the sampled token is
    always included too, so up to k+1 entries); -1 means the whole vocab."""
    prompt_logprobs: int | None = None
    """Top-k logprobs to return per prompt token; -1 means the whole vocab."""
    detokenize: bool = True
    """Produce text; False returns token ids only (stop strings then can't
    work)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    spaces_between_special_tokens: bool = True
    """Put spaces between adjacent special tokens in the text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each streamed RequestOutput holds; see RequestOutputKind."""
    skip_clone: bool = False
    """Internal: the caller promises this object is used by one request only,
    so clone() may make a shallow copy instead of a deep one."""

    # --- Filled in by __post_init__ / the input processor, not by users. ---
    output_text_buffer_length: int = 0
    """Characters of text the detokenizer holds back from streaming, so that
    a stop string split across tokens is never shown before it is cut."""
    _eos_token_id: int | None = None
    """The model's EOS id (None when ignore_eos); set by
    update_from_generation_config."""
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    """stop_token_ids plus every EOS id: the set min_tokens must mask."""

    # --- Fields that turn into logits processors. ---
    logit_bias: dict[int, float] | None = None
    """token_id -> value added to that token's logit. String keys holding
    ints are accepted (JSON object keys are always strings)."""
    allowed_token_ids: list[int] | None = None
    """If given (non-empty), every other token's logit is masked out."""
    extra_args: dict[str, Any] | None = None
    """Free-form extras for custom sampling code; unused by Glassbox itself."""

    bad_words: list[str] | None = None
    """Words that must not be generated: the last token of a word's token
    sequence is banned whenever the tokens before it were just generated."""
    _bad_words_token_ids: list[list[int]] | None = None
    """bad_words encoded to token ids; set by update_from_tokenizer."""

    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar
    (session 06): disallowed tokens are masked out before sampling."""
    repetition_detection: RepetitionDetectionParams | None = None
    """End the request (finish_reason "repetition") when its output ends in a
    repeated token pattern (``RepetitionDetectionParams``)."""

    skip_reading_prefix_cache: bool | None = None
    """Don't take prompt tokens from the prefix cache. Defaults to True when
    prompt_logprobs are requested, since cached prompt tokens are never run
    through the model and so would have no logprobs."""

    @staticmethod
    def from_optional(
        n: int | None = 1,
        presence_penalty: float | None = 0.0,
        frequency_penalty: float | None = 0.0,
        repetition_penalty: float | None = 1.0,
        temperature: float | None = 1.0,
        top_p: float | None = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        bad_words: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        ignore_eos: bool = False,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        detokenize: bool = True,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        logit_bias: dict[int, float] | dict[str, float] | None = None,
        allowed_token_ids: list[int] | None = None,
        extra_args: dict[str, Any] | None = None,
        skip_clone: bool = False,
        structured_outputs: StructuredOutputsParams | None = None,
        repetition_detection: RepetitionDetectionParams | dict | None = None,
    ) -> SamplingParams:
        """Build from API-style arguments where None means "use the default".

        This is the entry point for an OpenAI-style server: an omitted JSON
        field arrives as None. Like the OpenAI API, logit_bias values are
        clamped to [-100, 100] and string keys are turned into token ids.
        """
        if logit_bias is not None:
            logit_bias = {
                token_id: min(100.0, max(-100.0, bias))
                for token_id, bias in _as_logit_bias(logit_bias).items()
            }
        return SamplingParams(
            n=1 if n is None else n,
            presence_penalty=0.0 if presence_penalty is None else presence_penalty,
            frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            bad_words=bad_words,
            include_stop_str_in_output=include_stop_str_in_output,
            ignore_eos=ignore_eos,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            detokenize=detokenize,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            output_kind=output_kind,
            logit_bias=logit_bias,
            allowed_token_ids=allowed_token_ids,
            extra_args=extra_args,
            skip_clone=skip_clone,
            structured_outputs=structured_outputs,
            repetition_detection=_as_repetition_detection(repetition_detection),
        )

    def __post_init__(self) -> None:
        self._normalise_types()

        if 0 < self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature=%s is below %s and would risk inf/nan logits; using %s instead.",
                self.temperature,
                _MAX_TEMP,
                _MAX_TEMP,
            )
            self.temperature = _MAX_TEMP

        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0

        self._verify_args()

        # Hold back enough characters that the longest stop string can still
        # be found (and cut) before any of it is streamed to the user.
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.output_text_buffer_length = 0

        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters below cannot change the argmax, so turn them
            # off and let the sampler skip them.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            self._verify_greedy_sampling()

        # The engine adds the EOS id(s) later (update_from_generation_config).
        self._all_stop_token_ids.update(self.stop_token_ids)

        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None

    def _normalise_types(self) -> None:
        """Check each field's type and bring it to its canonical form."""
        self.n = _as_int("n", self.n)
        self.presence_penalty = _as_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _as_float("frequency_penalty", self.frequency_penalty)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        self.temperature = _as_float("temperature", self.temperature)
        self.top_p = _as_float("top_p", self.top_p)
        self.top_k = _as_int("top_k", self.top_k)
        self.min_p = _as_float("min_p", self.min_p)
        self.seed = _as_int("seed", self.seed, allow_none=True)
        self.max_tokens = _as_int("max_tokens", self.max_tokens, allow_none=True)
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        # Booleans are accepted as counts, as in vLLM: True means top-1 and
        # False means 0 (only the sampled token's own logprob).
        if isinstance(self.logprobs, bool):
            self.logprobs = int(self.logprobs)
        if isinstance(self.prompt_logprobs, bool):
            self.prompt_logprobs = int(self.prompt_logprobs)
        self.logprobs = _as_int("logprobs", self.logprobs, allow_none=True)
        self.prompt_logprobs = _as_int("prompt_logprobs", self.prompt_logprobs, allow_none=True)

        self.stop = [] if self.stop is None else _as_str_list("stop", self.stop)
        self.stop_token_ids = (
            []
            if self.stop_token_ids is None
            else _as_int_list("stop_token_ids", self.stop_token_ids)
        )
        self.bad_words = [] if self.bad_words is None else _as_str_list("bad_words", self.bad_words)

        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "skip_clone",
        ):
            _as_bool(name, getattr(self, name))
        _as_bool("skip_reading_prefix_cache", self.skip_reading_prefix_cache, allow_none=True)
        self.repetition_detection = _as_repetition_detection(self.repetition_detection)

        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(
                f"output_kind must be a RequestOutputKind "
                f"({', '.join(f'{k.name}={k.value}' for k in RequestOutputKind)}), "
                f"got {_describe(self.output_kind)}"
            ) from None

        if self.logit_bias is not None:
            self.logit_bias = _as_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_int_list("allowed_token_ids", self.allowed_token_ids)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{_describe(self.structured_outputs)}"
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {_describe(self.extra_args)}")

    def _verify_args(self) -> None:
        max_n = _max_n_sequences()
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > max_n:
            raise ValueError(
                f"n must be at most {max_n}, got {self.n}. "
                "Raise the limit with the GLASSBOX_MAX_N_SEQUENCES environment variable."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(
                f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}."
            )
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings need detokenize=True (they are matched in the text); "
                f"got stop={self.stop} with detokenize=False."
            )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or a non-empty list, got [].")
            negative = [t for t in self.allowed_token_ids if t < 0]
            if negative:
                raise ValueError(
                    f"allowed_token_ids must be non-negative token ids, got {negative}."
                )

        self._verify_int64_range()

    def _verify_int64_range(self) -> None:
        range_text = "64-bit integer (from -2**63 to 2**63 - 1)"
        # n is left out: _max_n_sequences() bounds it far lower.
        for name in ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f"{name} must be a {range_text}, got {value}.")
        for name, token_ids in (
            ("stop_token_ids", self.stop_token_ids or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("logit_bias", self.logit_bias or ()),
        ):
            bad = [t for t in token_ids if not INT64_MIN <= t <= INT64_MAX]
            if bad:
                raise ValueError(f"{name} token ids must each be a {range_text}, got {bad[0]}.")

    def _verify_greedy_sampling(self) -> None:
        # n identical argmax samples would be a waste; vLLM refuses them too.
        if self.n > 1:
            raise ValueError(
                f"n must be 1 when using greedy sampling (temperature < {_SAMPLING_EPS}), "
                f"got {self.n}."
            )

    def update_from_generation_config(
        self,
        generation_config: dict[str, Any],
        eos_token_id: int | None = None,
    ) -> None:
        """Take the model's EOS token(s) into account.

        ``eos_token_id`` is the tokenizer's EOS. It stops generation unless
        ignore_eos, and always joins ``all_stop_token_ids`` so that min_tokens
        masks it. ``generation_config["eos_token_id"]`` (an int or a list) may
        name extra EOS ids (chat models often have several); those become
        ordinary stop_token_ids, again unless ignore_eos.
        """
        if eos_token_id is not None:
            _as_int("eos_token_id", eos_token_id)
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)

        config_eos = generation_config.get("eos_token_id")
        if config_eos is None:
            return
        if isinstance(config_eos, int) and not isinstance(config_eos, bool):
            config_eos = [config_eos]
        extra_eos = _as_int_list("generation_config['eos_token_id']", config_eos)
        # The primary EOS is handled on its own; don't list it twice.
        extra_eos = [t for t in dict.fromkeys(extra_eos) if t != eos_token_id]
        if not extra_eos:
            return
        self._all_stop_token_ids.update(extra_eos)
        if not self.ignore_eos:
            assert self.stop_token_ids is not None  # normalised in __post_init__
            self.stop_token_ids = self.stop_token_ids + [
                t for t in extra_eos if t not in self.stop_token_ids
            ]

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Resolve what needs the tokenizer: bad words and vocab range checks.

        ``tokenizer`` needs ``encode(text, add_special_tokens=False) ->
        list[int]``; its vocabulary size is read from ``max_token_id``,
        ``len()`` or ``vocab_size`` when available, and token ids in
        allowed_token_ids, logit_bias and the encoded bad words must fall
        inside it.
        """
        vocab_size = _tokenizer_vocab_size(tokenizer)
        if vocab_size is not None:
            if self.allowed_token_ids is not None:
                out_of_vocab = [t for t in self.allowed_token_ids if t >= vocab_size]
                if out_of_vocab:
                    raise ValueError(
                        f"allowed_token_ids must be in [0, {vocab_size - 1}] "
                        f"(vocab size {vocab_size}), got out-of-vocab ids {out_of_vocab}."
                    )
            if self.logit_bias:
                out_of_vocab = [t for t in self.logit_bias if t >= vocab_size]
                if out_of_vocab:
                    raise ValueError(
                        f"logit_bias token ids must be in [0, {vocab_size - 1}] "
                        f"(vocab size {vocab_size}), got out-of-vocab ids {out_of_vocab}."
                    )

        if not self.bad_words:
            return
        bad_words_token_ids: list[list[int]] = []
        for bad_word in self.bad_words:
            # A word is tokenized differently at the start of the text and
            # after a space ("hello" vs " hello"). Ban both spellings, but the
            # spaced one only if it is a genuinely different token sequence
            # of the same length (not e.g. a lone space token + the same ids).
            stripped = bad_word.lstrip()
            plain = list(tokenizer.encode(stripped, add_special_tokens=False))
            if not plain:
                raise ValueError(
                    f"bad_words entry {bad_word!r} encodes to no tokens; "
                    "each bad word must contain at least one token."
                )
            bad_words_token_ids.append(plain)
            spaced = list(tokenizer.encode(" " + stripped, add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                bad_words_token_ids.append(spaced)

        if vocab_size is not None:
            out_of_vocab = [
                t for ids in bad_words_token_ids for t in ids if t < 0 or t >= vocab_size
            ]
            if out_of_vocab:
                raise ValueError(
                    f"bad_words encode to token ids outside [0, {vocab_size - 1}] "
                    f"(vocab size {vocab_size}): {out_of_vocab}."
                )
        self._bad_words_token_ids = bad_words_token_ids

    def _validate_structured_outputs(self, structured_outputs_config: Any) -> None:
        """Pick the backend and check the constraint compiles (front end)."""
        so = self.structured_outputs
        if so is None:
            return
        backend = structured_outputs_config.backend
        if so._backend is not None and so._backend != backend:
            if not (backend == "auto" and so._backend_was_auto):
                raise ValueError(
                    f"structured_outputs: the request asks for backend {so._backend!r} but the "
                    f"engine runs {backend!r}; per-request backends are not supported"
                )
        from engine.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

        validate_xgrammar_grammar(self)  # "auto" and "xgrammar" both end here
        so._backend = "xgrammar"
        so._backend_was_auto = backend == "auto"

    @cached_property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    def clone(self) -> SamplingParams:
        """An independent copy (shallow when skip_clone promises no sharing)."""
        if self.skip_clone:
            return copy.copy(self)
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        return (
            f"SamplingParams(n={self.n}, "
            f"presence_penalty={self.presence_penalty}, "
            f"frequency_penalty={self.frequency_penalty}, "
            f"repetition_penalty={self.repetition_penalty}, "
            f"temperature={self.temperature}, "
            f"top_p={self.top_p}, "
            f"top_k={self.top_k}, "
            f"min_p={self.min_p}, "
            f"seed={self.seed}, "
            f"stop={self.stop}, "
            f"stop_token_ids={self.stop_token_ids}, "
            f"bad_words={self.bad_words}, "
            f"include_stop_str_in_output={self.include_stop_str_in_output}, "
            f"ignore_eos={self.ignore_eos}, "
            f"max_tokens={self.max_tokens}, "
            f"min_tokens={self.min_tokens}, "
            f"logprobs={self.logprobs}, "
            f"prompt_logprobs={self.prompt_logprobs}, "
            f"skip_special_tokens={self.skip_special_tokens}, "
            f"spaces_between_special_tokens={self.spaces_between_special_tokens}, "
            f"output_kind={self.output_kind.name}, "
            f"structured_outputs={self.structured_outputs}, "
            f"extra_args={self.extra_args})"
        )
