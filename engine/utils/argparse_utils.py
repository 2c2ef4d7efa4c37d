"""Command-line helpers shared by the CLIs.

vLLM twin: ``vllm/utils/argparse_utils.py`` (``FlexibleArgumentParser``).
Read it for how ``-O3`` becomes ``--optimization-level 3``: vLLM rewrites the
argument list before argparse sees it; ours gives argparse a short option
``-O`` whose type accepts the same spellings (``-O3``, ``-O 3``, ``-O=3``).
Sessions: 01.
"""

from __future__ import annotations

import argparse

OPTIMIZATION_LEVELS = ("0", "1", "2", "3")


def optimization_level(text: str) -> int:
    """The value of ``-O`` / ``--optimization-level``: 0, 1, 2 or 3."""
    value = text[1:] if text.startswith("=") else text  # -O=3 reaches us as "=3"
    if value not in OPTIMIZATION_LEVELS:
        raise argparse.ArgumentTypeError(f"must be 0, 1, 2 or 3, got {text!r}")
    return int(value)
