"""Glassbox: an instrumented twin of vLLM V1 (vLLM twin: ``vllm/__init__.py``).

``from engine import LLM, SamplingParams`` mirrors ``from vllm import LLM, SamplingParams``.
Names are resolved lazily so that importing the pure-Python core (scheduler, KV
cache) never pulls in torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LLM": "engine.entrypoints.llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EngineArgs": "engine.engine.arg_utils",
    "LLMEngine": "engine.v1.engine.llm_engine",
}

__all__ = list(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
