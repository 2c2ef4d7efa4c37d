"""What the entry points share: the start-up line of arguments that differ
from their defaults.

vLLM twin: ``vllm/entrypoints/utils.py`` (``get_non_default_args``,
``log_non_default_args``).
Read it for: the first thing ``LLM(...)`` and ``glassbox serve`` log, which a
learner compares with vLLM's own "non-default args" line.
Sessions: 01.

Simpler than vLLM: only these two helpers (vLLM's module also holds request
helpers of its server: max-token rules, usage options, LoRA module lists).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from engine.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)


def get_non_default_args(args: argparse.Namespace | EngineArgs) -> dict[str, Any]:
    """Name -> value of every argument not at its default: a CLI namespace is
    compared with what ``glassbox serve`` parses from nothing, EngineArgs with
    ``EngineArgs(model=args.model)`` (the model is listed when given)."""
    if isinstance(args, argparse.Namespace):
        from engine.entrypoints.openai.cli_args import make_arg_parser

        defaults = vars(make_arg_parser(argparse.ArgumentParser()).parse_args([]))
        return {k: v for k, v in vars(args).items() if k in defaults and v != defaults[k]}
    if isinstance(args, EngineArgs):
        default = EngineArgs(model=args.model)
        changed = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(args)
            if getattr(args, f.name) != getattr(default, f.name)
        }
        if args.model is not None:
            changed["model"] = args.model
        return changed
    raise TypeError(f"args must be an argparse.Namespace or EngineArgs, got {type(args).__name__}")


def log_non_default_args(args: argparse.Namespace | EngineArgs) -> None:
    logger.info("non-default args: %s", get_non_default_args(args))
