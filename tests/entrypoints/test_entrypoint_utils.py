"""engine/entrypoints/utils.py: the "non-default args" line LLM and
`glassbox serve` log at start-up (vLLM's log_non_default_args)."""

from __future__ import annotations

import argparse
import logging

import pytest

from engine.engine.arg_utils import EngineArgs
from engine.entrypoints.openai.cli_args import make_arg_parser
from engine.entrypoints.utils import get_non_default_args
from tests.helpers.engine_fixtures import make_llm
from tests.helpers.tiny_model import make_tiny_model_dir


def test_engine_args_that_differ_from_the_defaults():
    args = EngineArgs(model="m", max_num_seqs=8, performance_mode="throughput")
    assert get_non_default_args(args) == {
        "max_num_seqs": 8,
        "performance_mode": "throughput",
        "model": "m",
    }
    assert get_non_default_args(EngineArgs()) == {}


def test_cli_arguments_that_differ_from_the_parsers_defaults():
    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args(["m", "--port", "9000", "-O0", "--max-model-len", "2k"])
    assert get_non_default_args(args) == {
        "model_tag": "m",
        "port": 9000,
        "optimization_level": 0,
        "max_model_len": 2000,
    }
    with pytest.raises(TypeError, match="must be an argparse.Namespace or EngineArgs"):
        get_non_default_args({"port": 9000})


def test_llm_logs_them_first(tmp_path, caplog):
    model = make_tiny_model_dir(tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="engine.entrypoints.utils"):
        make_llm(model, block_size=4)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "engine.entrypoints.utils"]
    assert line.startswith("non-default args: {") and "'block_size': 4" in line
