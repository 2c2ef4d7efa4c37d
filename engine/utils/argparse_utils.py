"""Command-line helpers shared by the CLIs.

vLLM twin: ``vllm/utils/argparse_utils.py`` (``FlexibleArgumentParser``).
Read it for how ``-O3`` becomes ``--optimization-level 3``: vLLM rewrites the
argument list before argparse sees it; ours gives argparse a short option
``-O`` whose type accepts the same spellings (``-O3``, ``-O 3``, ``-O=3``).
And ``human_readable_int``, vLLM's parser of ``32k`` (32,000) and ``32K``
(32,768) for the token and byte counts.
Sessions: 01.
``--max-model-len auto`` (or -1) is vLLM's request to fit the context to the
KV cache at start-up (``get_kv_cache_configs``).
"""

from __future__ import annotations

import argparse
import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

OPTIMIZATION_LEVELS = ("0", "1", "2", "3")


def optimization_level(text: str) -> int:
    """The value of ``-O`` / ``--optimization-level``: 0, 1, 2 or 3."""
    value = text[1:] if text.startswith("=") else text  # -O=3 reaches us as "=3"
    if value not in OPTIMIZATION_LEVELS:
        raise argparse.ArgumentTypeError(f"must be 0, 1, 2 or 3, got {text!r}")
    return int(value)


def human_readable_int(text: str) -> int:
    """``1k`` -> 1,000, ``1K`` -> 1,024, ``25.6k`` -> 25,600 (decimal suffixes take
    a fraction, binary ones do not), or a plain integer."""
    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"no decimals with a binary suffix ({text!r}); did you mean "
                f"{number}{suffix.lower()}?"
            )
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer, optionally with k/m/g/t (x1000) or K/M/G/T (x1024), got {text!r}"
        ) from None


def max_model_len(text: str) -> int:
    """``--max-model-len``: ``human_readable_int``, or ``auto`` / -1 (-1: fit the
    context to the KV cache)."""
    if text.strip().lower() in ("auto", "-1"):
        return -1
    return human_readable_int(text)
