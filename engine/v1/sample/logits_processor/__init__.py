"""Logits processors: the built-in list, custom ones, and building them.

vLLM twin: ``vllm/v1/sample/logits_processor/__init__.py``
(``BUILTIN_LOGITS_PROCESSORS``, ``build_logitsprocs``, loading custom
processors by class or by ``"module:Class"`` name,
``validate_logits_processors_parameters``).
Read it for: the engine builds its processors once, when the model runner
starts (``build_logitsprocs``: the three built-ins, then any custom classes);
the ``InputBatch`` keeps them and feeds them every step's ``BatchUpdate``; the
Sampler finds them in ``sampling_metadata.logitsprocs`` --
``non_argmax_invariant`` before greedy sampling, ``argmax_invariant`` after
temperature.
Sessions: 05, 06.

A custom processor is a ``LogitsProcessor`` subclass with the same
constructor ``(glassbox_config, device, is_pin_memory)``; pass the class, or
its name as ``"package.module:ClassName"``, in ``custom_logitsprocs``.

Simpler than vLLM: no plugin discovery through the ``vllm.logits_processors``
entry-point group and no ``AdapterLogitsProcessor`` wrapper; no
speculative-decoding rule (vLLM keeps only min-tokens when drafts are on).
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams
from engine.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    process_dict_updates,
)
from engine.v1.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from engine.v1.sample.logits_processor.state import BatchUpdateBuilder, LogitsProcessors

if TYPE_CHECKING:
    from engine.config import GlassboxConfig

# Error when a pooling model is given custom processors (vLLM's text).
STR_POOLING_REJECTS_LOGITSPROCS = "Pooling models do not support custom logits processors."
STR_SPEC_DEC_REJECTS_LOGITSPROCS = (
    "Custom logits processors are not supported with speculative decoding."
)

# Applied in this order within each group (vLLM's order).
BUILTIN_LOGITS_PROCESSORS: list[type[LogitsProcessor]] = [
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
]


def _load_custom_logitsprocs(
    logits_processors: Sequence[str | type[LogitsProcessor]] | None,
) -> list[type[LogitsProcessor]]:
    """Classes, or ``"module:Qualified.Name"`` strings, -> classes."""
    classes: list[type[LogitsProcessor]] = []
    for index, proc in enumerate(logits_processors or ()):
        if isinstance(proc, str):
            module_name, _, qualname = proc.partition(":")
            try:
                obj = importlib.import_module(module_name)
                for attr in qualname.split("."):
                    obj = getattr(obj, attr)
            except Exception as e:
                raise RuntimeError(f"Failed to load {index}th LogitsProcessor plugin {proc}") from e
            if not isinstance(obj, type):
                raise ValueError(f"Loaded logit processor must be a type, got {proc!r}.")
            proc = obj
        if not (isinstance(proc, type) and issubclass(proc, LogitsProcessor)):
            raise ValueError(f"{proc!r} is not a subclass of LogitsProcessor")
        classes.append(proc)
    return classes


def build_logitsprocs(
    glassbox_config: GlassboxConfig,
    device: torch.device,
    is_pin_memory: bool,
    is_pooling_model: bool = False,
    custom_logitsprocs: Sequence[str | type[LogitsProcessor]] = (),
) -> LogitsProcessors:
    """The engine's processors: the built-ins, then the custom ones, each
    built once. A pooling model samples nothing and gets none."""
    if is_pooling_model:
        if custom_logitsprocs:
            raise ValueError(STR_POOLING_REJECTS_LOGITSPROCS)
        return LogitsProcessors()
    if glassbox_config.speculative_config is not None:
        # The rejection sampler applies min-tokens to the drafts; min-p and
        # logit bias are refused per request (InputProcessor), custom ones here.
        if custom_logitsprocs:
            raise ValueError(STR_SPEC_DEC_REJECTS_LOGITSPROCS)
        return LogitsProcessors([MinTokensLogitsProcessor(glassbox_config, device, is_pin_memory)])
    classes = itertools.chain(
        BUILTIN_LOGITS_PROCESSORS, _load_custom_logitsprocs(custom_logitsprocs)
    )
    return LogitsProcessors(cls(glassbox_config, device, is_pin_memory) for cls in classes)


@lru_cache
def _cached_load_custom_logitsprocs(
    logits_processors: tuple[str | type[LogitsProcessor], ...] | None,
) -> list[type[LogitsProcessor]]:
    return _load_custom_logitsprocs(logits_processors)


def validate_logits_processors_parameters(
    logits_processors: Sequence[str | type[LogitsProcessor]] | None,
    sampling_params: SamplingParams,
) -> None:
    """Let each custom processor refuse a request's params (ValueError)."""
    key = tuple(logits_processors) if logits_processors is not None else None
    for cls in _cached_load_custom_logitsprocs(key):
        cls.validate_params(sampling_params)


__all__ = [
    "BUILTIN_LOGITS_PROCESSORS",
    "STR_POOLING_REJECTS_LOGITSPROCS",
    "BatchUpdate",
    "BatchUpdateBuilder",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "build_logitsprocs",
    "process_dict_updates",
    "validate_logits_processors_parameters",
]
