"""Loading a tokenizer (vLLM twin: ``vllm/tokenizers/`` / ``transformers_utils``).

A thin wrapper over ``transformers.AutoTokenizer`` that fails with a message
naming the path. Sessions: 01.
"""

from __future__ import annotations

from typing import Any


def get_tokenizer(tokenizer_name: str, trust_remote_code: bool = False) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise ImportError("transformers is required to load a tokenizer") from e
    try:
        return AutoTokenizer.from_pretrained(tokenizer_name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {tokenizer_name!r}: {e}") from e
