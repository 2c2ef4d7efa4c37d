"""SpeculativeConfig: which proposer drafts tokens, and how many per step.

vLLM twin: ``vllm/config/speculative.py`` (``SpeculativeConfig``), plus the
speculative-decoding rule of ``VllmConfig.__post_init__``
(``vllm/config/vllm.py``) that decides whether async scheduling may stay on.
Read it for: how ``method`` is inferred when only ``model`` is given
(``"ngram"`` / ``"[ngram]"`` mean n-gram, anything else a draft model, and a
draft whose name contains ``eagle-`` is an EAGLE head); the n-gram window
defaults (``prompt_lookup_min`` / ``prompt_lookup_max``: 5 and 5 when neither
is given, the other one's value when one is); ``num_speculative_tokens``
(k, the drafts verified per request per step); and the draft model's
``max_model_len`` (the smaller of the draft's and the target's).
Sessions: 06 (speculative decoding).

Glassbox runs three methods: ``"ngram"`` (prompt lookup over the request's own
tokens, no model), ``"draft_model"`` (a smaller causal LM with the same
vocabulary) and ``"eagle"`` (an EAGLE-1 head over the target's hidden states).

``LLM(speculative_config={...})`` and ``--speculative-config JSON`` build it
with ``SpeculativeConfig.from_dict``, which names any key it does not know.

Simpler than vLLM: no medusa, mlp_speculator, MTP, EAGLE-3, DFlash, suffix,
ngram_gpu or custom-class proposers (and no ``custom_class`` guess from a
dotted ``model``); ``num_speculative_tokens`` is always required (vLLM can take
it from a draft checkpoint's ``n_predict``); the method is never guessed from
the draft's ``config.json`` (vLLM does so for medusa, mlp_speculator and MTP).
The draft's ``ModelConfig`` (``draft_model_config``) is built by
``GlassboxConfig`` (``_create_draft_model_config``), which then calls
``verify_equal_vocab_size_if_draft_model`` and
``_maybe_override_draft_max_model_len``; vLLM builds it in this class. The
draft's context may not be shorter than the target's (vLLM allows it).
Left out (vLLM fields with no meaning here): ``enforce_eager``,
``quantization``, ``revision``, ``code_revision``, ``moe_backend``,
``attention_backend``, ``draft_load_config``, ``disable_padded_drafter_batch``
(the drafter's first pass always takes only the verified tokens, the way vLLM
drafts with it set), ``use_local_argmax_reduction``, ``parallel_drafting``,
``rejection_sample_method`` and ``synthetic_acceptance_*`` (always the standard
rejection sampler), ``draft_sample_method`` (drafts are always greedy) and the
``suffix_decoding_*`` fields. ``from_dict`` says so when given one of them.

Differs from vLLM on purpose: vLLM ignores a ``model`` given with
``method="ngram"`` and overwrites ``prompt_lookup_*`` given with a model-based
method; Glassbox rejects both, since either is a mistake in the user's config.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

logger = logging.getLogger(__name__)

SpeculativeMethod = Literal["ngram", "draft_model", "eagle"]

# vLLM spellings that mean n-gram.
_NGRAM_ALIASES = ("ngram", "[ngram]")
# vLLM methods Glassbox does not implement (told apart from a typo in the error).
_VLLM_ONLY_METHODS = (
    "medusa",
    "mlp_speculator",
    "suffix",
    "custom_class",
    "eagle3",
    "extract_hidden_states",
    "mtp",
    "dflash",
    "ngram_gpu",
)
# vLLM fields Glassbox has no use for; from_dict names them apart from typos.
_VLLM_ONLY_FIELDS = (
    "enforce_eager",
    "quantization",
    "moe_backend",
    "attention_backend",
    "revision",
    "code_revision",
    "disable_padded_drafter_batch",
    "use_local_argmax_reduction",
    "parallel_drafting",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "draft_load_config",
    "rejection_sample_method",
    "synthetic_acceptance_rates",
    "synthetic_acceptance_length",
    "draft_sample_method",
)

# Async scheduling with speculation (vLLM's VllmConfig rule, restricted to our
# methods): EAGLE keeps it on by default; a draft model may use it only when
# the user asks for it; n-gram (the CPU proposer) never.
_ASYNC_SCHEDULING_DEFAULT_METHODS = ("eagle",)
_ASYNC_SCHEDULING_ALLOWED_METHODS = ("eagle", "draft_model")
# Most drafts one request may verify in a step: the rejection sampler's
# kernels work on tiles of this size (vLLM asserts it in the sampler; Glassbox
# refuses a larger num_speculative_tokens up front).
MAX_NUM_SPECULATIVE_TOKENS = 128


class _HasVocabSize(Protocol):
    @property
    def vocab_size(self) -> int: ...


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int | None = None
    """k: drafts proposed, and verified by the target, per request per step."""
    model: str | None = None
    """The draft model or EAGLE head (folder or cached Hub name); for n-gram
    only ``"ngram"`` / ``"[ngram]"`` (or nothing)."""
    method: SpeculativeMethod | None = None
    """``"ngram"``, ``"draft_model"`` or ``"eagle"``. None: inferred from
    ``model`` as vLLM does (``"ngram"`` -> n-gram, else a draft model)."""
    draft_tensor_parallel_size: int | None = None
    """The draft's tensor-parallel size; Glassbox runs the draft on the target's
    ranks, so it must equal ``tensor_parallel_size`` (checked by GlassboxConfig)."""
    max_model_len: int | None = None
    """Cap on the draft model's context length (None: the smaller of the
    draft's and the target's)."""
    prompt_lookup_max: int | None = None
    """n-gram: the longest suffix searched for in the request's tokens."""
    prompt_lookup_min: int | None = None
    """n-gram: the shortest suffix that counts as a match."""
    draft_model_config: Any = dataclasses.field(default=None, init=False, repr=False)
    """The draft's (or EAGLE head's) ``ModelConfig``; set by
    ``GlassboxConfig`` from ``model`` (None for n-gram)."""

    def __post_init__(self) -> None:
        self._resolve_method()
        self._check_num_speculative_tokens()
        draft_tp = self.draft_tensor_parallel_size
        if draft_tp is not None and (not _is_int(draft_tp) or draft_tp < 1):
            raise ValueError(
                f"draft_tensor_parallel_size must be an integer >= 1, got {draft_tp!r}"
            )
        if self.max_model_len is not None and (
            not _is_int(self.max_model_len) or self.max_model_len < 1
        ):
            raise ValueError(
                "speculative_config.max_model_len must be an integer >= 1, "
                f"got {self.max_model_len!r}"
            )
        if self.method == "ngram":
            self._resolve_prompt_lookup()
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} applies only to method='ngram', "
                        f"not method={self.method!r}"
                    )

    def _resolve_method(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a string, got {self.model!r}")
        if self.method is None:
            self.method = "ngram" if self.model in _NGRAM_ALIASES else "draft_model"
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method in _VLLM_ONLY_METHODS:
            raise ValueError(
                f"method={self.method!r} is a vLLM method Glassbox does not implement; "
                f"use one of {get_args(SpeculativeMethod)}"
            )
        if self.method not in get_args(SpeculativeMethod):
            raise ValueError(
                f"method={self.method!r} is not a speculative method; "
                f"use one of {get_args(SpeculativeMethod)}"
            )
        if self.method == "ngram":
            if self.model is not None and self.model not in _NGRAM_ALIASES:
                raise ValueError(
                    f"speculative_config.model={self.model!r} given with method='ngram', "
                    "which uses no model; drop model, or use method='draft_model' or 'eagle'"
                )
            self.model = "ngram"
            return
        if self.model is None:
            raise ValueError(
                f"speculative_config.model is required for method={self.method!r} "
                "(the draft checkpoint's folder or Hub name)"
            )
        if self.method == "draft_model":
            # vLLM recognises EAGLE heads by the usual checkpoint names.
            name = self.model.lower()
            if "eagle-" in name:
                logger.info("model=%r names an EAGLE head: using method='eagle'", self.model)
                self.method = "eagle"
            elif "eagle3" in name or "dflash" in name:
                kind = "eagle3" if "eagle3" in name else "dflash"
                raise ValueError(
                    f"speculative_config.model={self.model!r} names a {kind} head (vLLM would use "
                    f"method={kind!r}), which Glassbox does not implement"
                )

    def _check_num_speculative_tokens(self) -> None:
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError(
                f"num_speculative_tokens is required (method={self.method!r}): "
                "how many drafts to propose per step"
            )
        if not _is_int(k) or k <= 0:
            raise ValueError(f"num_speculative_tokens must be an integer > 0, got {k!r}")
        if k > MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be at most {MAX_NUM_SPECULATIVE_TOKENS} (the "
                f"rejection sampler's limit), got {k}"
            )

    def _resolve_prompt_lookup(self) -> None:
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            # vLLM's defaults (it notes they were not tuned).
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeculativeConfig:
        """Build from ``LLM(speculative_config={...})`` or the parsed
        ``--speculative-config`` JSON; an unknown key is an error naming it.
        Glassbox's own (vLLM's pydantic config parses the dict)."""
        if not isinstance(data, Mapping):
            raise ValueError(
                f"speculative_config must be a dict (JSON object), got {type(data).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        for key in data:
            if key in known:
                continue
            if key == "tensor_parallel_size":
                hint = "use draft_tensor_parallel_size for the draft model"
            elif key in _VLLM_ONLY_FIELDS:
                hint = "a vLLM option Glassbox does not implement"
            else:
                hint = f"known keys: {', '.join(known)}"
            raise ValueError(f"speculative_config: unknown key {key!r} ({hint})")
        return cls(**data)

    # -- which proposer (vLLM's names) ------------------------------------
    def use_eagle(self) -> bool:
        return self.method == "eagle"

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    # -- async scheduling -------------------------------------------------
    def supports_async_scheduling(self) -> bool:
        """May async scheduling run with this method when the user asks for it?
        Glassbox's own: vLLM writes the test inline in ``VllmConfig``."""
        return self.method in _ASYNC_SCHEDULING_ALLOWED_METHODS

    def enables_async_scheduling_by_default(self) -> bool:
        """Does async scheduling stay on when the user leaves it unset?
        Glassbox's own: vLLM writes the test inline in ``VllmConfig``."""
        return self.method in _ASYNC_SCHEDULING_DEFAULT_METHODS

    def resolve_async_scheduling(self, async_scheduling: bool | None) -> bool | None:
        """vLLM's rule for ``SchedulerConfig.async_scheduling`` under speculation.

        True with a method that cannot run asynchronously is an error; None
        with a method that is not on by default turns it off (with a
        warning). Otherwise the value comes back unchanged (None still left
        to the executor rule). Glassbox's own: the speculative part of
        ``VllmConfig.__post_init__``'s async-scheduling decision."""
        if async_scheduling:
            if not self.supports_async_scheduling():
                raise ValueError(
                    f"async_scheduling: speculative method={self.method!r} cannot run with "
                    "async scheduling (only eagle and draft_model can); "
                    "use --no-async-scheduling"
                )
            return True
        if async_scheduling is None and not self.enables_async_scheduling_by_default():
            logger.warning(
                "Async scheduling is off: %s speculative decoding does not support it by default.",
                self.method,
            )
            return False
        return async_scheduling

    # -- checks the engine runs once the draft's ModelConfig exists --------
    def verify_equal_vocab_size_if_draft_model(
        self, target_model_config: _HasVocabSize, draft_model_config: _HasVocabSize
    ) -> None:
        """A draft model must score the same token ids as the target."""
        if not self.uses_draft_model():
            return
        target, draft = target_model_config.vocab_size, draft_model_config.vocab_size
        if target != draft:
            raise ValueError(
                f"speculative_config.model={self.model!r}: the draft's vocab_size={draft} "
                f"differs from the target's vocab_size={target}; the draft must use the "
                "target's tokenizer"
            )

    @staticmethod
    def _maybe_override_draft_max_model_len(
        speculative_max_model_len: int | None,
        draft_max_model_len: int,
        target_max_model_len: int,
    ) -> int:
        """The draft's context length: ``max_model_len`` if given (it may not
        exceed either model's), else the smaller of the two models'."""
        if speculative_max_model_len is None:
            return min(draft_max_model_len, target_max_model_len)
        for name, limit in (("draft", draft_max_model_len), ("target", target_max_model_len)):
            if speculative_max_model_len > limit:
                raise ValueError(
                    f"speculative_config.max_model_len={speculative_max_model_len} is larger "
                    f"than the {name} model's max_model_len={limit}"
                )
        return speculative_max_model_len
