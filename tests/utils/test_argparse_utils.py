"""engine/utils/argparse_utils.py: vLLM's human-readable integers on the CLIs
(``--max-model-len 32k``, ``--kv-cache-memory-bytes 4G``), twin of
``human_readable_int`` in vllm/utils/argparse_utils.py."""

from __future__ import annotations

import argparse

import pytest

from engine.entrypoints.openai.cli_args import engine_args_from_cli, make_arg_parser
from engine.utils.argparse_utils import human_readable_int, max_model_len


@pytest.mark.parametrize(
    "text, value",
    [
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25600),
        ("2m", 2_000_000),
        ("4G", 4 * 2**30),
        ("1t", 10**12),
        (" 42 ", 42),
        ("0", 0),
    ],
)
def test_human_readable_int(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("1.5K", "no decimals with a binary suffix ('1.5K'); did you mean 1.5k?"),
        ("12q", "must be an integer, optionally with k/m/g/t"),
        ("k", "must be an integer"),
    ],
)
def test_human_readable_int_refuses(text, message):
    with pytest.raises(
        argparse.ArgumentTypeError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        human_readable_int(text)


def test_max_model_len_auto_is_minus_one():
    assert [max_model_len(text) for text in ("auto", "-1", "AUTO", "8k")] == [-1, -1, -1, 8000]


def test_the_engine_flags_take_them(capsys):
    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "m",
            "--max-model-len",
            "2K",
            "--max-num-batched-tokens",
            "8k",
            "--kv-cache-memory-bytes",
            "1G",
        ]
    )
    engine_args = engine_args_from_cli(args)
    assert (engine_args.max_model_len, engine_args.max_num_batched_tokens) == (2048, 8000)
    assert engine_args.kv_cache_memory_bytes == 2**30
    assert parser.parse_args(["m", "--max-model-len", "auto"]).max_model_len == -1
